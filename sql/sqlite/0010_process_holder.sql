-- fastapi-workqueue: SQLite, version 10: which process holds a delivery (as PostgreSQL 0033, whose
-- header says why and how). The routines process_beat, process_stop and list_processes are in
-- fastapi_workqueue/database/sqlite_routines.py.

CREATE TABLE process (
    id                     TEXT PRIMARY KEY,
    hostname               TEXT NOT NULL,
    pid                    INTEGER NOT NULL,
    started_at             REAL NOT NULL,
    version                TEXT NOT NULL,
    subscriptions          TEXT NOT NULL,
    slots                  INTEGER NOT NULL,
    busy                   INTEGER NOT NULL,
    beat_interval_seconds  REAL NOT NULL,
    last_seen_at           REAL NOT NULL,
    stopped_at             REAL
);

ALTER TABLE delivery ADD COLUMN held_by TEXT;
