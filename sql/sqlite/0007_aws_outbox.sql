-- fastapi-workqueue: SQLite, version 7: what the AWS transport keeps in the database (as
-- PostgreSQL 0027, whose header says why). aws_binding holds the imported ARNs and queue URLs;
-- aws_outbox the publishes to aws topics made in a caller's transaction. SQLite has no row locks:
-- a relay takes its rows under a lease (relay_token, relay_until) in a short write transaction,
-- sends them, then marks them sent, so the file's write lock is never held across an SNS call.
-- A row whose lease ran out (its relay died) is taken again and sent with the same MessageID.

CREATE TABLE aws_binding (
    kind         TEXT NOT NULL CHECK (kind IN ('topic', 'subscription')),
    name         TEXT NOT NULL,
    region       TEXT NOT NULL,
    binding      TEXT NOT NULL,
    imported_at  REAL NOT NULL,
    PRIMARY KEY (kind, name)
);

CREATE TABLE aws_outbox (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    topic            TEXT NOT NULL,
    message_id       TEXT NOT NULL,
    partition_key    TEXT,
    body             TEXT NOT NULL,
    attributes       TEXT NOT NULL,
    created_at       REAL NOT NULL,
    next_attempt_at  REAL NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    last_error       TEXT,
    relay_token      TEXT,
    relay_until      REAL,
    sent_at          REAL
);
CREATE INDEX aws_outbox_unsent ON aws_outbox (id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_unsent_key ON aws_outbox (topic, partition_key, id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_sent ON aws_outbox (sent_at) WHERE sent_at IS NOT NULL;
