-- fastapi-workqueue: the SQLite schema, as a fresh file ends with it (through migration 0001).
--
-- This file is for reading: `workqueue migrate` (and the queue at start-up) applies the numbered
-- migrations (NNNN_*.sql): 0001_schema.sql is this file as release 0.1.0 ships it, and each later
-- release adds one migration and makes the same change here, never an edit of a migration a
-- release shipped (docs/design/migrations.md); tests/test_schema_file.py checks that the two build
-- the same sqlite_master. The tables, columns and indexes are PostgreSQL's
-- (sql/postgresql/schema.sql), with SQLite types: times are REAL seconds since the epoch (UTC),
-- UUIDs lower-case TEXT, JSON and arrays TEXT. The operations are the named statements of
-- queries.sql, run by fastapi_workqueue/database/sqlite_routines.py inside one BEGIN IMMEDIATE
-- transaction per operation (docs/design/dialects.md).

-- The migration runner's record of what it applied (fastapi_workqueue/database/sqlite.py creates
-- it before the first migration).
CREATE TABLE IF NOT EXISTS schema_migration (version INTEGER PRIMARY KEY, name TEXT NOT NULL, checksum TEXT NOT NULL, applied_at REAL NOT NULL);

CREATE TABLE topic (
    name               TEXT PRIMARY KEY,
    transport          TEXT NOT NULL DEFAULT 'database',
    max_payload_bytes  INTEGER CHECK (max_payload_bytes IS NULL OR max_payload_bytes > 0),
    is_fifo            INTEGER NOT NULL DEFAULT 0,
    status             TEXT NOT NULL DEFAULT 'Active' CHECK (status IN ('Active', 'Paused')),
    binding_config     TEXT,
    created_at         REAL NOT NULL,
    updated_at         REAL NOT NULL,
    retired_at         REAL
);

CREATE TABLE subscription (
    id                      INTEGER PRIMARY KEY,
    name                    TEXT NOT NULL UNIQUE,
    topic                   TEXT NOT NULL REFERENCES topic (name),
    handler_key             TEXT NOT NULL,
    partition_mode          TEXT NOT NULL DEFAULT 'None' CHECK (partition_mode IN ('None', 'Exclusive', 'Ordered')),
    lease_seconds           REAL NOT NULL DEFAULT 60 CHECK (lease_seconds > 0),
    max_attempts            INTEGER NOT NULL DEFAULT 5 CHECK (max_attempts >= 1),
    backoff_base_seconds    REAL NOT NULL DEFAULT 1 CHECK (backoff_base_seconds >= 0),
    backoff_max_seconds     REAL NOT NULL DEFAULT 300 CHECK (backoff_max_seconds >= 0),
    max_processing_seconds  REAL CHECK (max_processing_seconds IS NULL OR max_processing_seconds > 0),
    heartbeat_mode          TEXT NOT NULL DEFAULT 'Auto' CHECK (heartbeat_mode IN ('Auto', 'Manual')),
    filter                  TEXT,
    status                  TEXT NOT NULL DEFAULT 'Active' CHECK (status IN ('Active', 'Paused')),
    host_type               TEXT NOT NULL DEFAULT 'worker' CHECK (host_type IN ('worker', 'external')),
    retention_seconds       REAL NOT NULL DEFAULT 604800 CHECK (retention_seconds >= 0),
    binding_config          TEXT,
    created_at              REAL NOT NULL,
    updated_at              REAL NOT NULL,
    retired_at              REAL,  -- retired: no new deliveries, what it holds drains
    -- Flow limits, held across every process (docs/design/flow-control.md); NULL: none.
    max_in_flight           INTEGER CHECK (max_in_flight IS NULL OR max_in_flight >= 1),
    key_concurrency         INTEGER CHECK (key_concurrency IS NULL OR key_concurrency >= 1),
    rate_limit              TEXT,
    key_rate_limit          TEXT
);
CREATE INDEX subscription_topic ON subscription (topic);

CREATE TABLE message (
    id                 TEXT PRIMARY KEY,
    topic              TEXT NOT NULL,
    partition_key      TEXT,
    attributes         TEXT NOT NULL DEFAULT '{}',
    payload            TEXT,
    payload_ref        TEXT,
    correlation_id     TEXT,
    deduplication_key  TEXT,
    content_hash       TEXT NOT NULL,
    published_at       REAL NOT NULL
);
CREATE INDEX message_published_at ON message (published_at);
-- Search only (search_deliveries), partial: a message without the value costs nothing here.
CREATE INDEX message_partition_key ON message (partition_key, published_at) WHERE partition_key IS NOT NULL;
CREATE INDEX message_correlation_id ON message (correlation_id, published_at) WHERE correlation_id IS NOT NULL;
CREATE INDEX message_job ON message (json_extract(attributes, '$.job'), published_at)
    WHERE json_extract(attributes, '$.job') IS NOT NULL;

-- key_mode: 0 = claimed on its own; 1 = Exclusive key, 2 = Ordered key (through partition).
CREATE TABLE delivery (
    id                    INTEGER PRIMARY KEY AUTOINCREMENT,
    subscription_id       INTEGER NOT NULL,
    message_id            TEXT NOT NULL,
    partition_key         TEXT,
    key_mode              INTEGER NOT NULL DEFAULT 0 CHECK (key_mode IN (0, 1, 2)),
    status                TEXT NOT NULL DEFAULT 'Pending'
                          CHECK (status IN ('Pending', 'InFlight', 'Completed', 'DeadLettered', 'Discarded')),
    attempt               INTEGER NOT NULL DEFAULT 0,
    claim_count           INTEGER NOT NULL DEFAULT 0,
    max_attempts          INTEGER NOT NULL,
    backoff_base_seconds  REAL NOT NULL,
    backoff_max_seconds   REAL NOT NULL,
    backoff_schedule      TEXT,
    visible_at            REAL NOT NULL,
    lease_token           TEXT,
    lease_expires_at      REAL,
    claimed_at            REAL,
    cancel_requested      INTEGER NOT NULL DEFAULT 0,
    progress_percent      INTEGER,
    progress_message      TEXT,
    reason                TEXT,
    last_error            TEXT,
    note                  TEXT,
    created_at            REAL NOT NULL,
    settled_at            REAL,
    held_by               TEXT,
    watched               INTEGER,  -- PostgreSQL's NOTIFY of a job's end; a waiter here polls
    group_id              TEXT,     -- a member of this group (message_group): its end is counted
    priority              INTEGER NOT NULL DEFAULT 0   -- 0..9, higher claimed first
);
CREATE INDEX delivery_claim ON delivery (subscription_id, visible_at, id)
    WHERE status = 'Pending' AND key_mode = 0;
-- The same work with a priority above 0, claimed first (empty while nobody publishes with one).
CREATE INDEX delivery_claim_priority ON delivery (subscription_id, priority, visible_at, id)
    WHERE status = 'Pending' AND key_mode = 0 AND priority > 0;
CREATE INDEX delivery_ordered_head ON delivery (subscription_id, partition_key, id)
    WHERE key_mode = 2 AND status IN ('Pending', 'InFlight', 'DeadLettered');
CREATE INDEX delivery_exclusive_next ON delivery (subscription_id, partition_key, visible_at, id)
    WHERE key_mode = 1 AND status = 'Pending';
CREATE INDEX delivery_dead_letters ON delivery (subscription_id, id) WHERE status = 'DeadLettered';
CREATE INDEX delivery_settled ON delivery (settled_at) WHERE status IN ('Completed', 'Discarded');
CREATE INDEX delivery_message ON delivery (message_id);
-- The InFlight set (the sweeper filters it on lease_expires_at), on a column a heartbeat never
-- changes.
CREATE INDEX delivery_in_flight ON delivery (subscription_id) WHERE status = 'InFlight';

-- The attempts of a delivery off the happy path (a settle that retries, dead-letters or discards,
-- a lease expiry, a replay), at most 50 a delivery, removed with it (foreign key). A delivery
-- claimed and completed writes no row here.
CREATE TABLE delivery_attempt (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    delivery_id  INTEGER NOT NULL REFERENCES delivery (id) ON DELETE CASCADE,
    attempt      INTEGER NOT NULL,
    started_at   REAL,
    ended_at     REAL NOT NULL,
    held_by      TEXT,
    outcome      TEXT NOT NULL,
    reason       TEXT,
    error        TEXT
);
CREATE INDEX delivery_attempt_delivery ON delivery_attempt (delivery_id, id);

CREATE TABLE partition (
    subscription_id   INTEGER NOT NULL,
    partition_key     TEXT NOT NULL,
    holder_id         INTEGER,
    next_id           INTEGER,
    next_visible_at   REAL,
    blocked_id        INTEGER,
    next_priority     INTEGER NOT NULL DEFAULT 0,   -- the priority of next_id (0 without one)
    PRIMARY KEY (subscription_id, partition_key)
);
CREATE INDEX partition_ready ON partition (subscription_id, next_visible_at, next_id)
    WHERE holder_id IS NULL AND next_id IS NOT NULL;
CREATE INDEX partition_ready_priority ON partition (subscription_id, next_priority, next_visible_at, next_id)
    WHERE holder_id IS NULL AND next_id IS NOT NULL AND next_priority > 0;

-- The token buckets of rate limits (PostgreSQL's schema.sql says more): a subscription's own
-- (per_key 0, partition_key '') and one per partition key, purged once full again.
CREATE TABLE rate_bucket (
    subscription_id  INTEGER NOT NULL,
    per_key          INTEGER NOT NULL,
    partition_key    TEXT NOT NULL,
    tokens           REAL NOT NULL,
    updated_at       REAL NOT NULL,
    PRIMARY KEY (subscription_id, per_key, partition_key)
);

CREATE TABLE deduplication (
    topic              TEXT NOT NULL,
    deduplication_key  TEXT NOT NULL,
    message_id         TEXT NOT NULL,
    expires_at         REAL NOT NULL,
    PRIMARY KEY (topic, deduplication_key)
);
CREATE INDEX deduplication_expires_at ON deduplication (expires_at);

CREATE TABLE once_marker (
    key         TEXT PRIMARY KEY,
    state       TEXT NOT NULL CHECK (state IN ('Running', 'Done')),
    token       TEXT,
    expires_at  REAL NOT NULL
);
CREATE INDEX once_marker_expires_at ON once_marker (expires_at);

-- Two unrevoked keys never share a name. topics: a JSON array of the topics (or patterns with *)
-- the key may publish to, NULL for every topic but the job queues'. session_generation: counted up
-- when a person signs out of the dashboard, which ends the sessions made with the key before.
CREATE TABLE api_key (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    prefix        TEXT NOT NULL UNIQUE,
    key_hash      TEXT NOT NULL,
    scopes        TEXT NOT NULL,
    created_at    REAL NOT NULL,
    expires_at    REAL,
    revoked_at    REAL,
    last_used_at  REAL,
    topics        TEXT,
    session_generation INTEGER NOT NULL DEFAULT 0
);

CREATE UNIQUE INDEX api_key_name_live ON api_key (name) WHERE revoked_at IS NULL;

-- The processes that run a host; delivery.held_by names the one that claimed it (PostgreSQL's
-- schema.sql says more).
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

-- The Completed and Discarded deliveries of each subscription, counted as they are made and
-- deleted: stats reads them here, not from the history.
CREATE TABLE settled_count (
    subscription_id  INTEGER PRIMARY KEY,
    completed        INTEGER NOT NULL,
    discarded        INTEGER NOT NULL
);

-- The JSON result of each named step of a message's work (the jobs layer's durable steps), the
-- first write winning; removed with the message.
CREATE TABLE step_result (
    message_id  TEXT NOT NULL REFERENCES message (id) ON DELETE CASCADE,
    name        TEXT NOT NULL,
    value       TEXT NOT NULL,
    created_at  REAL NOT NULL,
    PRIMARY KEY (message_id, name)
);

-- The result of a message's work (a job declared store_result=True): JSON text written in the
-- transaction that completes the delivery; removed with the message.
CREATE TABLE message_result (
    message_id  TEXT PRIMARY KEY REFERENCES message (id) ON DELETE CASCADE,
    value       TEXT NOT NULL,
    stored_at   REAL NOT NULL
);

-- Groups (fan-in): a message held back (visible at 9999-12-31) until every member has ended
-- (PostgreSQL's schema.sql says more). The trigger delivery_ended counts a member's first end down
-- in the transaction that ends it (SQLite's one writer keeps two ends apart); the end that reaches
-- 0 makes the held message due.
CREATE TABLE message_group (
    id               TEXT PRIMARY KEY,
    then_message_id  TEXT NOT NULL REFERENCES message (id) ON DELETE CASCADE,
    members          INTEGER NOT NULL,
    remaining        INTEGER NOT NULL,
    created_at       REAL NOT NULL,
    released_at      REAL
);
CREATE INDEX message_group_then ON message_group (then_message_id);

CREATE TABLE message_group_member (
    group_id    TEXT NOT NULL REFERENCES message_group (id) ON DELETE CASCADE,
    message_id  TEXT NOT NULL,
    ordinal     INTEGER NOT NULL,
    ended_at    REAL,
    PRIMARY KEY (group_id, message_id)
);

CREATE TRIGGER delivery_ended AFTER UPDATE OF status ON delivery
FOR EACH ROW
WHEN NEW.group_id IS NOT NULL AND NEW.status IN ('Completed', 'DeadLettered', 'Discarded')
     AND OLD.status IS NOT NEW.status
BEGIN
    UPDATE message_group SET remaining = remaining - 1
    WHERE id = NEW.group_id AND EXISTS (
        SELECT 1 FROM message_group_member mm
        WHERE mm.group_id = NEW.group_id AND mm.message_id = NEW.message_id AND mm.ended_at IS NULL);
    UPDATE message_group_member SET ended_at = coalesce(NEW.settled_at, (julianday('now') - 2440587.5) * 86400.0)
    WHERE group_id = NEW.group_id AND message_id = NEW.message_id AND ended_at IS NULL;
    UPDATE delivery SET visible_at = coalesce(NEW.settled_at, (julianday('now') - 2440587.5) * 86400.0)
    WHERE status = 'Pending' AND key_mode = 0 AND message_id = (
        SELECT g.then_message_id FROM message_group g
        WHERE g.id = NEW.group_id AND g.remaining = 0 AND g.released_at IS NULL);
    UPDATE message_group SET released_at = coalesce(NEW.settled_at, (julianday('now') - 2440587.5) * 86400.0)
    WHERE id = NEW.group_id AND remaining = 0 AND released_at IS NULL;
END;

-- One row per subscription per minute, written by the sweeper (record_stats_history): the live
-- counts and the deliveries Completed in the window since the previous row (window_seconds long).
-- Kept a day; the dashboard charts the last hour.
CREATE TABLE stats_history (
    subscription_id  INTEGER NOT NULL,
    recorded_at      REAL NOT NULL,
    pending          INTEGER NOT NULL,
    in_flight        INTEGER NOT NULL,
    dead_lettered    INTEGER NOT NULL,
    completed        INTEGER NOT NULL,
    window_seconds   REAL NOT NULL,
    PRIMARY KEY (subscription_id, recorded_at)
);
CREATE INDEX stats_history_recorded_at ON stats_history (recorded_at);

-- The sweep lock: one pass at a time across processes (PostgreSQL: an advisory transaction lock).
CREATE TABLE lock (
    name        TEXT PRIMARY KEY,
    holder      TEXT NOT NULL,
    expires_at  REAL NOT NULL
);

-- The AWS transport: the imported bindings, and the outbox of publishes to aws topics made in a
-- caller's transaction, which the relay takes under a lease (relay_token, relay_until) and forwards to SNS.
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
