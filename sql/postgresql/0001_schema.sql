-- fastapi-workqueue: PostgreSQL schema, version 1.
-- Tables of the topology (topic, subscription), of the work (message, delivery, partition) and of
-- the deduplication ledger. Every write to them goes through the functions of 0002; runtime roles
-- hold EXECUTE on those functions and no DML on these tables (roles/runtime_role.sql).

CREATE SCHEMA IF NOT EXISTS workqueue;

CREATE TABLE workqueue.topic (
    name               text PRIMARY KEY,
    transport          text NOT NULL DEFAULT 'database',
    max_payload_bytes  integer CHECK (max_payload_bytes IS NULL OR max_payload_bytes > 0),
    is_fifo            boolean NOT NULL DEFAULT false,
    status             text NOT NULL DEFAULT 'Active' CHECK (status IN ('Active', 'Paused')),
    binding_config     jsonb,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE workqueue.subscription (
    id                      integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name                    text NOT NULL UNIQUE,
    topic                   text NOT NULL REFERENCES workqueue.topic (name),
    handler_key             text NOT NULL,
    partition_mode          text NOT NULL DEFAULT 'None'
                            CHECK (partition_mode IN ('None', 'Exclusive', 'Ordered')),
    lease_seconds           double precision NOT NULL DEFAULT 60 CHECK (lease_seconds > 0),
    max_attempts            integer NOT NULL DEFAULT 5 CHECK (max_attempts >= 1),
    backoff_base_seconds    double precision NOT NULL DEFAULT 1 CHECK (backoff_base_seconds >= 0),
    backoff_max_seconds     double precision NOT NULL DEFAULT 300 CHECK (backoff_max_seconds >= 0),
    max_processing_seconds  double precision CHECK (max_processing_seconds IS NULL OR max_processing_seconds > 0),
    heartbeat_mode          text NOT NULL DEFAULT 'Auto' CHECK (heartbeat_mode IN ('Auto', 'Manual')),
    filter                  jsonb,
    status                  text NOT NULL DEFAULT 'Active' CHECK (status IN ('Active', 'Paused')),
    host_type               text NOT NULL DEFAULT 'worker' CHECK (host_type IN ('worker', 'external')),
    retention_seconds       double precision NOT NULL DEFAULT 604800 CHECK (retention_seconds >= 0),
    binding_config          jsonb,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX subscription_topic ON workqueue.subscription (topic);

CREATE TABLE workqueue.message (
    id                 uuid PRIMARY KEY,
    topic              text NOT NULL,
    partition_key      text,
    attributes         jsonb NOT NULL DEFAULT '{}'::jsonb,
    payload            text,              -- JSON text, kept as sent (jsonb would refuse \u0000)
    payload_ref        text,
    correlation_id     text,
    deduplication_key  text,
    content_hash       text NOT NULL,
    published_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX message_published_at ON workqueue.message (published_at);

-- key_mode: 0 = the delivery is claimed on its own (None mode, or no partition key);
-- 1 = Exclusive key, 2 = Ordered key: claimed through its row in workqueue.partition.
CREATE TABLE workqueue.delivery (
    id                    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription_id       integer NOT NULL,
    message_id            uuid NOT NULL,
    partition_key         text,
    key_mode              smallint NOT NULL DEFAULT 0 CHECK (key_mode IN (0, 1, 2)),
    status                text NOT NULL DEFAULT 'Pending'
                          CHECK (status IN ('Pending', 'InFlight', 'Completed', 'DeadLettered', 'Discarded')),
    attempt               integer NOT NULL DEFAULT 0,
    claim_count           integer NOT NULL DEFAULT 0,
    max_attempts          integer NOT NULL,
    backoff_base_seconds  double precision NOT NULL,
    backoff_max_seconds   double precision NOT NULL,
    backoff_schedule      double precision[],
    visible_at            timestamptz NOT NULL DEFAULT now(),
    lease_token           uuid,
    lease_expires_at      timestamptz,
    claimed_at            timestamptz,
    cancel_requested      boolean NOT NULL DEFAULT false,
    progress_percent      smallint,
    progress_message      text,
    reason                text,
    last_error            text,
    note                  text,
    created_at            timestamptz NOT NULL DEFAULT now(),
    settled_at            timestamptz
) WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);

-- Claimable work without a key lock: the head of this index is the next delivery to claim.
CREATE INDEX delivery_claim ON workqueue.delivery (subscription_id, visible_at, id)
    WHERE status = 'Pending' AND key_mode = 0;
-- Ordered keys: the head is the lowest id among Pending, InFlight and DeadLettered.
CREATE INDEX delivery_ordered_head ON workqueue.delivery (subscription_id, partition_key, id)
    WHERE key_mode = 2 AND status IN ('Pending', 'InFlight', 'DeadLettered');
-- Exclusive keys: the next delivery is the earliest visible Pending one.
CREATE INDEX delivery_exclusive_next ON workqueue.delivery (subscription_id, partition_key, visible_at, id)
    WHERE key_mode = 1 AND status = 'Pending';
CREATE INDEX delivery_lease ON workqueue.delivery (lease_expires_at) WHERE status = 'InFlight';
CREATE INDEX delivery_dead_letters ON workqueue.delivery (subscription_id, id) WHERE status = 'DeadLettered';
CREATE INDEX delivery_settled ON workqueue.delivery (settled_at) WHERE status IN ('Completed', 'Discarded');
CREATE INDEX delivery_message ON workqueue.delivery (message_id);

-- One row per (subscription, key) with live keyed work: the lock and the state of the key.
--   holder_id: the InFlight delivery of the key (at most one, ever).
--   next_id / next_visible_at: the delivery a claim takes next when there is no holder.
--   blocked_id: Ordered only, the DeadLettered head that blocks the key.
-- A key with none of the three has no row.
CREATE TABLE workqueue.partition (
    subscription_id   integer NOT NULL,
    partition_key     text NOT NULL,
    holder_id         bigint,
    next_id           bigint,
    next_visible_at   timestamptz,
    blocked_id        bigint,
    PRIMARY KEY (subscription_id, partition_key)
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);
CREATE INDEX partition_ready ON workqueue.partition (subscription_id, next_visible_at)
    WHERE holder_id IS NULL AND next_id IS NOT NULL;

CREATE TABLE workqueue.deduplication (
    topic              text NOT NULL,
    deduplication_key  text NOT NULL,
    message_id         uuid NOT NULL,
    expires_at         timestamptz NOT NULL,
    PRIMARY KEY (topic, deduplication_key)
);
CREATE INDEX deduplication_expires_at ON workqueue.deduplication (expires_at);
