-- fastapi-workqueue: SQLite, version 5: durable step results for the jobs layer (as PostgreSQL
-- 0025, whose header says what the jobs layer needs from the store). step_result keeps the JSON
-- result of each named step of a message's work, the first write winning; its foreign key to
-- message (ON DELETE CASCADE, enforced: the transport's connections set PRAGMA foreign_keys) takes
-- a message's steps away when the retention purge deletes the message. The other operations of
-- 0025 (the Discard outcome, claim_many, known_messages, message_deliveries,
-- release_deduplication_key, discard_dead_letters, rewrite_payload) need no schema change here:
-- they are routines of fastapi_workqueue/database/sqlite_routines.py.

CREATE TABLE step_result (
    message_id  TEXT NOT NULL REFERENCES message (id) ON DELETE CASCADE,
    name        TEXT NOT NULL,
    value       TEXT NOT NULL,
    created_at  REAL NOT NULL,
    PRIMARY KEY (message_id, name)
);
