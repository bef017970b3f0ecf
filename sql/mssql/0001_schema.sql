-- fastapi-workqueue: SQL Server schema, version 1 (SQL Server 2019 or later, compatibility level 130+).
--
-- The tables of sql/postgresql (0001 and the once markers of 0004, the API keys of 0006), column
-- for column. Every write to them goes through the stored procedures of 0002-0008 (one per
-- PostgreSQL function, same name, parameters and result columns); the runtime role holds EXECUTE
-- on the schema and no DML on these tables (roles/runtime_role.sql).
--
-- How the PostgreSQL types map:
--   uuid → uniqueidentifier; text → nvarchar(n) where the column is a key or indexed (the bound is
--   what the library accepts: names 200, partition and deduplication keys 512), nvarchar(max)
--   elsewhere; jsonb → nvarchar(max) with an ISJSON check; text[] and double precision[] →
--   nvarchar(max) holding a JSON array; timestamptz → datetimeoffset(6); double precision → float;
--   boolean → bit; partial indexes → filtered indexes.
--
-- Text compares as it does on PostgreSQL: every text column uses the binary collation
-- Latin1_General_100_BIN2, so names, keys, statuses and filter values are case-sensitive whatever
-- the database's default collation. (One difference remains: SQL Server ignores trailing spaces
-- when it compares nvarchar values, so two keys that differ only by trailing spaces are one key.)
--
-- Key size: SQL Server caps a clustered index key at 900 bytes and a nonclustered one at 1700. A
-- partition key (512 characters, 1024 bytes) does not fit a clustered key, so the tables keyed by
-- one keep a nonclustered primary key and cluster on something narrower (or stay heaps).
--
-- The migration bookkeeping table workqueue.schema_migration (version, name, checksum,
-- applied_at) is created by the migration runner before it applies this file, as on PostgreSQL.
-- The runner sends each batch (the text between GO lines) separately, in one transaction, under
-- the application lock 'workqueue.migrate'.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

IF SCHEMA_ID(N'workqueue') IS NULL
    EXEC (N'CREATE SCHEMA workqueue');
GO

CREATE TABLE workqueue.topic (
    name               nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    transport          nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL
                       CONSTRAINT topic_transport_default DEFAULT N'database',
    max_payload_bytes  int NULL
                       CONSTRAINT topic_max_payload_bytes_check CHECK (max_payload_bytes IS NULL OR max_payload_bytes > 0),
    is_fifo            bit NOT NULL CONSTRAINT topic_is_fifo_default DEFAULT 0,
    status             nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
                       CONSTRAINT topic_status_default DEFAULT N'Active'
                       CONSTRAINT topic_status_check CHECK (status IN (N'Active', N'Paused')),
    binding_config     nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
                       CONSTRAINT topic_binding_config_json CHECK (ISJSON(binding_config) = 1),
    created_at         datetimeoffset(6) NOT NULL CONSTRAINT topic_created_at_default DEFAULT SYSDATETIMEOFFSET(),
    updated_at         datetimeoffset(6) NOT NULL CONSTRAINT topic_updated_at_default DEFAULT SYSDATETIMEOFFSET(),
    CONSTRAINT topic_pk PRIMARY KEY CLUSTERED (name)
);

CREATE TABLE workqueue.subscription (
    id                      int IDENTITY(1, 1) NOT NULL,
    name                    nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    topic                   nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL
                            CONSTRAINT subscription_topic_fk REFERENCES workqueue.topic (name),
    handler_key             nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL,
    partition_mode          nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
                            CONSTRAINT subscription_partition_mode_default DEFAULT N'None'
                            CONSTRAINT subscription_partition_mode_check
                                CHECK (partition_mode IN (N'None', N'Exclusive', N'Ordered')),
    lease_seconds           float NOT NULL CONSTRAINT subscription_lease_seconds_default DEFAULT 60
                            CONSTRAINT subscription_lease_seconds_check CHECK (lease_seconds > 0),
    max_attempts            int NOT NULL CONSTRAINT subscription_max_attempts_default DEFAULT 5
                            CONSTRAINT subscription_max_attempts_check CHECK (max_attempts >= 1),
    backoff_base_seconds    float NOT NULL CONSTRAINT subscription_backoff_base_default DEFAULT 1
                            CONSTRAINT subscription_backoff_base_check CHECK (backoff_base_seconds >= 0),
    backoff_max_seconds     float NOT NULL CONSTRAINT subscription_backoff_max_default DEFAULT 300
                            CONSTRAINT subscription_backoff_max_check CHECK (backoff_max_seconds >= 0),
    max_processing_seconds  float NULL
                            CONSTRAINT subscription_max_processing_check
                                CHECK (max_processing_seconds IS NULL OR max_processing_seconds > 0),
    heartbeat_mode          nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
                            CONSTRAINT subscription_heartbeat_mode_default DEFAULT N'Auto'
                            CONSTRAINT subscription_heartbeat_mode_check CHECK (heartbeat_mode IN (N'Auto', N'Manual')),
    filter                  nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
                            CONSTRAINT subscription_filter_json CHECK (ISJSON(filter) = 1),
    status                  nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
                            CONSTRAINT subscription_status_default DEFAULT N'Active'
                            CONSTRAINT subscription_status_check CHECK (status IN (N'Active', N'Paused')),
    host_type               nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
                            CONSTRAINT subscription_host_type_default DEFAULT N'worker'
                            CONSTRAINT subscription_host_type_check CHECK (host_type IN (N'worker', N'external')),
    retention_seconds       float NOT NULL CONSTRAINT subscription_retention_default DEFAULT 604800
                            CONSTRAINT subscription_retention_check CHECK (retention_seconds >= 0),
    binding_config          nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
                            CONSTRAINT subscription_binding_config_json CHECK (ISJSON(binding_config) = 1),
    created_at              datetimeoffset(6) NOT NULL
                            CONSTRAINT subscription_created_at_default DEFAULT SYSDATETIMEOFFSET(),
    updated_at              datetimeoffset(6) NOT NULL
                            CONSTRAINT subscription_updated_at_default DEFAULT SYSDATETIMEOFFSET(),
    CONSTRAINT subscription_pk PRIMARY KEY CLUSTERED (id),
    CONSTRAINT subscription_name_unique UNIQUE (name)
);
CREATE INDEX subscription_topic ON workqueue.subscription (topic);

-- Messages are looked up by id but written and purged in publish order: the primary key is
-- nonclustered and the table clusters on published_at, so random uniqueidentifier values do not
-- split pages.
CREATE TABLE workqueue.message (
    id                 uniqueidentifier NOT NULL,
    topic              nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    partition_key      nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
    attributes         nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL
                       CONSTRAINT message_attributes_default DEFAULT N'{}'
                       CONSTRAINT message_attributes_json CHECK (ISJSON(attributes) = 1),
    payload            nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,  -- JSON text, kept as sent
    payload_ref        nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
    correlation_id     nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
    deduplication_key  nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
    content_hash       nvarchar(128) COLLATE Latin1_General_100_BIN2 NOT NULL,
    published_at       datetimeoffset(6) NOT NULL CONSTRAINT message_published_at_default DEFAULT SYSDATETIMEOFFSET(),
    CONSTRAINT message_pk PRIMARY KEY NONCLUSTERED (id)
);
CREATE CLUSTERED INDEX message_published_at ON workqueue.message (published_at);

-- key_mode: 0 = the delivery is claimed on its own (None mode, or no partition key);
-- 1 = Exclusive key, 2 = Ordered key: claimed through its row in workqueue.partition.
-- backoff_schedule: the fixed backoff a message was published with, a JSON array of seconds.
CREATE TABLE workqueue.delivery (
    id                    bigint IDENTITY(1, 1) NOT NULL,
    subscription_id       int NOT NULL,
    message_id            uniqueidentifier NOT NULL,
    partition_key         nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
    key_mode              smallint NOT NULL CONSTRAINT delivery_key_mode_default DEFAULT 0
                          CONSTRAINT delivery_key_mode_check CHECK (key_mode IN (0, 1, 2)),
    status                nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
                          CONSTRAINT delivery_status_default DEFAULT N'Pending'
                          CONSTRAINT delivery_status_check
                              CHECK (status IN (N'Pending', N'InFlight', N'Completed', N'DeadLettered', N'Discarded')),
    attempt               int NOT NULL CONSTRAINT delivery_attempt_default DEFAULT 0,
    claim_count           int NOT NULL CONSTRAINT delivery_claim_count_default DEFAULT 0,
    max_attempts          int NOT NULL,
    backoff_base_seconds  float NOT NULL,
    backoff_max_seconds   float NOT NULL,
    backoff_schedule      nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
                          CONSTRAINT delivery_backoff_schedule_json CHECK (ISJSON(backoff_schedule) = 1),
    visible_at            datetimeoffset(6) NOT NULL CONSTRAINT delivery_visible_at_default DEFAULT SYSDATETIMEOFFSET(),
    lease_token           uniqueidentifier NULL,
    lease_expires_at      datetimeoffset(6) NULL,
    claimed_at            datetimeoffset(6) NULL,
    cancel_requested      bit NOT NULL CONSTRAINT delivery_cancel_requested_default DEFAULT 0,
    progress_percent      smallint NULL,
    progress_message      nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
    reason                nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
    last_error            nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
    note                  nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
    created_at            datetimeoffset(6) NOT NULL CONSTRAINT delivery_created_at_default DEFAULT SYSDATETIMEOFFSET(),
    settled_at            datetimeoffset(6) NULL,
    CONSTRAINT delivery_pk PRIMARY KEY CLUSTERED (id) WITH (FILLFACTOR = 80)
);

-- Claimable work without a key lock: the head of this index is the next delivery to claim.
CREATE INDEX delivery_claim ON workqueue.delivery (subscription_id, visible_at, id)
    WHERE status = N'Pending' AND key_mode = 0;
-- Ordered keys: the head is the lowest id among Pending, InFlight and DeadLettered.
CREATE INDEX delivery_ordered_head ON workqueue.delivery (subscription_id, partition_key, id)
    WHERE key_mode = 2 AND status IN (N'Pending', N'InFlight', N'DeadLettered');
-- Exclusive keys: the next delivery is the earliest visible Pending one.
CREATE INDEX delivery_exclusive_next ON workqueue.delivery (subscription_id, partition_key, visible_at, id)
    WHERE key_mode = 1 AND status = N'Pending';
CREATE INDEX delivery_lease ON workqueue.delivery (lease_expires_at) WHERE status = N'InFlight';
CREATE INDEX delivery_dead_letters ON workqueue.delivery (subscription_id, id) WHERE status = N'DeadLettered';
CREATE INDEX delivery_settled ON workqueue.delivery (settled_at) WHERE status IN (N'Completed', N'Discarded');
CREATE INDEX delivery_message ON workqueue.delivery (message_id);

-- One row per (subscription, key) with live keyed work: the lock and the state of the key.
--   holder_id: the InFlight delivery of the key (at most one, ever).
--   next_id / next_visible_at: the delivery a claim takes next when there is no holder.
--   blocked_id: Ordered only, the DeadLettered head that blocks the key.
-- A key with none of the three has no row. A heap with a nonclustered primary key: the key is
-- too wide to cluster on (see the top of this file).
CREATE TABLE workqueue.partition (
    subscription_id   int NOT NULL,
    partition_key     nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
    holder_id         bigint NULL,
    next_id           bigint NULL,
    next_visible_at   datetimeoffset(6) NULL,
    blocked_id        bigint NULL,
    CONSTRAINT partition_pk PRIMARY KEY NONCLUSTERED (subscription_id, partition_key) WITH (FILLFACTOR = 70)
);
-- Deliberately not covering partition_key: a claim reading a key through this index then reads
-- the row itself, so its UPDLOCK/READPAST meets the lock that publish, refresh_partition, replay
-- and discard hold on the row (taken through the primary key). SQL Server locks index entries,
-- not logical rows; a covering index would let a claim and a publisher lock different entries
-- of one partition row.
CREATE INDEX partition_ready ON workqueue.partition (subscription_id, next_visible_at)
    INCLUDE (next_id)
    WHERE holder_id IS NULL AND next_id IS NOT NULL;

CREATE TABLE workqueue.deduplication (
    topic              nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    deduplication_key  nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
    message_id         uniqueidentifier NOT NULL,
    expires_at         datetimeoffset(6) NOT NULL,
    CONSTRAINT deduplication_pk PRIMARY KEY NONCLUSTERED (topic, deduplication_key)
);
CREATE CLUSTERED INDEX deduplication_expires_at ON workqueue.deduplication (expires_at);

-- Once markers behind context.once(key, fn) (PostgreSQL 0004). A key may be up to 850
-- characters here (a nonclustered key holds 1700 bytes); a longer key is refused with an error.
CREATE TABLE workqueue.once_marker (
    [key]       nvarchar(850) COLLATE Latin1_General_100_BIN2 NOT NULL,
    state       nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
                CONSTRAINT once_marker_state_check CHECK (state IN (N'Running', N'Done')),
    token       uniqueidentifier NULL,
    expires_at  datetimeoffset(6) NOT NULL,
    CONSTRAINT once_marker_pk PRIMARY KEY NONCLUSTERED ([key])
);
CREATE CLUSTERED INDEX once_marker_expires_at ON workqueue.once_marker (expires_at);

-- API keys for the REST publish and operator API (PostgreSQL 0006). Only the key's SHA-256 is
-- stored; scopes is a JSON array of scope names.
CREATE TABLE workqueue.api_key (
    id            uniqueidentifier NOT NULL,
    name          nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL,
    prefix        nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    key_hash      nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    scopes        nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL
                  CONSTRAINT api_key_scopes_json CHECK (ISJSON(scopes) = 1),
    created_at    datetimeoffset(6) NOT NULL CONSTRAINT api_key_created_at_default DEFAULT SYSDATETIMEOFFSET(),
    expires_at    datetimeoffset(6) NULL,
    revoked_at    datetimeoffset(6) NULL,
    last_used_at  datetimeoffset(6) NULL,
    CONSTRAINT api_key_pk PRIMARY KEY CLUSTERED (id),
    CONSTRAINT api_key_prefix_unique UNIQUE (prefix)
);
GO
