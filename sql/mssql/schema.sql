-- fastapi-workqueue: the SQL Server schema, as a fresh install ends with it (through migration 0001).
-- SQL Server 2019 or later, compatibility level 130+.
--
-- This file is for reading: the tables and their indexes first, then every procedure and function
-- grouped by concern, each with what it does; docs/design/ says why the code is written the way it
-- is, and docs/design/dialects.md where the T-SQL differs from PostgreSQL. `workqueue migrate`
-- applies the numbered migrations (NNNN_*.sql): 0001_schema.sql is this file as release 0.1.0
-- ships it, and each later release adds one migration and makes the same change here, never an
-- edit of a migration a release shipped (docs/design/migrations.md); tests/test_schema_file.py
-- checks that the objects the migrations leave, each with its definition, are the ones defined
-- here. The migration runner creates workqueue.schema_migration itself
-- (fastapi_workqueue/database/mssql.py) and sends each batch (the text between GO lines)
-- separately, in one transaction, under the application lock 'workqueue.migrate'.
--
-- The tables are PostgreSQL's, column for column, and every routine is a PostgreSQL function's
-- twin: same name, parameters and result columns (the "-- returns:" line above each procedure).
-- How the PostgreSQL types map: uuid → uniqueidentifier; text → nvarchar(n) where the column is a
-- key or indexed (the bound is what the library accepts: names 200, partition and deduplication
-- keys 512), nvarchar(max) elsewhere; jsonb → nvarchar(max) with an ISJSON check; text[] and
-- double precision[] → nvarchar(max) holding a JSON array; timestamptz → datetimeoffset(6); double
-- precision → float; boolean → bit; partial indexes → filtered indexes. Every text column uses the
-- binary collation Latin1_General_100_BIN2, so names, keys, statuses and filter values compare
-- case-sensitively, as on PostgreSQL (SQL Server still ignores trailing spaces when it compares
-- nvarchar values). A clustered index key holds 900 bytes and a nonclustered one 1700: a partition
-- key (512 characters, 1024 bytes) does not fit a clustered key, so the tables keyed by one keep a
-- nonclustered primary key and cluster on something narrower (or stay heaps).
--
-- Conventions of every procedure: SET NOCOUNT ON and, where it writes, SET XACT_ABORT ON with
-- TRY/CATCH/THROW (any error rolls the whole call back); its own transaction only when none is open
-- (@@TRANCOUNT = 0), otherwise it joins the caller's, as a PostgreSQL function does; one result set
-- per call for the routines that return rows, also when it is empty (a scalar function's value is
-- one row with one column named after the routine); arrays are JSON arrays in nvarchar(max), and
-- "[key]" of OPENJSON is the 0-based position; comparisons between variables name COLLATE
-- Latin1_General_100_BIN2; no LISTEN/NOTIFY (consumers poll). PostgreSQL's FOR UPDATE SKIP LOCKED
-- is WITH (UPDLOCK, READPAST, ROWLOCK), and since SQL Server locks index entries rather than rows,
-- every locking read also reads a column its index does not cover, which locks the row itself.

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
    retired_at         datetimeoffset(6) NULL,
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
    retired_at              datetimeoffset(6) NULL,
    -- Flow limits, held across every process (docs/design/flow-control.md); NULL: none.
    max_in_flight           int NULL CONSTRAINT subscription_max_in_flight_check
                                CHECK (max_in_flight IS NULL OR max_in_flight >= 1),
    key_concurrency         int NULL CONSTRAINT subscription_key_concurrency_check
                                CHECK (key_concurrency IS NULL OR key_concurrency >= 1),
    rate_limit              nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
    key_rate_limit          nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
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
    correlation_id     nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,  -- at most 512 (the envelope's rule)
    deduplication_key  nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
    content_hash       nvarchar(128) COLLATE Latin1_General_100_BIN2 NOT NULL,
    published_at       datetimeoffset(6) NOT NULL CONSTRAINT message_published_at_default DEFAULT SYSDATETIMEOFFSET(),
    -- Search only (search_deliveries): the job name, for message_job (PostgreSQL indexes the
    -- expression itself).
    job                AS CAST(JSON_VALUE(attributes, N'$.job') AS nvarchar(200)),
    CONSTRAINT message_pk PRIMARY KEY NONCLUSTERED (id)
);
CREATE CLUSTERED INDEX message_published_at ON workqueue.message (published_at);
-- Search only: a message by its partition key, correlation ID or job name, newest first (a filter
-- may not name a computed column, so message_job is not filtered).
CREATE INDEX message_partition_key ON workqueue.message (partition_key, published_at)
    WHERE partition_key IS NOT NULL;
CREATE INDEX message_correlation_id ON workqueue.message (correlation_id, published_at)
    WHERE correlation_id IS NOT NULL;
CREATE INDEX message_job ON workqueue.message (job, published_at);

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
    held_by               uniqueidentifier NULL,
    watched               bit NULL,  -- PostgreSQL's NOTIFY of a job's end; a waiter here polls
    group_id              uniqueidentifier NULL,  -- a member of this group (message_group): its end is counted
    priority              smallint NOT NULL CONSTRAINT delivery_priority_default DEFAULT 0
                          CONSTRAINT delivery_priority_check CHECK (priority BETWEEN 0 AND 9),
    CONSTRAINT delivery_pk PRIMARY KEY CLUSTERED (id) WITH (FILLFACTOR = 80)
);

-- Claimable work without a key lock: the head of this index is the next delivery to claim.
CREATE INDEX delivery_claim ON workqueue.delivery (subscription_id, visible_at, id)
    WHERE status = N'Pending' AND key_mode = 0;
-- The same work with a priority above 0, claimed first (empty while nobody publishes with one).
CREATE INDEX delivery_claim_priority ON workqueue.delivery (subscription_id, priority, visible_at, id)
    WHERE status = N'Pending' AND key_mode = 0 AND priority > 0;
-- Ordered keys: the head is the lowest id among Pending, InFlight and DeadLettered.
CREATE INDEX delivery_ordered_head ON workqueue.delivery (subscription_id, partition_key, id)
    WHERE key_mode = 2 AND status IN (N'Pending', N'InFlight', N'DeadLettered');
-- Exclusive keys: the next delivery is the earliest visible Pending one.
CREATE INDEX delivery_exclusive_next ON workqueue.delivery (subscription_id, partition_key, visible_at, id)
    WHERE key_mode = 1 AND status = N'Pending';
CREATE INDEX delivery_dead_letters ON workqueue.delivery (subscription_id, id) WHERE status = N'DeadLettered';
CREATE INDEX delivery_settled ON workqueue.delivery (settled_at) WHERE status IN (N'Completed', N'Discarded');
CREATE INDEX delivery_message ON workqueue.delivery (message_id);
-- The InFlight set (the sweeper filters it on lease_expires_at), on a column a heartbeat never
-- changes (no index names the column a heartbeat renews).
CREATE INDEX delivery_in_flight ON workqueue.delivery (subscription_id) WHERE status = N'InFlight';

-- The attempts of a delivery off the happy path, at most 50 a delivery, removed with it (PostgreSQL's
-- schema.sql says more). A delivery claimed and completed writes no row here.
CREATE TABLE workqueue.delivery_attempt (
    delivery_id  bigint NOT NULL
                 CONSTRAINT delivery_attempt_delivery_fk REFERENCES workqueue.delivery (id) ON DELETE CASCADE,
    id           bigint IDENTITY(1, 1) NOT NULL,
    attempt      int NOT NULL,
    started_at   datetimeoffset(6) NULL,
    ended_at     datetimeoffset(6) NOT NULL,
    held_by      uniqueidentifier NULL,
    outcome      nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
    reason       nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
    error        nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
    CONSTRAINT delivery_attempt_pk PRIMARY KEY CLUSTERED (delivery_id, id)
);

-- One row per (subscription, key) with live keyed work: the lock and the state of the key.
--   holder_id: the InFlight delivery of the key (at most one, ever).
--   next_id / next_visible_at: the delivery a claim takes next when there is no holder.
--   next_priority: the priority of next_id (0 without one): keys are claimed by it.
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
    next_priority     smallint NOT NULL CONSTRAINT partition_next_priority_default DEFAULT 0,
    CONSTRAINT partition_pk PRIMARY KEY NONCLUSTERED (subscription_id, partition_key) WITH (FILLFACTOR = 70)
);
-- Deliberately not covering partition_key: a claim reading a key through this index then reads
-- the row itself, so its UPDLOCK/READPAST meets the lock that publish, refresh_partition, replay
-- and discard hold on the row (taken through the primary key). SQL Server locks index entries,
-- not logical rows; a covering index would let a claim and a publisher lock different entries
-- of one partition row.
CREATE INDEX partition_ready ON workqueue.partition (subscription_id, next_visible_at, next_id)
    WHERE holder_id IS NULL AND next_id IS NOT NULL;
-- Keys whose next delivery has a priority above 0, claimed first (not covering either).
CREATE INDEX partition_ready_priority ON workqueue.partition (subscription_id, next_priority, next_visible_at, next_id)
    WHERE holder_id IS NULL AND next_id IS NOT NULL AND next_priority > 0;

-- Keys whose partition row a settle or lease expiry could not lock (another transaction held it):
-- their row may still name a settled holder until rederive_stale re-derives it. A heap with a
-- nonclustered primary key, as partition: the key is too wide to cluster on.
CREATE TABLE workqueue.partition_stale (
    subscription_id  int NOT NULL,
    partition_key    nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
    key_mode         smallint NOT NULL,
    CONSTRAINT partition_stale_pk PRIMARY KEY NONCLUSTERED (subscription_id, partition_key)
);

-- The token buckets of rate limits, shared by every process (PostgreSQL's schema.sql says more):
-- a subscription's own (per_key 0, partition_key '') and one per partition key, purged once full
-- again. A heap with a nonclustered primary key: the key is too wide to cluster on.
CREATE TABLE workqueue.rate_bucket (
    subscription_id  int NOT NULL,
    per_key          bit NOT NULL,
    partition_key    nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
    tokens           float NOT NULL,
    updated_at       datetimeoffset(6) NOT NULL,
    CONSTRAINT rate_bucket_pk PRIMARY KEY NONCLUSTERED (subscription_id, per_key, partition_key)
);

-- Deltas of each subscription's Completed and Discarded deliveries, whose sums are the counts
-- stats shows. A heap without a key: rows are only appended, summed all at
-- once by stats, and folded by fold_settled_counts.
CREATE TABLE workqueue.settled_count (
    subscription_id  int NOT NULL,
    completed        bigint NOT NULL,
    discarded        bigint NOT NULL
);

-- One row per subscription per minute, written by the sweeper (record_stats_history): the live
-- counts as stats reads them and the deliveries Completed in the window since the previous row
-- (window_seconds long). Kept a day; the dashboard charts the last hour.
CREATE TABLE workqueue.stats_history (
    subscription_id  int NOT NULL,
    recorded_at      datetimeoffset(6) NOT NULL,
    pending          bigint NOT NULL,
    in_flight        bigint NOT NULL,
    dead_lettered    bigint NOT NULL,
    completed        bigint NOT NULL,
    window_seconds   float NOT NULL,
    CONSTRAINT stats_history_pk PRIMARY KEY CLUSTERED (subscription_id, recorded_at)
);
CREATE INDEX stats_history_recorded_at ON workqueue.stats_history (recorded_at);

CREATE TABLE workqueue.deduplication (
    topic              nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    deduplication_key  nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
    message_id         uniqueidentifier NOT NULL,
    expires_at         datetimeoffset(6) NOT NULL,
    CONSTRAINT deduplication_pk PRIMARY KEY NONCLUSTERED (topic, deduplication_key)
);
CREATE CLUSTERED INDEX deduplication_expires_at ON workqueue.deduplication (expires_at);

-- Once markers behind context.once(key, fn). A key may be up to 850
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

-- API keys for the REST publish and operator API. Only the key's SHA-256 is
-- stored; scopes is a JSON array of scope names, topics one of the topics (or patterns with *) the
-- key may publish to (NULL: every topic but the job queues'). Two unrevoked keys never share a
-- name (api_key_create checks: name is nvarchar(max), which no index can hold).
-- session_generation is counted up by a dashboard sign-out.
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
    topics        nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
                  CONSTRAINT api_key_topics_json CHECK (topics IS NULL OR ISJSON(topics) = 1),
    session_generation int NOT NULL CONSTRAINT api_key_session_generation_default DEFAULT 0,
    CONSTRAINT api_key_pk PRIMARY KEY CLUSTERED (id),
    CONSTRAINT api_key_prefix_unique UNIQUE (prefix)
);

-- The JSON result of each named step of a message's work (the jobs layer's durable steps), the
-- first write winning; removed with the message (ON DELETE CASCADE). A step name is at most 400
-- characters here (a primary key holds 1700 bytes). The table clusters on created_at, as message
-- on published_at, so random uniqueidentifier values do not split its pages.
CREATE TABLE workqueue.step_result (
    message_id  uniqueidentifier NOT NULL
                CONSTRAINT step_result_message_fk REFERENCES workqueue.message (id) ON DELETE CASCADE,
    name        nvarchar(400) COLLATE Latin1_General_100_BIN2 NOT NULL,
    value       nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL,  -- JSON text, kept as sent
    created_at  datetimeoffset(6) NOT NULL CONSTRAINT step_result_created_at_default DEFAULT SYSDATETIMEOFFSET(),
    CONSTRAINT step_result_pk PRIMARY KEY NONCLUSTERED (message_id, name)
);

-- The result of a message's work (a job declared store_result=True): JSON text written by
-- result_put in the transaction that completes the delivery, removed with the message (ON DELETE
-- CASCADE); clustered on stored_at as step_result is on created_at.
CREATE TABLE workqueue.message_result (
    message_id  uniqueidentifier NOT NULL
                CONSTRAINT message_result_message_fk REFERENCES workqueue.message (id) ON DELETE CASCADE,
    value       nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL,  -- JSON text, kept as sent
    stored_at   datetimeoffset(6) NOT NULL CONSTRAINT message_result_stored_at_default DEFAULT SYSDATETIMEOFFSET(),
    CONSTRAINT message_result_pk PRIMARY KEY NONCLUSTERED (message_id)
);

-- Groups (fan-in): a message held back (visible at 9999-12-31) until every member has ended
-- (PostgreSQL's schema.sql says more). The trigger delivery_ended counts a member's first end down
-- under the group's row lock, in the transaction that ends it; the end that reaches 0 makes the
-- held message due, once. The group goes with its held message (ON DELETE CASCADE).
CREATE TABLE workqueue.message_group (
    id               uniqueidentifier NOT NULL,
    then_message_id  uniqueidentifier NOT NULL
                     CONSTRAINT message_group_then_fk REFERENCES workqueue.message (id) ON DELETE CASCADE,
    members          int NOT NULL,
    remaining        int NOT NULL,
    created_at       datetimeoffset(6) NOT NULL CONSTRAINT message_group_created_at_default DEFAULT SYSDATETIMEOFFSET(),
    released_at      datetimeoffset(6) NULL,
    CONSTRAINT message_group_pk PRIMARY KEY CLUSTERED (id)
);
CREATE INDEX message_group_then ON workqueue.message_group (then_message_id);

CREATE TABLE workqueue.message_group_member (
    group_id    uniqueidentifier NOT NULL
                CONSTRAINT message_group_member_group_fk REFERENCES workqueue.message_group (id) ON DELETE CASCADE,
    message_id  uniqueidentifier NOT NULL,
    ordinal     int NOT NULL,
    ended_at    datetimeoffset(6) NULL,
    CONSTRAINT message_group_member_pk PRIMARY KEY CLUSTERED (group_id, message_id)
);

-- The processes that run a host; delivery.held_by names the one that claimed it (PostgreSQL's
-- schema.sql says more).
CREATE TABLE workqueue.process (
    id                     uniqueidentifier NOT NULL,
    hostname               nvarchar(255) COLLATE Latin1_General_100_BIN2 NOT NULL,
    pid                    int NOT NULL,
    started_at             datetimeoffset(6) NOT NULL,
    version                nvarchar(64) COLLATE Latin1_General_100_BIN2 NOT NULL,
    subscriptions          nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL
                           CONSTRAINT process_subscriptions_json CHECK (ISJSON(subscriptions) = 1),
    slots                  int NOT NULL,
    busy                   int NOT NULL,
    beat_interval_seconds  float NOT NULL,
    last_seen_at           datetimeoffset(6) NOT NULL,
    stopped_at             datetimeoffset(6) NULL,
    CONSTRAINT process_pk PRIMARY KEY CLUSTERED (id)
);
CREATE CLUSTERED INDEX step_result_created_at ON workqueue.step_result (created_at);
CREATE CLUSTERED INDEX message_result_stored_at ON workqueue.message_result (stored_at);
GO

-- ---------------------------------------------------------------------------------------------
-- Helpers: the jitter source, backoff, the filter evaluator, and the state of keys
-- ---------------------------------------------------------------------------------------------

-- One uniform draw in [0, 1) per query. A function may not call RAND() itself (a side-effecting
-- operator); reading it through a view gives every call of backoff_seconds a draw of its own.
CREATE OR ALTER VIEW workqueue.random_draw
AS
SELECT RAND() AS value;
GO

-- A rate limit (N'50/s', N'10/m', N'3/h') in tokens per second; NULL for none.
-- returns: rate_per_second
CREATE OR ALTER FUNCTION workqueue.rate_per_second (@p_rate nvarchar(20))
RETURNS float
WITH SCHEMABINDING
AS
BEGIN
    RETURN CAST(LEFT(@p_rate, CHARINDEX(N'/', @p_rate) - 1) AS float)
        / CASE RIGHT(@p_rate, 1) WHEN N's' THEN 1.0 WHEN N'm' THEN 60.0 ELSE 3600.0 END;
END;
GO

-- Full-jitter exponential backoff with the fraction @p_draw (a draw of RAND() when it is NULL), or
-- the fixed schedule a delivery was published with (a JSON array of seconds). INLINE = OFF: an
-- inlined call would read the view once per statement and give every row of a statement the same delay. The exponent is capped at 64, far above any
-- backoff_max_seconds, so a very high attempt number cannot overflow the float.
-- returns: backoff_seconds
CREATE OR ALTER FUNCTION workqueue.backoff_seconds (
    @p_attempt int,
    @p_base float,
    @p_max float,
    @p_schedule nvarchar(max),
    @p_draw float = NULL
)
RETURNS float
WITH INLINE = OFF
AS
BEGIN
    DECLARE @v_steps int = 0;
    DECLARE @v_step int;
    DECLARE @v_draw float;
    DECLARE @v_exponent int;
    DECLARE @v_cap float;

    IF @p_schedule IS NOT NULL AND ISJSON(@p_schedule) = 1
        SELECT @v_steps = COUNT(*) FROM OPENJSON(@p_schedule);
    IF @v_steps > 0
    BEGIN
        SET @v_step = CASE
            WHEN @p_attempt < 1 THEN 1
            WHEN @p_attempt > @v_steps THEN @v_steps
            ELSE @p_attempt
        END;
        RETURN (
            SELECT CAST(s.value AS float)
            FROM OPENJSON(@p_schedule) AS s
            WHERE s.[key] = CAST(@v_step - 1 AS nvarchar(10))
        );
    END;

    SET @v_draw = @p_draw;
    IF @v_draw IS NULL
        SELECT @v_draw = r.value FROM workqueue.random_draw AS r;
    SET @v_exponent = CASE WHEN @p_attempt > 1 THEN @p_attempt - 1 ELSE 0 END;
    IF @v_exponent > 64
        SET @v_exponent = 64;
    SET @v_cap = @p_base * POWER(CAST(2 AS float), @v_exponent);
    RETURN @v_draw * CASE WHEN @p_max < @v_cap THEN @p_max ELSE @v_cap END;
END;
GO

-- The filter subset: {"field","operator","value"} leaves with eq, neq, startswith, isnull,
-- isnotnull, combined by {"logic": "and"|"or", "filters": [...]}. Case-sensitive, and exact: two
-- strings that differ only by trailing spaces differ here too (DATALENGTH is compared, since
-- SQL Server's = ignores trailing spaces). An attribute that is absent matches only isnull.
-- Validation of the allowed shape happens when a subscription is saved; this only evaluates.
-- returns: filter_matches
CREATE OR ALTER FUNCTION workqueue.filter_matches (
    @p_filter nvarchar(max),
    @p_attributes nvarchar(max)
)
RETURNS bit
AS
BEGIN
    DECLARE @v_has_filters int = 0;
    DECLARE @v_logic nvarchar(max);
    DECLARE @v_field nvarchar(max);
    DECLARE @v_operator nvarchar(max);
    DECLARE @v_expected nvarchar(max);
    DECLARE @v_value nvarchar(max);
    DECLARE @v_prefix nvarchar(max);

    IF @p_filter IS NULL OR LTRIM(RTRIM(@p_filter)) = N'null'
        RETURN 1;

    -- The members of the filter object (OPENJSON's [key] compares in a binary collation).
    SELECT @v_has_filters = 1 FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'filters';
    SELECT @v_logic = f.value FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'logic';
    SELECT @v_field = f.value FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'field';
    SELECT @v_operator = f.value FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'operator';
    SELECT @v_expected = f.value FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'value';

    IF @v_has_filters = 1
    BEGIN
        SET @v_logic = COALESCE(@v_logic, N'and');
        IF @v_logic = N'or' COLLATE Latin1_General_100_BIN2
            RETURN CASE
                WHEN EXISTS (
                    SELECT 1 FROM OPENJSON(@p_filter, N'$.filters') AS c
                    WHERE workqueue.filter_matches(c.value, @p_attributes) = 1
                ) THEN 1
                ELSE 0
            END;
        IF @v_logic = N'and' COLLATE Latin1_General_100_BIN2
            RETURN CASE
                WHEN EXISTS (
                    SELECT 1 FROM OPENJSON(@p_filter, N'$.filters') AS c
                    WHERE workqueue.filter_matches(c.value, @p_attributes) = 0
                ) THEN 0
                ELSE 1
            END;
        RETURN 0;
    END;

    SELECT @v_value = a.value
    FROM OPENJSON(COALESCE(@p_attributes, N'{}')) AS a
    WHERE a.[key] = @v_field COLLATE Latin1_General_100_BIN2
      AND DATALENGTH(a.[key]) = DATALENGTH(@v_field);

    SET @v_prefix = LEFT(@v_value, LEN(@v_expected + N'.') - 1);
    RETURN CASE @v_operator COLLATE Latin1_General_100_BIN2
        WHEN N'eq' THEN CASE
            WHEN @v_value IS NOT NULL AND @v_expected IS NOT NULL
                 AND @v_value = @v_expected COLLATE Latin1_General_100_BIN2
                 AND DATALENGTH(@v_value) = DATALENGTH(@v_expected) THEN 1
            ELSE 0
        END
        WHEN N'neq' THEN CASE
            WHEN @v_value IS NOT NULL AND @v_expected IS NOT NULL
                 AND NOT (@v_value = @v_expected COLLATE Latin1_General_100_BIN2
                          AND DATALENGTH(@v_value) = DATALENGTH(@v_expected)) THEN 1
            ELSE 0
        END
        WHEN N'startswith' THEN CASE
            WHEN @v_value IS NOT NULL AND @v_expected IS NOT NULL
                 AND @v_prefix = @v_expected COLLATE Latin1_General_100_BIN2
                 AND DATALENGTH(@v_prefix) = DATALENGTH(@v_expected) THEN 1
            ELSE 0
        END
        WHEN N'isnull' THEN CASE WHEN @v_value IS NULL THEN 1 ELSE 0 END
        WHEN N'isnotnull' THEN CASE WHEN @v_value IS NOT NULL THEN 1 ELSE 0 END
        ELSE 0
    END;
END;
GO

-- Re-derives the state of one key from its deliveries: the holder, the next delivery to claim
-- and (Ordered) the dead-lettered head that blocks it. Deletes the row of a key with no live work.
-- The caller must already hold the locks of the deliveries it changed.
--
-- PostgreSQL returns a boolean (true when the key can be claimed right now). Here it is the
-- procedure's return status (1 or 0) and no result set: the procedures that call it
-- (expire_leases, replay, discard, claim) would otherwise send that result set to their client.
-- returns: return status
CREATE OR ALTER PROCEDURE workqueue.refresh_partition
    @p_subscription_id int,
    @p_key nvarchar(512),
    @p_mode smallint
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_found bit = 0;
    DECLARE @v_holder bigint;
    DECLARE @v_next bigint;
    DECLARE @v_next_visible datetimeoffset(6);
    DECLARE @v_next_priority smallint = 0;
    DECLARE @v_head_priority smallint;
    DECLARE @v_blocked bigint;
    DECLARE @v_head_id bigint;
    DECLARE @v_head_status nvarchar(20);
    DECLARE @v_head_visible datetimeoffset(6);
    DECLARE @v_claimable int = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- Lock the key's row, creating it where needed (HOLDLOCK also locks an absent key).
        SELECT @v_found = 1, @v_holder = p.holder_id
        FROM workqueue.partition AS p WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
        WHERE p.subscription_id = @p_subscription_id AND p.partition_key = @p_key;
        IF @v_found = 0
            INSERT INTO workqueue.partition (subscription_id, partition_key)
            VALUES (@p_subscription_id, @p_key);

        IF @v_holder IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM workqueue.delivery AS d WHERE d.id = @v_holder AND d.status = N'InFlight'
        )
            SET @v_holder = NULL;

        IF @p_mode = 2
        BEGIN
            SELECT TOP (1) @v_head_id = d.id, @v_head_status = d.status, @v_head_visible = d.visible_at,
                         @v_head_priority = d.priority
            FROM workqueue.delivery AS d
            WHERE d.subscription_id = @p_subscription_id AND d.partition_key = @p_key AND d.key_mode = 2
              AND d.status IN (N'Pending', N'InFlight', N'DeadLettered')
            ORDER BY d.id;
            IF @v_head_id IS NOT NULL
            BEGIN
                IF @v_head_status = N'InFlight' COLLATE Latin1_General_100_BIN2
                    SET @v_holder = @v_head_id;
                ELSE IF @v_head_status = N'DeadLettered' COLLATE Latin1_General_100_BIN2
                    SET @v_blocked = @v_head_id;
                ELSE IF @v_holder IS NULL
                BEGIN
                    SET @v_next = @v_head_id;
                    SET @v_next_visible = @v_head_visible;
                    SET @v_next_priority = @v_head_priority;
                END;
            END;
        END
        ELSE IF @v_holder IS NULL
            SELECT TOP (1) @v_next = d.id, @v_next_visible = d.visible_at, @v_next_priority = d.priority
            FROM workqueue.delivery AS d
            WHERE d.subscription_id = @p_subscription_id AND d.partition_key = @p_key AND d.key_mode = 1
              AND d.status = N'Pending'
            ORDER BY d.visible_at, d.id;

        IF @v_holder IS NULL AND @v_next IS NULL AND @v_blocked IS NULL
            DELETE FROM workqueue.partition
            WHERE subscription_id = @p_subscription_id AND partition_key = @p_key;
        ELSE
        BEGIN
            UPDATE workqueue.partition
            SET holder_id = @v_holder, next_id = @v_next, next_visible_at = @v_next_visible,
                next_priority = @v_next_priority,
                blocked_id = @v_blocked
            WHERE subscription_id = @p_subscription_id AND partition_key = @p_key;
            IF @v_holder IS NULL AND @v_next IS NOT NULL AND @v_next_visible <= @v_now
                SET @v_claimable = 1;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    RETURN @v_claimable;
END;
GO

-- The keys of a batch of just-settled (or expired) deliveries: the deliveries in
-- @p_ids (a JSON array of ids) give up their hold, and each key this call can lock without waiting
-- (READPAST) gets its next delivery (Exclusive: the earliest visible Pending one; Ordered: the
-- head, or the dead-lettered head that blocks it) in one UPDATE; keys left with nothing are
-- deleted. A key another transaction holds (a producer, most likely) is written to
-- partition_stale and re-derived later by rederive_stale. Then the stale keys of the same
-- subscriptions are re-derived where nobody holds them. Returns the subscriptions with a key that
-- can be claimed now (PostgreSQL notifies them).
-- returns: subscription_id
CREATE OR ALTER PROCEDURE workqueue.release_keys
    @p_ids nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6);
    DECLARE @v_k int;
    DECLARE @v_k_count int;
    DECLARE @v_key_subscription int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_holder bigint;
    DECLARE @v_key_found bit;
    DECLARE @v_key_mode smallint;
    DECLARE @v_subscriptions nvarchar(max);
    DECLARE @v_ids TABLE (id bigint NOT NULL PRIMARY KEY);
    DECLARE @v_keys TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL,
        held bit NOT NULL DEFAULT 0
    );
    DECLARE @v_updated TABLE (
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
        holder_id bigint NULL,
        next_id bigint NULL,
        next_visible_at datetimeoffset(6) NULL,
        blocked_id bigint NULL
    );

    INSERT INTO @v_ids (id)
    SELECT DISTINCT CAST(a.value AS bigint)
    FROM OPENJSON(@p_ids) AS a
    WHERE a.value IS NOT NULL;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        INSERT INTO @v_keys (subscription_id, partition_key, key_mode)
        SELECT DISTINCT d.subscription_id, d.partition_key, d.key_mode
        FROM workqueue.delivery AS d
        INNER JOIN @v_ids AS i ON i.id = d.id
        WHERE d.key_mode > 0
        ORDER BY d.subscription_id, d.partition_key;
        SET @v_k_count = @@ROWCOUNT;

        -- Lock the keys nobody else holds, in key order (reading holder_id locks the row itself;
        -- READPAST skips a row another transaction holds); the next statement then reads their
        -- deliveries after every publish that touched them committed. A key held elsewhere is
        -- marked stale: reading key_mode with UPDLOCK, HOLDLOCK locks an existing marker's row,
        -- where rederive_stale takes it, so a marker written while the key is being re-derived
        -- waits for that re-derivation and then stays.
        SET @v_k = 1;
        WHILE @v_k <= @v_k_count
        BEGIN
            SELECT @v_key_subscription = k.subscription_id, @v_key = k.partition_key, @v_key_mode = k.key_mode
            FROM @v_keys AS k
            WHERE k.ord = @v_k;
            SET @v_key_found = 0;
            SELECT @v_key_found = 1, @v_key_holder = p.holder_id
            FROM workqueue.partition AS p WITH (UPDLOCK, READPAST, ROWLOCK)
            WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key;
            IF @v_key_found = 1
                UPDATE @v_keys SET held = 1 WHERE ord = @v_k;
            ELSE
            BEGIN
                SET @v_key_found = 0;
                SELECT @v_key_found = 1, @v_key_holder = ps.key_mode
                FROM workqueue.partition_stale AS ps WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                WHERE ps.subscription_id = @v_key_subscription AND ps.partition_key = @v_key;
                IF @v_key_found = 0
                    INSERT INTO workqueue.partition_stale (subscription_id, partition_key, key_mode)
                    VALUES (@v_key_subscription, @v_key, @v_key_mode);
            END;
            SET @v_k = @v_k + 1;
        END;

        SET @v_now = SYSDATETIMEOFFSET();
        WITH state AS (
            SELECT k.subscription_id, k.partition_key, k.key_mode,
                   o.id AS head_id, o.status AS head_status, o.visible_at AS head_visible_at,
                   o.priority AS head_priority,
                   e.id AS next_pending_id, e.visible_at AS next_pending_visible_at,
                   e.priority AS next_pending_priority
            FROM @v_keys AS k
            OUTER APPLY (
                SELECT TOP (1) d.id, d.status, d.visible_at, d.priority
                FROM workqueue.delivery AS d
                WHERE k.key_mode = 2 AND d.subscription_id = k.subscription_id
                  AND d.partition_key = k.partition_key AND d.key_mode = 2
                  AND d.status IN (N'Pending', N'InFlight', N'DeadLettered')
                ORDER BY d.id
            ) AS o
            OUTER APPLY (
                SELECT TOP (1) d.id, d.visible_at, d.priority
                FROM workqueue.delivery AS d
                WHERE k.key_mode = 1 AND d.subscription_id = k.subscription_id
                  AND d.partition_key = k.partition_key AND d.key_mode = 1 AND d.status = N'Pending'
                ORDER BY d.visible_at, d.id
            ) AS e
            WHERE k.held = 1
        ), n AS (
            SELECT s.subscription_id, s.partition_key, x.holder_id,
                   CASE WHEN x.holder_id IS NOT NULL THEN NULL
                        WHEN s.key_mode = 1 THEN s.next_pending_id
                        WHEN s.head_status = N'Pending' THEN s.head_id END AS next_id,
                   CASE WHEN x.holder_id IS NOT NULL THEN NULL
                        WHEN s.key_mode = 1 THEN s.next_pending_visible_at
                        WHEN s.head_status = N'Pending' THEN s.head_visible_at END AS next_visible_at,
                   CASE WHEN x.holder_id IS NOT NULL THEN 0
                        WHEN s.key_mode = 1 THEN COALESCE(s.next_pending_priority, 0)
                        WHEN s.head_status = N'Pending' THEN s.head_priority ELSE 0 END AS next_priority,
                   CASE WHEN s.key_mode = 2 AND s.head_status = N'DeadLettered' THEN s.head_id END AS blocked_id
            FROM state AS s
            INNER JOIN workqueue.partition AS cur
                ON cur.subscription_id = s.subscription_id AND cur.partition_key = s.partition_key
            CROSS APPLY (
                SELECT CASE WHEN s.key_mode = 2 AND s.head_status = N'InFlight' THEN s.head_id
                            WHEN EXISTS (SELECT 1 FROM @v_ids AS i WHERE i.id = cur.holder_id) THEN NULL
                            ELSE cur.holder_id END AS holder_id
            ) AS x
        )
        UPDATE p
        SET holder_id = n.holder_id, next_id = n.next_id, next_visible_at = n.next_visible_at,
            next_priority = n.next_priority,
            blocked_id = n.blocked_id
        OUTPUT inserted.subscription_id, inserted.partition_key, inserted.holder_id, inserted.next_id,
               inserted.next_visible_at, inserted.blocked_id
        INTO @v_updated (subscription_id, partition_key, holder_id, next_id, next_visible_at, blocked_id)
        FROM workqueue.partition AS p
        INNER JOIN n ON p.subscription_id = n.subscription_id AND p.partition_key = n.partition_key;

        DELETE p
        FROM workqueue.partition AS p
        INNER JOIN @v_updated AS u ON p.subscription_id = u.subscription_id AND p.partition_key = u.partition_key
        WHERE u.holder_id IS NULL AND u.next_id IS NULL AND u.blocked_id IS NULL;

        -- The next settle of a subscription also re-derives its keys that earlier ones left stale.
        IF EXISTS (
            SELECT 1 FROM workqueue.partition_stale AS ps
            WHERE ps.subscription_id IN (SELECT k.subscription_id FROM @v_keys AS k)
        )
        BEGIN
            SELECT @v_subscriptions = N'[' + STRING_AGG(CAST(s.subscription_id AS nvarchar(max)), N',') + N']'
            FROM (SELECT DISTINCT k.subscription_id FROM @v_keys AS k) AS s;
            EXEC workqueue.rederive_stale @p_subscription_ids = @v_subscriptions, @p_limit = 100;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT DISTINCT u.subscription_id
    FROM @v_updated AS u
    WHERE u.holder_id IS NULL AND u.next_id IS NOT NULL AND u.next_visible_at <= @v_now;
END;
GO

-- Re-derives (refresh_partition) up to @p_limit keys marked stale, of the subscriptions in
-- @p_subscription_ids (a JSON array; all when NULL), whose marker and partition row nobody else
-- holds (READPAST). A marker whose key has no row any more is dropped: a producer that creates
-- the row hands the key over itself. PostgreSQL returns the subscriptions that got a key claimable
-- now (to notify them); here the return status is the number of such keys, and no result set
-- (release_keys, claim and sweep call it; a result set would reach their client).
-- returns: return status
CREATE OR ALTER PROCEDURE workqueue.rederive_stale
    @p_subscription_ids nvarchar(max),
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_k int;
    DECLARE @v_k_count int;
    DECLARE @v_key_subscription int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_mode smallint;
    DECLARE @v_key_found bit;
    DECLARE @v_key_holder bigint;
    DECLARE @v_claimable int = 0;
    DECLARE @v_status int;
    DECLARE @v_marked TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL,
        free bit NOT NULL DEFAULT 0
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- The markers nobody else is writing or re-deriving (reading key_mode locks the row).
        INSERT INTO @v_marked (subscription_id, partition_key, key_mode)
        SELECT TOP (@p_limit) ps.subscription_id, ps.partition_key, ps.key_mode
        FROM workqueue.partition_stale AS ps WITH (UPDLOCK, READPAST, ROWLOCK)
        WHERE @p_subscription_ids IS NULL
           OR ps.subscription_id IN (SELECT CAST(a.value AS int) FROM OPENJSON(@p_subscription_ids) AS a)
        ORDER BY ps.subscription_id, ps.partition_key;
        SET @v_k_count = @@ROWCOUNT;

        -- Their partition rows, where no producer holds them, in key order.
        SET @v_k = 1;
        WHILE @v_k <= @v_k_count
        BEGIN
            SELECT @v_key_subscription = m.subscription_id, @v_key = m.partition_key
            FROM @v_marked AS m
            WHERE m.ord = @v_k;
            SET @v_key_found = 0;
            SELECT @v_key_found = 1, @v_key_holder = p.holder_id
            FROM workqueue.partition AS p WITH (UPDLOCK, READPAST, ROWLOCK)
            WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key;
            IF @v_key_found = 1
                UPDATE @v_marked SET free = 1 WHERE ord = @v_k;
            SET @v_k = @v_k + 1;
        END;

        -- Forget the markers before re-deriving: one written meanwhile waits for this transaction.
        DELETE ps
        FROM workqueue.partition_stale AS ps
        INNER JOIN @v_marked AS m
            ON m.subscription_id = ps.subscription_id AND m.partition_key = ps.partition_key
        WHERE m.free = 1 OR NOT EXISTS (
            SELECT 1 FROM workqueue.partition AS p
            WHERE p.subscription_id = m.subscription_id AND p.partition_key = m.partition_key
        );

        SET @v_k = 1;
        WHILE @v_k <= @v_k_count
        BEGIN
            SET @v_key = NULL;
            SELECT @v_key_subscription = m.subscription_id, @v_key = m.partition_key, @v_key_mode = m.key_mode
            FROM @v_marked AS m
            WHERE m.ord = @v_k AND m.free = 1;
            IF @v_key IS NOT NULL
            BEGIN
                EXEC @v_status = workqueue.refresh_partition
                    @p_subscription_id = @v_key_subscription, @p_key = @v_key, @p_mode = @v_key_mode;
                SET @v_claimable = @v_claimable + @v_status;
            END;
            SET @v_k = @v_k + 1;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    RETURN @v_claimable;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Topology
-- ---------------------------------------------------------------------------------------------

-- Creates a topic or updates its settings (the row is only written when something changed).
-- PostgreSQL's "IS DISTINCT FROM" is written as NOT EXISTS (... INTERSECT ...), which treats
-- two NULLs as equal.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.sync_topic
    @p_name nvarchar(200),
    @p_max_payload_bytes int,
    @p_is_fifo bit,
    @p_transport nvarchar(200) = N'database'
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        IF EXISTS (
            SELECT 1 FROM workqueue.topic AS t WITH (UPDLOCK, HOLDLOCK) WHERE t.name = @p_name
        )
            UPDATE t
            SET max_payload_bytes = @p_max_payload_bytes, is_fifo = @p_is_fifo,
                transport = @p_transport, updated_at = SYSDATETIMEOFFSET()
            FROM workqueue.topic AS t
            WHERE t.name = @p_name
              AND NOT EXISTS (
                  SELECT t.max_payload_bytes, t.is_fifo, t.transport
                  INTERSECT
                  SELECT @p_max_payload_bytes, @p_is_fifo, @p_transport
              );
        ELSE
            INSERT INTO workqueue.topic (name, transport, max_payload_bytes, is_fifo)
            VALUES (@p_name, @p_transport, @p_max_payload_bytes, @p_is_fifo);

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

-- Creates or updates a subscription's definition. The status (Active/Paused) is the operators'
-- and is only set when the subscription is created. A partition mode cannot change while the
-- subscription has live work (its deliveries were routed for the old mode). PostgreSQL retries
-- itself when another process created the row concurrently; here UPDLOCK + HOLDLOCK on the name
-- makes the second caller wait for the first and then update the row it created.
-- Error 51002 is PostgreSQL's object_in_use.
-- returns: sync_subscription
CREATE OR ALTER PROCEDURE workqueue.sync_subscription
    @p_name nvarchar(200),
    @p_topic nvarchar(200),
    @p_handler_key nvarchar(max),
    @p_partition_mode nvarchar(20),
    @p_lease_seconds float,
    @p_max_attempts int,
    @p_backoff_base_seconds float,
    @p_backoff_max_seconds float,
    @p_max_processing_seconds float,
    @p_heartbeat_mode nvarchar(20),
    @p_filter nvarchar(max),
    @p_host_type nvarchar(20),
    @p_retention_seconds float,
    @p_status nvarchar(20) = N'Active',
    @p_max_in_flight int = NULL,
    @p_key_concurrency int = NULL,
    @p_rate_limit nvarchar(20) = NULL,
    @p_key_rate_limit nvarchar(20) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_id int;
    DECLARE @v_topic nvarchar(200);
    DECLARE @v_partition_mode nvarchar(20);
    DECLARE @v_message nvarchar(2048);
    DECLARE @v_created TABLE (id int NOT NULL);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        SELECT @v_id = s.id, @v_topic = s.topic, @v_partition_mode = s.partition_mode
        FROM workqueue.subscription AS s WITH (UPDLOCK, HOLDLOCK)
        WHERE s.name = @p_name;

        IF @v_id IS NULL
        BEGIN
            INSERT INTO workqueue.subscription (
                name, topic, handler_key, partition_mode, lease_seconds, max_attempts,
                backoff_base_seconds, backoff_max_seconds, max_processing_seconds, heartbeat_mode,
                filter, host_type, retention_seconds, status, max_in_flight, key_concurrency, rate_limit,
                key_rate_limit)
            OUTPUT inserted.id INTO @v_created (id)
            VALUES (@p_name, @p_topic, @p_handler_key, @p_partition_mode, @p_lease_seconds, @p_max_attempts,
                @p_backoff_base_seconds, @p_backoff_max_seconds, @p_max_processing_seconds, @p_heartbeat_mode,
                @p_filter, @p_host_type, @p_retention_seconds, @p_status, @p_max_in_flight, @p_key_concurrency,
                @p_rate_limit, @p_key_rate_limit);
            SELECT @v_id = c.id FROM @v_created AS c;
        END
        ELSE
        BEGIN
            IF @v_topic <> @p_topic COLLATE Latin1_General_100_BIN2
            BEGIN
                SET @v_message = CONCAT(N'subscription ', @p_name, N' is on topic ', @v_topic,
                    N' in the store, and the code puts it on topic ', @p_topic,
                    N': a subscription does not move between topics (what processes still running the code before publish to ',
                    @v_topic, N' would reach it no more); declare a new subscription on ', @p_topic, N' and retire ',
                    @p_name, N' (`workqueue subscriptions retire ', @p_name, N'`), or retire and delete ', @p_name,
                    N' first');
                THROW 51002, @v_message, 1;
            END;
            IF @v_partition_mode <> @p_partition_mode COLLATE Latin1_General_100_BIN2 AND EXISTS (
                SELECT 1 FROM workqueue.delivery AS d
                WHERE d.subscription_id = @v_id AND d.status IN (N'Pending', N'InFlight', N'DeadLettered')
            )
            BEGIN
                SET @v_message = CONCAT(N'subscription ', @p_name, N' has live deliveries routed for partition mode ',
                    @v_partition_mode, N'; change it to ', @p_partition_mode,
                    N' once they are settled or discarded, or create a new subscription');
                THROW 51002, @v_message, 1;
            END;
            UPDATE s
            SET topic = @p_topic, handler_key = @p_handler_key, partition_mode = @p_partition_mode,
                lease_seconds = @p_lease_seconds, max_attempts = @p_max_attempts,
                backoff_base_seconds = @p_backoff_base_seconds, backoff_max_seconds = @p_backoff_max_seconds,
                max_processing_seconds = @p_max_processing_seconds, heartbeat_mode = @p_heartbeat_mode,
                filter = @p_filter, host_type = @p_host_type, retention_seconds = @p_retention_seconds,
                max_in_flight = @p_max_in_flight, key_concurrency = @p_key_concurrency,
                rate_limit = @p_rate_limit, key_rate_limit = @p_key_rate_limit,
                updated_at = SYSDATETIMEOFFSET()
            FROM workqueue.subscription AS s
            WHERE s.id = @v_id
              AND NOT EXISTS (
                  SELECT s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
                         s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds,
                         s.heartbeat_mode, s.filter, s.host_type, s.retention_seconds,
                         s.max_in_flight, s.key_concurrency, s.rate_limit, s.key_rate_limit
                  INTERSECT
                  SELECT @p_topic, @p_handler_key, @p_partition_mode, @p_lease_seconds, @p_max_attempts,
                         @p_backoff_base_seconds, @p_backoff_max_seconds, @p_max_processing_seconds,
                         @p_heartbeat_mode, @p_filter, @p_host_type, @p_retention_seconds,
                         @p_max_in_flight, @p_key_concurrency, @p_rate_limit, @p_key_rate_limit
              );
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_id AS sync_subscription;
END;
GO

-- Pauses or resumes a subscription. No row when the subscription does not exist.
-- (PostgreSQL notifies the consumers when a subscription becomes Active; here they poll.)
-- returns: subscription, status, changed
CREATE OR ALTER PROCEDURE workqueue.set_subscription_status
    @p_name nvarchar(200),
    @p_status nvarchar(20)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_old nvarchar(20);
    DECLARE @v_retired bit = 0;
    DECLARE @v_result TABLE (
        subscription nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        changed bit NOT NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- Resume (Active) takes back a retired subscription too.
        SELECT @v_old = CASE WHEN @p_status = N'Active' AND s.status = N'Active' AND s.retired_at IS NOT NULL
                             THEN N'Retired' ELSE s.status END,
               @v_retired = CASE WHEN s.retired_at IS NULL THEN 0 ELSE 1 END
        FROM workqueue.subscription AS s WITH (UPDLOCK, ROWLOCK)
        WHERE s.name = @p_name;
        IF @v_old IS NOT NULL AND @p_status = N'Paused' AND @v_retired = 1
            -- Refused (status Retired, nothing changed): a paused retired subscription would show
            -- Paused, where deliveries accrue, while it takes none.
            INSERT INTO @v_result (subscription, status, changed) VALUES (@p_name, N'Retired', 0);
        ELSE IF @v_old IS NOT NULL
        BEGIN
            UPDATE s
            SET status = @p_status,
                retired_at = CASE WHEN @p_status = N'Active' THEN NULL ELSE s.retired_at END,
                updated_at = SYSDATETIMEOFFSET()
            FROM workqueue.subscription AS s
            WHERE s.name = @p_name
              AND (s.status <> @p_status OR (@p_status = N'Active' AND s.retired_at IS NOT NULL));
            INSERT INTO @v_result (subscription, status, changed)
            VALUES (@p_name, @p_status,
                    CASE WHEN @v_old <> @p_status COLLATE Latin1_General_100_BIN2 THEN 1 ELSE 0 END);
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT r.subscription, r.status, r.changed FROM @v_result AS r;
END;
GO

-- Retires a subscription (retired_at): publish gives it no new delivery from the commit on, while
-- what it holds still drains (a paused one is paused no more) and its counts stay readable;
-- listings show it Retired, and it cannot be paused.
-- returns: subscription, status, changed
CREATE OR ALTER PROCEDURE workqueue.retire_subscription
    @p_name nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_found bit = 0;
    DECLARE @v_was_retired bit = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SELECT @v_found = 1, @v_was_retired = CASE WHEN s.retired_at IS NULL THEN 0 ELSE 1 END
        FROM workqueue.subscription AS s WITH (UPDLOCK, ROWLOCK)
        WHERE s.name = @p_name;
        UPDATE s
        SET retired_at = SYSDATETIMEOFFSET(), status = N'Active', updated_at = SYSDATETIMEOFFSET()
        FROM workqueue.subscription AS s
        WHERE s.name = @p_name AND s.retired_at IS NULL;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @p_name AS subscription, N'Retired' AS status, CASE WHEN @v_was_retired = 1 THEN 0 ELSE 1 END AS changed
    WHERE @v_found = 1;
END;
GO

-- Discards up to @p_limit Pending deliveries of a subscription, oldest id first, with @p_reason,
-- counted in settled_count, their keys handed over as a settle hands them; returns how many.
-- returns: discard_pending
CREATE OR ALTER PROCEDURE workqueue.discard_pending
    @p_subscription nvarchar(200),
    @p_reason nvarchar(max),
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_count int = 0;
    DECLARE @v_settled nvarchar(max);
    DECLARE @v_claimable TABLE (subscription_id int NOT NULL);
    DECLARE @v_u TABLE (id bigint NOT NULL PRIMARY KEY, subscription_id int NOT NULL, key_mode smallint NOT NULL);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        UPDATE d
        SET status = N'Discarded', reason = @p_reason, settled_at = @v_now, lease_token = NULL,
            lease_expires_at = NULL
        OUTPUT inserted.id, inserted.subscription_id, inserted.key_mode INTO @v_u (id, subscription_id, key_mode)
        FROM workqueue.delivery AS d
        INNER JOIN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.delivery AS x WITH (UPDLOCK, READPAST, ROWLOCK)
            INNER JOIN workqueue.subscription AS s ON s.id = x.subscription_id
            WHERE s.name = @p_subscription AND x.status = N'Pending'
            ORDER BY x.id
        ) AS c ON c.id = d.id
        WHERE d.status = N'Pending';
        SET @v_count = @@ROWCOUNT;

        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, 0, COUNT_BIG(*)
        FROM @v_u AS u
        GROUP BY u.subscription_id;

        IF EXISTS (SELECT 1 FROM @v_u AS u WHERE u.key_mode > 0)
        BEGIN
            SELECT @v_settled = N'[' + STRING_AGG(CAST(u.id AS nvarchar(max)), N',') + N']'
            FROM @v_u AS u;
            INSERT INTO @v_claimable (subscription_id)
            EXEC workqueue.release_keys @p_ids = @v_settled;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_count AS discard_pending;
END;
GO

-- Deletes a retired subscription with its ended deliveries, keys, counts and history. result:
-- Deleted, NotFound, NotRetired, or HasDeliveries (remaining: Pending, InFlight and DeadLettered).
-- returns: subscription, result, remaining
CREATE OR ALTER PROCEDURE workqueue.delete_subscription
    @p_name nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_id int;
    DECLARE @v_retired datetimeoffset(6);
    DECLARE @v_live bigint = 0;
    DECLARE @v_result nvarchar(20) = N'NotFound';

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SELECT @v_id = s.id, @v_retired = s.retired_at
        FROM workqueue.subscription AS s WITH (UPDLOCK, ROWLOCK)
        WHERE s.name = @p_name;
        IF @v_id IS NOT NULL AND @v_retired IS NULL
            SET @v_result = N'NotRetired';
        ELSE IF @v_id IS NOT NULL
        BEGIN
            SELECT @v_live = COUNT_BIG(*) FROM workqueue.delivery AS d
            WHERE d.subscription_id = @v_id AND d.status IN (N'Pending', N'InFlight', N'DeadLettered');
            IF @v_live > 0
                SET @v_result = N'HasDeliveries';
            ELSE
            BEGIN
                DELETE FROM workqueue.delivery WHERE subscription_id = @v_id;
                DELETE FROM workqueue.partition WHERE subscription_id = @v_id;
                DELETE FROM workqueue.partition_stale WHERE subscription_id = @v_id;
                DELETE FROM workqueue.rate_bucket WHERE subscription_id = @v_id;
                DELETE FROM workqueue.settled_count WHERE subscription_id = @v_id;
                DELETE FROM workqueue.stats_history WHERE subscription_id = @v_id;
                DELETE FROM workqueue.subscription WHERE id = @v_id;
                SET @v_result = N'Deleted';
            END;
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @p_name AS subscription, @v_result AS result, @v_live AS remaining;
END;
GO

-- Retires ('Retired': retired_at), pauses ('Paused') or takes back ('Active': active and not
-- retired) a topic. A retired topic refuses new messages (TopicRetired); its subscriptions drain.
-- returns: topic, status, changed
CREATE OR ALTER PROCEDURE workqueue.set_topic_status
    @p_name nvarchar(200),
    @p_status nvarchar(20)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_old nvarchar(20);

    BEGIN TRY
        IF @p_status NOT IN (N'Active', N'Paused', N'Retired')
            THROW 51020, N'a topic''s status is Active, Paused or Retired', 1;
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        -- What this call changes: a retire, whether the topic was retired; a pause, its status; a
        -- resume, either (it un-retires too).
        SELECT @v_old = CASE @p_status
                            WHEN N'Retired' THEN CASE WHEN t.retired_at IS NULL THEN N'Active' ELSE N'Retired' END
                            WHEN N'Paused' THEN t.status
                            ELSE CASE WHEN t.retired_at IS NOT NULL THEN N'Retired' ELSE t.status END
                        END
        FROM workqueue.topic AS t WITH (UPDLOCK, ROWLOCK)
        WHERE t.name = @p_name;
        UPDATE t
        SET status = CASE WHEN @p_status = N'Retired' THEN t.status ELSE @p_status END,
            retired_at = CASE WHEN @p_status = N'Retired' THEN COALESCE(t.retired_at, SYSDATETIMEOFFSET())
                              WHEN @p_status = N'Active' THEN NULL ELSE t.retired_at END,
            updated_at = SYSDATETIMEOFFSET()
        FROM workqueue.topic AS t
        WHERE t.name = @p_name;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @p_name AS topic, @p_status AS status,
           CASE WHEN @v_old <> @p_status COLLATE Latin1_General_100_BIN2 THEN 1 ELSE 0 END AS changed
    WHERE @v_old IS NOT NULL;
END;
GO

-- Deletes a retired topic that no subscription names any more. result: Deleted, NotFound,
-- NotRetired, or HasSubscriptions (remaining says how many).
-- returns: topic, result, remaining
CREATE OR ALTER PROCEDURE workqueue.delete_topic
    @p_name nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_found bit = 0;
    DECLARE @v_retired datetimeoffset(6);
    DECLARE @v_subscriptions bigint = 0;
    DECLARE @v_result nvarchar(20) = N'NotFound';

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SELECT @v_found = 1, @v_retired = t.retired_at
        FROM workqueue.topic AS t WITH (UPDLOCK, ROWLOCK)
        WHERE t.name = @p_name;
        IF @v_found = 1 AND @v_retired IS NULL
            SET @v_result = N'NotRetired';
        ELSE IF @v_found = 1
        BEGIN
            SELECT @v_subscriptions = COUNT_BIG(*) FROM workqueue.subscription AS s WHERE s.topic = @p_name;
            IF @v_subscriptions > 0
                SET @v_result = N'HasSubscriptions';
            ELSE
            BEGIN
                DELETE FROM workqueue.deduplication WHERE topic = @p_name;
                DELETE FROM workqueue.topic WHERE name = @p_name;
                SET @v_result = N'Deleted';
            END;
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @p_name AS topic, @v_result AS result, @v_subscriptions AS remaining;
END;
GO

-- returns: id, name, topic, handler_key, partition_mode, lease_seconds, max_attempts, backoff_base_seconds, backoff_max_seconds, max_processing_seconds, heartbeat_mode, filter, status, host_type, retention_seconds, topic_status, transport, is_fifo, max_payload_bytes, max_in_flight, key_concurrency, rate_limit, key_rate_limit
CREATE OR ALTER PROCEDURE workqueue.list_subscriptions
AS
BEGIN
    SET NOCOUNT ON;
    SELECT s.id, s.name, s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
           s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds,
           s.heartbeat_mode, s.filter, CASE WHEN s.status = N'Active' AND s.retired_at IS NOT NULL THEN N'Retired' ELSE s.status END AS status,
           s.host_type, s.retention_seconds,
           CASE WHEN t.status = N'Active' AND t.retired_at IS NOT NULL THEN N'Retired' ELSE t.status END AS topic_status,
           t.transport, t.is_fifo, t.max_payload_bytes, s.max_in_flight, s.key_concurrency, s.rate_limit,
           s.key_rate_limit
    FROM workqueue.subscription AS s
    INNER JOIN workqueue.topic AS t ON t.name = s.topic
    ORDER BY s.name;
END;
GO

-- returns: name, transport, max_payload_bytes, is_fifo, status
CREATE OR ALTER PROCEDURE workqueue.list_topics
AS
BEGIN
    SET NOCOUNT ON;
    SELECT t.name, t.transport, t.max_payload_bytes, t.is_fifo,
           CASE WHEN t.status = N'Active' AND t.retired_at IS NOT NULL THEN N'Retired' ELSE t.status END AS status
    FROM workqueue.topic AS t
    ORDER BY t.name;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Publish
-- ---------------------------------------------------------------------------------------------

-- returns: idx, status, message_id, error_code, error_message
CREATE OR ALTER PROCEDURE workqueue.publish
    @p_topic nvarchar(200),
    @p_message_ids nvarchar(max),
    @p_partition_keys nvarchar(max),
    @p_attributes nvarchar(max),
    @p_payloads nvarchar(max),
    @p_payload_refs nvarchar(max),
    @p_correlation_ids nvarchar(max),
    @p_content_hashes nvarchar(max),
    @p_deduplication_keys nvarchar(max),
    @p_deduplication_ttls nvarchar(max),
    @p_delays nvarchar(max),
    @p_not_befores nvarchar(max),
    @p_max_attempts nvarchar(max),
    @p_backoff_schedules nvarchar(max),
    @p_envelope_bytes nvarchar(max),
    @p_priorities nvarchar(max) = NULL   -- NULL: every item 0
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_n int;
    DECLARE @v_topic_found bit = 0;
    DECLARE @v_topic_retired bit = 0;
    DECLARE @v_quoted_topic nvarchar(max) = N'''' + REPLACE(@p_topic, N'''', N'''''') + N'''';
    DECLARE @v_cap int;
    DECLARE @v_has_keyed bit = 0;
    DECLARE @v_has_dedup bit = 0;
    DECLARE @v_failed int;
    DECLARE @v_failed_code nvarchar(40);
    DECLARE @v_accepted int = 0;
    DECLARE @v_count int;
    DECLARE @v_k int;
    DECLARE @v_k_count int;
    DECLARE @v_key_subscription int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_found bit;
    DECLARE @v_key_holder bigint;
    DECLARE @v_item TABLE (
        i int NOT NULL PRIMARY KEY,     -- 1-based, as PostgreSQL's WITH ORDINALITY
        mid uniqueidentifier NULL,
        pkey nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        attrs nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        payload nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        ref nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        corr nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        hash nvarchar(128) COLLATE Latin1_General_100_BIN2 NULL,
        dkey nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        ttl float NULL,
        delay float NULL,
        not_before datetimeoffset(6) NULL,
        max_attempts int NULL,
        backoff nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        bytes int NULL,
        priority smallint NOT NULL DEFAULT 0,
        visible_at datetimeoffset(6) NULL,
        dedup_expires_at datetimeoffset(6) NULL,
        st nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
        result_id uniqueidentifier NULL,
        ok bit NOT NULL DEFAULT 0
    );
    DECLARE @v_inserted TABLE (id uniqueidentifier NOT NULL PRIMARY KEY);
    DECLARE @v_keys TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL
    );
    DECLARE @v_sub TABLE (
        id int NOT NULL PRIMARY KEY,
        partition_mode nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        filter nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        max_attempts int NOT NULL,
        backoff_base_seconds float NOT NULL,
        backoff_max_seconds float NOT NULL
    );
    DECLARE @v_new TABLE (
        id bigint NOT NULL PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        key_mode smallint NOT NULL,
        visible_at datetimeoffset(6) NOT NULL,
        priority smallint NOT NULL
    );
    DECLARE @v_result TABLE (
        idx int NOT NULL PRIMARY KEY,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        message_id uniqueidentifier NULL,
        error_code nvarchar(40) COLLATE Latin1_General_100_BIN2 NULL,
        error_message nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- The parallel arrays as one row per item (PostgreSQL: unnest(...) WITH ORDINALITY).
        INSERT INTO @v_item (
            i, mid, pkey, attrs, payload, ref, corr, hash, dkey, ttl, delay, not_before,
            max_attempts, backoff, bytes, priority)
        SELECT CAST(m.[key] AS int) + 1, CAST(m.value AS uniqueidentifier), pk.value, ats.value,
               pl.value, pr.value, co.value, ch.value, dk.value, CAST(dt.value AS float),
               CAST(de.value AS float), CAST(nb.value AS datetimeoffset(6)), CAST(ma.value AS int),
               bs.value, CAST(eb.value AS int), COALESCE(CAST(py.value AS smallint), 0)
        FROM OPENJSON(@p_message_ids) AS m
        LEFT JOIN OPENJSON(@p_partition_keys) AS pk ON pk.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_attributes) AS ats ON ats.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_payloads) AS pl ON pl.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_payload_refs) AS pr ON pr.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_correlation_ids) AS co ON co.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_content_hashes) AS ch ON ch.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_deduplication_keys) AS dk ON dk.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_deduplication_ttls) AS dt ON dt.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_delays) AS de ON de.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_not_befores) AS nb ON nb.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_max_attempts) AS ma ON ma.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_backoff_schedules) AS bs ON bs.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_envelope_bytes) AS eb ON eb.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_priorities) AS py ON py.[key] = m.[key];
        SET @v_n = @@ROWCOUNT;

        IF @v_n > 0
        BEGIN
            SELECT @v_topic_found = 1, @v_cap = t.max_payload_bytes,
                   @v_topic_retired = CASE WHEN t.retired_at IS NULL THEN 0 ELSE 1 END
            FROM workqueue.topic AS t
            WHERE t.name = @p_topic;
        END;

        IF @v_n > 0 AND @v_topic_found = 0
            INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
            SELECT it.i, N'Rejected', it.mid, N'UnknownTopic',
                   CONCAT(N'topic ', @v_quoted_topic,
                          N' does not exist; declare it in the WorkQueue topics or create it first')
            FROM @v_item AS it;
        ELSE IF @v_n > 0 AND @v_topic_retired = 1 AND NOT EXISTS (
                SELECT 1 FROM @v_item AS it
                WHERE NOT EXISTS (SELECT 1 FROM workqueue.message AS s
                                  WHERE s.id = it.mid AND s.topic = @p_topic AND s.content_hash = it.hash))
            -- Every item repeats a message the topic took before it retired: a producer's retry,
            -- answered as before (Duplicate), so that it does not take what it stored for lost.
            INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
            SELECT it.i, N'Duplicate', it.mid, NULL, NULL
            FROM @v_item AS it;
        ELSE IF @v_n > 0 AND @v_topic_retired = 1
            INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
            SELECT it.i, N'Rejected', it.mid, N'TopicRetired',
                   CONCAT(N'topic ', @v_quoted_topic,
                          N' is retired and takes no new messages; publish to the topic that replaced it, ',
                          N'or take it back with `workqueue topics resume ', @p_topic, N'`')
            FROM @v_item AS it;
        ELSE IF @v_n > 0
        BEGIN
            -- visible_at = greatest(now, coalesce(not_before, now + delay)); the deduplication
            -- key lives coalesce(ttl, 300) seconds. Fractional seconds: whole seconds, then
            -- microseconds (DATEADD takes an int).
            UPDATE it
            SET visible_at = CASE WHEN w.wanted > @v_now THEN w.wanted ELSE @v_now END,
                dedup_expires_at = DATEADD(
                    microsecond, CAST((w.ttl - FLOOR(w.ttl)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(w.ttl) AS int), @v_now))
            FROM @v_item AS it
            CROSS APPLY (
                SELECT COALESCE(it.not_before, DATEADD(
                           microsecond,
                           CAST((COALESCE(it.delay, 0) - FLOOR(COALESCE(it.delay, 0))) * 1000000 AS int),
                           DATEADD(second, CAST(FLOOR(COALESCE(it.delay, 0)) AS int), @v_now))) AS wanted,
                       COALESCE(it.ttl, 300) AS ttl
            ) AS w;

            IF EXISTS (SELECT 1 FROM @v_item AS it WHERE it.dkey IS NOT NULL)
                SET @v_has_dedup = 1;

            IF @v_has_dedup = 0
               AND (@v_cap IS NULL OR NOT EXISTS (SELECT 1 FROM @v_item AS it WHERE it.bytes > @v_cap))
            BEGIN
                -- Fast path: write, then look at the items that clashed with a stored message.
                INSERT INTO workqueue.message (
                    id, topic, partition_key, attributes, payload, payload_ref, correlation_id,
                    deduplication_key, content_hash)
                OUTPUT inserted.id INTO @v_inserted (id)
                SELECT it.mid, @p_topic, it.pkey, COALESCE(it.attrs, N'{}'), it.payload, it.ref, it.corr,
                       NULL, it.hash
                FROM @v_item AS it
                WHERE it.i = (SELECT MIN(x.i) FROM @v_item AS x WHERE x.mid = it.mid)
                  AND NOT EXISTS (
                      SELECT 1 FROM workqueue.message AS m WITH (UPDLOCK, HOLDLOCK) WHERE m.id = it.mid
                  )
                ORDER BY it.i;
                SET @v_count = @@ROWCOUNT;

                IF @v_count = @v_n
                    UPDATE @v_item SET st = N'Accepted', result_id = mid, ok = 1;
                ELSE
                BEGIN
                    -- An item is accepted when this call inserted it and it is the first with its
                    -- id; the others repeat a stored message (or an earlier item): same content,
                    -- Duplicate.
                    UPDATE it
                    SET st = CASE
                            WHEN it.i = f.first_by_id AND ins.id IS NOT NULL THEN N'Accepted'
                            WHEN s.content_hash = it.hash AND s.topic = @p_topic THEN N'Duplicate'
                            ELSE N'MessageIDConflict'
                        END,
                        result_id = it.mid
                    FROM @v_item AS it
                    CROSS APPLY (SELECT MIN(x.i) AS first_by_id FROM @v_item AS x WHERE x.mid = it.mid) AS f
                    LEFT JOIN @v_inserted AS ins ON ins.id = it.mid
                    LEFT JOIN workqueue.message AS s ON s.id = it.mid;
                    UPDATE @v_item SET ok = CASE WHEN st = N'Accepted' THEN 1 ELSE 0 END;

                    SELECT @v_failed = MIN(it.i) FROM @v_item AS it WHERE it.st = N'MessageIDConflict';
                    IF @v_failed IS NOT NULL
                    BEGIN
                        DELETE FROM workqueue.message WHERE id IN (SELECT ins.id FROM @v_inserted AS ins);
                        INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
                        SELECT it.i,
                               CASE WHEN it.st = N'MessageIDConflict' THEN it.st ELSE N'Rejected' END,
                               it.mid,
                               CASE WHEN it.st = N'MessageIDConflict' THEN it.st ELSE N'BatchAborted' END,
                               CASE WHEN it.st = N'MessageIDConflict'
                                    THEN N'a message with this MessageID and different content, or on another topic, was already published; use a new MessageID for new content'
                                    ELSE CONCAT(N'not published: item ', @v_failed - 1,
                                                N' of this call was refused (MessageIDConflict) and a publish call is all-or-nothing')
                               END
                        FROM @v_item AS it;
                    END;
                END;
                SET @v_accepted = @v_count;
            END
            ELSE
            BEGIN
                -- Classify every item before writing anything: refused (too large), a repeat of an
                -- earlier item or of a stored message (Duplicate or MessageIDConflict), a live
                -- deduplication key.
                WITH item AS (
                    SELECT it.i, it.mid, it.hash, it.dkey, it.bytes,
                           MIN(it.i) OVER (PARTITION BY it.mid) AS first_by_id,
                           FIRST_VALUE(it.hash) OVER (PARTITION BY it.mid ORDER BY it.i) AS first_hash
                    FROM @v_item AS it
                )
                UPDATE target
                SET st = CASE
                        WHEN @v_cap IS NOT NULL AND item.bytes > @v_cap THEN N'Rejected'
                        WHEN item.first_by_id < item.i AND item.first_hash = item.hash THEN N'Duplicate'
                        WHEN item.first_by_id < item.i THEN N'MessageIDConflict'
                        WHEN s.id IS NOT NULL AND s.content_hash = item.hash AND s.topic = @p_topic THEN N'Duplicate'
                        WHEN s.id IS NOT NULL THEN N'MessageIDConflict'
                        WHEN lk.message_id IS NOT NULL THEN N'Duplicate'
                        ELSE N'Accepted'
                    END,
                    result_id = CASE
                        WHEN @v_cap IS NOT NULL AND item.bytes > @v_cap THEN item.mid
                        WHEN item.first_by_id < item.i OR s.id IS NOT NULL THEN item.mid
                        WHEN lk.message_id IS NOT NULL THEN lk.message_id
                        ELSE item.mid
                    END
                FROM @v_item AS target
                INNER JOIN item ON item.i = target.i
                LEFT JOIN workqueue.message AS s ON s.id = item.mid
                LEFT JOIN workqueue.deduplication AS lk
                    ON @v_has_dedup = 1 AND lk.topic = @p_topic AND lk.deduplication_key = item.dkey
                   AND lk.expires_at > @v_now;
                -- A key of the call is taken by its first item that is written; an item refused or a
                -- Duplicate by its MessageID takes none (the rule of core/lifecycle.py classify_batch).
                UPDATE target
                SET st = N'Duplicate', result_id = k.first_mid
                FROM @v_item AS target
                INNER JOIN (
                    SELECT a.dkey, a.i AS first_i, a.mid AS first_mid
                    FROM (SELECT t.dkey, t.i, t.mid, ROW_NUMBER() OVER (PARTITION BY t.dkey ORDER BY t.i) AS rn
                          FROM @v_item AS t
                          WHERE t.st = N'Accepted' AND t.dkey IS NOT NULL) AS a
                    WHERE a.rn = 1
                ) AS k ON k.dkey = target.dkey AND target.st = N'Accepted' AND k.first_i < target.i;
                UPDATE @v_item SET ok = CASE WHEN st = N'Accepted' THEN 1 ELSE 0 END;

                SELECT @v_failed = MIN(it.i) FROM @v_item AS it WHERE it.st IN (N'Rejected', N'MessageIDConflict');
                SELECT @v_accepted = COUNT(*) FROM @v_item AS it WHERE it.ok = 1;

                IF @v_failed IS NOT NULL
                BEGIN
                    SELECT @v_failed_code = CASE it.st WHEN N'Rejected' THEN N'EnvelopeTooLarge'
                                                       ELSE N'MessageIDConflict' END
                    FROM @v_item AS it
                    WHERE it.i = @v_failed;
                    INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
                    SELECT it.i,
                           CASE WHEN it.st IN (N'Rejected', N'MessageIDConflict') THEN it.st ELSE N'Rejected' END,
                           it.result_id,
                           CASE it.st WHEN N'Rejected' THEN N'EnvelopeTooLarge'
                                      WHEN N'MessageIDConflict' THEN N'MessageIDConflict'
                                      ELSE N'BatchAborted' END,
                           CASE it.st
                               WHEN N'Rejected' THEN CONCAT(
                                   N'the envelope is ', it.bytes, N' bytes; topic ', @v_quoted_topic,
                                   N' accepts at most ', @v_cap,
                                   N' bytes (max_payload_bytes); send a PayloadRef to the data instead')
                               WHEN N'MessageIDConflict'
                                   THEN N'a message with this MessageID and different content, or on another topic, was already published; use a new MessageID for new content'
                               ELSE CONCAT(N'not published: item ', @v_failed - 1, N' of this call was refused (',
                                           @v_failed_code, N') and a publish call is all-or-nothing')
                           END
                    FROM @v_item AS it;
                END
                ELSE IF @v_accepted > 0
                BEGIN
                    INSERT INTO workqueue.message (
                        id, topic, partition_key, attributes, payload, payload_ref, correlation_id,
                        deduplication_key, content_hash)
                    SELECT it.mid, @p_topic, it.pkey, COALESCE(it.attrs, N'{}'), it.payload, it.ref, it.corr,
                           it.dkey, it.hash
                    FROM @v_item AS it
                    WHERE it.ok = 1
                      AND NOT EXISTS (
                          SELECT 1 FROM workqueue.message AS m WITH (UPDLOCK, HOLDLOCK) WHERE m.id = it.mid
                      )
                    ORDER BY it.i;
                    IF @@ROWCOUNT <> @v_accepted
                        THROW 51001, N'a message with the same MessageID was published concurrently; retry the publish', 1;

                    -- ON CONFLICT (topic, deduplication_key) DO UPDATE ... WHERE expired: take over
                    -- the expired keys, insert the absent ones.
                    UPDATE dd
                    SET message_id = it.mid, expires_at = it.dedup_expires_at
                    FROM workqueue.deduplication AS dd WITH (UPDLOCK, HOLDLOCK)
                    INNER JOIN @v_item AS it ON dd.topic = @p_topic AND dd.deduplication_key = it.dkey
                    WHERE it.ok = 1 AND dd.expires_at <= @v_now;
                    SET @v_count = @@ROWCOUNT;
                    INSERT INTO workqueue.deduplication (topic, deduplication_key, message_id, expires_at)
                    SELECT @p_topic, it.dkey, it.mid, it.dedup_expires_at
                    FROM @v_item AS it
                    WHERE it.ok = 1 AND it.dkey IS NOT NULL
                      AND NOT EXISTS (
                          SELECT 1 FROM workqueue.deduplication AS dd WITH (UPDLOCK, HOLDLOCK)
                          WHERE dd.topic = @p_topic AND dd.deduplication_key = it.dkey
                      )
                    ORDER BY it.dkey;
                    SET @v_count = @v_count + @@ROWCOUNT;
                    IF @v_count <> (SELECT COUNT(*) FROM @v_item AS it WHERE it.ok = 1 AND it.dkey IS NOT NULL)
                        THROW 51001, N'a message with the same DeduplicationKey was published concurrently; retry the publish', 1;
                END;
            END;

            -- The subscriptions as the deliveries are written: read once, here, after whatever the
            -- classification waited for; the key modes, the keys and the deliveries follow this read.
            IF @v_failed IS NULL AND @v_accepted > 0
            BEGIN
                INSERT INTO @v_sub (id, partition_mode, filter, max_attempts, backoff_base_seconds, backoff_max_seconds)
                SELECT s.id, s.partition_mode, s.filter, s.max_attempts, s.backoff_base_seconds, s.backoff_max_seconds
                FROM workqueue.subscription AS s
                WHERE s.topic = @p_topic AND s.retired_at IS NULL;
                IF EXISTS (SELECT 1 FROM @v_sub AS s WHERE s.partition_mode <> N'None')
                    SET @v_has_keyed = 1;
            END;

            IF @v_failed IS NULL AND @v_accepted > 0 AND @v_has_keyed = 0
                INSERT INTO workqueue.delivery (
                    subscription_id, message_id, partition_key, key_mode, max_attempts,
                    backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at, priority)
                SELECT s.id, it.mid, it.pkey, 0, COALESCE(it.max_attempts, s.max_attempts),
                       s.backoff_base_seconds, s.backoff_max_seconds, it.backoff, it.visible_at, it.priority
                FROM @v_item AS it
                CROSS JOIN @v_sub AS s
                WHERE it.ok = 1 AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, it.attrs) = 1)
                ORDER BY it.i, s.id;
                -- (PostgreSQL notifies the subscriptions that got visible work; consumers poll here.)
            ELSE IF @v_failed IS NULL AND @v_accepted > 0
            BEGIN
                -- Lock (creating where needed) the keys of Exclusive and Ordered subscriptions, in
                -- key order, before any delivery gets its id: ids then follow commit order within
                -- a key.
                INSERT INTO @v_keys (subscription_id, partition_key)
                SELECT DISTINCT s.id, it.pkey
                FROM @v_item AS it
                INNER JOIN @v_sub AS s ON s.partition_mode <> N'None'
                WHERE it.ok = 1 AND it.pkey IS NOT NULL
                  AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, it.attrs) = 1)
                ORDER BY s.id, it.pkey;
                SET @v_k_count = @@ROWCOUNT;
                SET @v_k = 1;
                WHILE @v_k <= @v_k_count
                BEGIN
                    SELECT @v_key_subscription = k.subscription_id, @v_key = k.partition_key
                    FROM @v_keys AS k
                    WHERE k.ord = @v_k;
                    -- Reading holder_id (not in the primary key) locks the row itself, the
                    -- lock a claim meets (see partition_ready); HOLDLOCK covers an absent key.
                    SET @v_key_found = 0;
                    SELECT @v_key_found = 1, @v_key_holder = p.holder_id
                    FROM workqueue.partition AS p WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                    WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key;
                    IF @v_key_found = 0
                        INSERT INTO workqueue.partition (subscription_id, partition_key)
                        VALUES (@v_key_subscription, @v_key);
                    SET @v_k = @v_k + 1;
                END;

                INSERT INTO workqueue.delivery (
                    subscription_id, message_id, partition_key, key_mode, max_attempts,
                    backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at, priority)
                OUTPUT inserted.id, inserted.subscription_id, inserted.partition_key, inserted.key_mode,
                       inserted.visible_at, inserted.priority
                INTO @v_new (id, subscription_id, partition_key, key_mode, visible_at, priority)
                SELECT s.id, it.mid, it.pkey,
                       CASE WHEN it.pkey IS NULL OR s.partition_mode = N'None' THEN 0
                            WHEN s.partition_mode = N'Exclusive' THEN 1 ELSE 2 END,
                       COALESCE(it.max_attempts, s.max_attempts), s.backoff_base_seconds,
                       s.backoff_max_seconds, it.backoff, it.visible_at, it.priority
                FROM @v_item AS it
                CROSS JOIN @v_sub AS s
                WHERE it.ok = 1 AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, it.attrs) = 1)
                ORDER BY it.i, s.id;

                -- Each key that got work: its first new delivery (Ordered) or its earliest
                -- (Exclusive) becomes the next one to claim, unless the key is held or blocked.
                WITH first_new AS (
                    SELECT nd.id, nd.subscription_id, nd.partition_key, nd.key_mode, nd.visible_at, nd.priority,
                           ROW_NUMBER() OVER (
                               PARTITION BY nd.subscription_id, nd.partition_key
                               ORDER BY CASE WHEN nd.key_mode = 1 THEN nd.visible_at END, nd.id
                           ) AS rn
                    FROM @v_new AS nd
                    WHERE nd.key_mode > 0
                )
                UPDATE p
                SET next_id = f.id, next_visible_at = f.visible_at, next_priority = f.priority
                FROM workqueue.partition AS p
                INNER JOIN first_new AS f
                    ON f.rn = 1 AND p.subscription_id = f.subscription_id AND p.partition_key = f.partition_key
                WHERE p.holder_id IS NULL
                  AND ((f.key_mode = 2 AND p.next_id IS NULL AND p.blocked_id IS NULL)
                       OR (f.key_mode = 1 AND (p.next_id IS NULL OR f.visible_at < p.next_visible_at)));
                -- (PostgreSQL notifies the subscriptions whose keys became claimable; consumers poll.)
            END;

            IF @v_failed IS NULL
                INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
                SELECT it.i, it.st, it.result_id, NULL, NULL
                FROM @v_item AS it;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT r.idx, r.status, r.message_id, r.error_code, r.error_message
    FROM @v_result AS r
    WHERE EXISTS (SELECT 1 FROM @v_result AS other WHERE other.status <> N'Accepted')
    ORDER BY r.idx;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Claim, heartbeat, settle
-- ---------------------------------------------------------------------------------------------

-- Each of these reads the time once: @p_now when the caller gives it (a test's clock), else
-- SYSDATETIMEOFFSET() (docs/design/time.md).

-- Claims up to @p_limit visible deliveries of an Active subscription: attempt + 1, a fresh lease
-- token, the lease from the subscription's current lease_seconds. Keys of Exclusive and Ordered
-- subscriptions are claimed through their partition row, one delivery per key; deliveries
-- without a key share the claim with the keys, so neither side can take every slot.
-- returns: delivery_id, lease_token, attempt, max_attempts, lease_expires_at, message_id, topic, partition_key, attributes, payload, payload_ref, correlation_id, published_at, held_back, retry_after
CREATE OR ALTER PROCEDURE workqueue.claim
    @p_subscription nvarchar(200),
    @p_limit int,
    @p_holder uniqueidentifier = NULL,
    @p_now datetimeoffset(6) = NULL,
    @p_lease_seconds float = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    DECLARE @v_subscription_id int;
    DECLARE @v_partition_mode nvarchar(20);
    DECLARE @v_lease_seconds float;
    DECLARE @v_lease_expires_at datetimeoffset(6);
    DECLARE @v_mode smallint;
    DECLARE @v_limit int = @p_limit;  -- what this claim may take: less than @p_limit under a flow limit
    DECLARE @v_keyed_count int = 0;
    DECLARE @v_unkeyed_count int = 0;
    DECLARE @v_share int;
    DECLARE @v_wanted int;
    DECLARE @v_got int = 0;
    DECLARE @v_ord int = 0;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_subscriptions nvarchar(max);
    -- flow limits (docs/design/flow-control.md)
    DECLARE @v_max_in_flight int;
    DECLARE @v_key_concurrency int;
    DECLARE @v_rate_limit nvarchar(20);
    DECLARE @v_key_rate_limit nvarchar(20);
    DECLARE @v_limited bit = 0;
    DECLARE @v_held nvarchar(20);      -- the limit that kept claimable work back
    DECLARE @v_retry float;
    DECLARE @v_busy int;
    DECLARE @v_rate float;
    DECLARE @v_tokens float;
    DECLARE @v_key_rate float;
    DECLARE @v_key_burst float;
    DECLARE @v_key_limited bit = 0;
    DECLARE @v_default_room int;
    DECLARE @v_key_spent bit = 0;
    DECLARE @v_has_blocked bit = 0;
    DECLARE @v_fullest float;
    DECLARE @v_lock int;
    DECLARE @v_resource nvarchar(255);
    DECLARE @v_keyed TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        next_id bigint NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL
    );
    DECLARE @v_unkeyed TABLE (id bigint NOT NULL PRIMARY KEY, message_id uniqueidentifier NOT NULL);
    DECLARE @v_ids TABLE (id bigint NOT NULL PRIMARY KEY);
    -- Under key limits: each key's room when below the default, and the candidates of a claim.
    DECLARE @v_room TABLE (
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY,
        room int NOT NULL,
        tokens float NULL
    );
    DECLARE @v_window TABLE (
        id bigint NOT NULL PRIMARY KEY,
        message_id uniqueidentifier NOT NULL,
        priority smallint NOT NULL,
        visible_at datetimeoffset(6) NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL
    );
    -- What is answered: the claimed deliveries, and (id 0) the row that says a limit held work back.
    DECLARE @v_claimed TABLE (
        id bigint NOT NULL PRIMARY KEY,
        lease_token uniqueidentifier NULL,
        attempt int NULL,
        max_attempts int NULL,
        lease_expires_at datetimeoffset(6) NULL,
        message_id uniqueidentifier NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        key_mode smallint NULL,
        priority smallint NULL,
        visible_at datetimeoffset(6) NULL,
        held_back nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
        retry_after float NULL
    );

    SELECT @v_subscription_id = s.id, @v_partition_mode = s.partition_mode, @v_lease_seconds = s.lease_seconds,
           @v_max_in_flight = s.max_in_flight, @v_rate_limit = s.rate_limit, @v_key_rate_limit = s.key_rate_limit,
           @v_key_concurrency = CASE WHEN s.partition_mode = N'None' THEN s.key_concurrency END,
           @v_limited = CASE WHEN s.max_in_flight IS NOT NULL OR s.rate_limit IS NOT NULL
                                  OR s.key_rate_limit IS NOT NULL
                                  OR (s.key_concurrency IS NOT NULL AND s.partition_mode = N'None')
                             THEN 1 ELSE 0 END
    FROM workqueue.subscription AS s
    INNER JOIN workqueue.topic AS t ON t.name = s.topic
    WHERE s.name = @p_subscription AND s.status = N'Active' AND t.status = N'Active';
    -- The lease the claiming process counts (the subscription's as it last read it), so that a newer
    -- deploy's shorter lease cannot run out under it unseen.
    IF @p_lease_seconds > 0 AND @p_lease_seconds < 1e9
        SET @v_lease_seconds = @p_lease_seconds;

    BEGIN TRY
        IF @v_subscription_id IS NOT NULL AND @p_limit >= 1
        BEGIN
            IF @v_own_transaction = 1
                BEGIN TRANSACTION;
            SET @v_lease_expires_at = DATEADD(
                microsecond, CAST((@v_lease_seconds - FLOOR(@v_lease_seconds)) * 1000000 AS int),
                DATEADD(second, CAST(FLOOR(@v_lease_seconds) AS int), @v_now));
            SET @v_mode = CASE WHEN @v_partition_mode = N'Exclusive' COLLATE Latin1_General_100_BIN2 THEN 1 ELSE 2 END;

            IF @v_limited = 1
            BEGIN
                -- One claim of a limited subscription at a time, across every process: an
                -- application lock of the transaction, gone at its commit. Subscriptions without
                -- limits never take it.
                SET @v_resource = CONCAT(N'workqueue.claim:', @v_subscription_id);
                EXEC @v_lock = sp_getapplock
                    @Resource = @v_resource,
                    @LockMode = N'Exclusive',
                    @LockOwner = N'Transaction';
                -- The time as of the lock, not of the call: a claim that waited for it must not
                -- set a bucket's time back behind the claim before it (its refill would count twice).
                IF @p_now IS NULL
                BEGIN
                    SET @v_now = SYSDATETIMEOFFSET();
                    SET @v_lease_expires_at = DATEADD(
                        microsecond, CAST((@v_lease_seconds - FLOOR(@v_lease_seconds)) * 1000000 AS int),
                        DATEADD(second, CAST(FLOOR(@v_lease_seconds) AS int), @v_now));
                END;
                IF @v_max_in_flight IS NOT NULL
                BEGIN
                    -- A holder that died holds its slot until its lease runs out.
                    SELECT @v_busy = COUNT(*) FROM workqueue.delivery AS d
                    WHERE d.subscription_id = @v_subscription_id AND d.status = N'InFlight'
                      AND d.lease_expires_at > @v_now;
                    IF @v_max_in_flight - @v_busy < @v_limit
                    BEGIN
                        SET @v_limit = CASE WHEN @v_max_in_flight > @v_busy THEN @v_max_in_flight - @v_busy ELSE 0 END;
                        SET @v_held = N'MaxInFlight';
                    END;
                END;
                IF @v_rate_limit IS NOT NULL
                BEGIN
                    SET @v_rate = workqueue.rate_per_second(@v_rate_limit);
                    SELECT @v_tokens = b.tokens + CASE WHEN b.updated_at < @v_now
                                                       THEN DATEDIFF_BIG(microsecond, b.updated_at, @v_now) / 1000000.0
                                                       ELSE 0 END * @v_rate
                    FROM workqueue.rate_bucket AS b
                    WHERE b.subscription_id = @v_subscription_id AND b.per_key = 0 AND b.partition_key = N'';
                    IF @v_tokens IS NULL OR @v_tokens > CASE WHEN @v_rate > 1 THEN @v_rate ELSE 1 END
                        SET @v_tokens = CASE WHEN @v_rate > 1 THEN @v_rate ELSE 1 END;
                    IF FLOOR(@v_tokens) < @v_limit
                    BEGIN
                        SET @v_limit = CAST(FLOOR(@v_tokens) AS int);
                        SET @v_held = N'RateLimit';
                    END;
                END;
                IF @v_key_concurrency IS NOT NULL OR @v_key_rate_limit IS NOT NULL
                BEGIN
                    -- Each key's room: key_concurrency less its InFlight deliveries, and the whole
                    -- tokens of its bucket; only keys below the default room are kept.
                    SET @v_key_limited = 1;
                    SET @v_key_rate = workqueue.rate_per_second(@v_key_rate_limit);
                    SET @v_key_burst = CASE WHEN @v_key_rate > 1 THEN @v_key_rate ELSE 1 END;
                    SET @v_default_room = CASE
                        WHEN @v_key_rate IS NULL THEN @v_key_concurrency
                        WHEN @v_key_concurrency IS NULL OR @v_key_concurrency > FLOOR(@v_key_burst)
                            THEN CAST(FLOOR(@v_key_burst) AS int)
                        ELSE @v_key_concurrency END;
                    WITH busy AS (
                        SELECT d.partition_key AS k, COUNT(*) AS n
                        FROM workqueue.delivery AS d
                        WHERE @v_key_concurrency IS NOT NULL AND d.subscription_id = @v_subscription_id
                          AND d.status = N'InFlight' AND d.lease_expires_at > @v_now AND d.partition_key IS NOT NULL
                        GROUP BY d.partition_key
                    ), bucket AS (
                        SELECT b.partition_key AS k,
                               CASE WHEN f.t > @v_key_burst THEN @v_key_burst ELSE f.t END AS t
                        FROM workqueue.rate_bucket AS b
                        CROSS APPLY (SELECT b.tokens + CASE WHEN b.updated_at < @v_now
                                                            THEN DATEDIFF_BIG(microsecond, b.updated_at, @v_now) / 1000000.0
                                                            ELSE 0 END * @v_key_rate AS t) AS f
                        WHERE @v_key_rate IS NOT NULL AND b.subscription_id = @v_subscription_id AND b.per_key = 1
                    ), room AS (
                        SELECT COALESCE(busy.k, bucket.k) AS k, bucket.t,
                               CASE WHEN bucket.t IS NOT NULL
                                         AND (busy.n IS NULL OR FLOOR(bucket.t) < @v_key_concurrency - busy.n)
                                    THEN CAST(FLOOR(bucket.t) AS int)
                                    ELSE @v_key_concurrency - busy.n END AS n
                        FROM busy FULL JOIN bucket ON bucket.k = busy.k
                    )
                    INSERT INTO @v_room (partition_key, room, tokens)
                    SELECT r.k, CASE WHEN r.n > 0 THEN r.n ELSE 0 END, r.t
                    FROM room AS r
                    WHERE r.n < @v_default_room;
                    IF EXISTS (SELECT 1 FROM @v_room AS r WHERE r.room = 0)
                        SET @v_has_blocked = 1;
                    IF EXISTS (SELECT 1 FROM @v_room AS r WHERE r.room = 0 AND FLOOR(r.tokens) < 1)
                        SET @v_key_spent = 1;
                END;
            END;

            IF @v_limit > 0 AND @v_partition_mode <> N'None' COLLATE Latin1_General_100_BIN2
            BEGIN
                -- Keys a settle or the sweeper could not hand over (their producer held them) are
                -- re-derived first, where nobody holds them now.
                IF EXISTS (SELECT 1 FROM workqueue.partition_stale AS ps WHERE ps.subscription_id = @v_subscription_id)
                BEGIN
                    SET @v_subscriptions = N'[' + CAST(@v_subscription_id AS nvarchar(20)) + N']';
                    EXEC workqueue.rederive_stale @p_subscription_ids = @v_subscriptions, @p_limit = @v_limit;
                END;
                -- Keys that can run now: their partition row is the lock. Those whose next delivery
                -- has a priority first; a key a rate limit holds back is passed over.
                IF EXISTS (SELECT 1 FROM workqueue.partition AS pt
                           WHERE pt.subscription_id = @v_subscription_id AND pt.holder_id IS NULL
                             AND pt.next_id IS NOT NULL AND pt.next_priority > 0)
                BEGIN
                    INSERT INTO @v_keyed (next_id, partition_key)
                    SELECT TOP (@v_limit) pt.next_id, pt.partition_key
                    FROM workqueue.partition AS pt WITH (UPDLOCK, READPAST, ROWLOCK)
                    WHERE pt.subscription_id = @v_subscription_id AND pt.holder_id IS NULL
                      AND pt.next_id IS NOT NULL AND pt.next_priority > 0 AND pt.next_visible_at <= @v_now
                      AND NOT EXISTS (SELECT 1 FROM @v_room AS r WHERE r.partition_key = pt.partition_key AND r.room = 0)
                    ORDER BY pt.next_priority DESC, pt.next_visible_at, pt.next_id;
                    SET @v_keyed_count = @@ROWCOUNT;
                END;
                IF @v_keyed_count < @v_limit
                BEGIN
                    INSERT INTO @v_keyed (next_id, partition_key)
                    SELECT TOP (@v_limit - @v_keyed_count) pt.next_id, pt.partition_key
                    FROM workqueue.partition AS pt WITH (UPDLOCK, READPAST, ROWLOCK)
                    WHERE pt.subscription_id = @v_subscription_id AND pt.holder_id IS NULL
                      AND pt.next_id IS NOT NULL AND pt.next_priority = 0 AND pt.next_visible_at <= @v_now
                      AND NOT EXISTS (SELECT 1 FROM @v_room AS r WHERE r.partition_key = pt.partition_key AND r.room = 0)
                    ORDER BY pt.next_visible_at, pt.next_id;
                    SET @v_keyed_count = @v_keyed_count + @@ROWCOUNT;
                END;
            END;

            -- Deliveries without a key lock (None mode, or no partition key), the highest
            -- priority first; on a keyed subscription they share the claim with the keys.
            SET @v_share = CASE
                WHEN @v_keyed_count = 0 THEN @v_limit
                WHEN @v_limit - @v_keyed_count > @v_limit / 2 THEN @v_limit - @v_keyed_count
                WHEN @v_limit = 1 THEN 1  -- a claim of one looks for one of each (below)
                ELSE @v_limit / 2
            END;
            IF @v_share > 0 AND @v_key_limited = 1 AND @v_partition_mode = N'None' COLLATE Latin1_General_100_BIN2
            BEGIN
                -- Under key limits: a window of candidates in claim order past the keys without
                -- room, then each key's beyond its room left out. The application lock keeps other
                -- claimers of the subscription out, so nothing is locked until the UPDATE below.
                INSERT INTO @v_window (id, message_id, priority, visible_at, partition_key)
                SELECT TOP (@v_share * 4) d.id, d.message_id, d.priority, d.visible_at, d.partition_key
                FROM workqueue.delivery AS d
                WHERE d.subscription_id = @v_subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.priority > 0 AND d.visible_at <= @v_now
                  AND NOT EXISTS (SELECT 1 FROM @v_room AS r WHERE r.partition_key = d.partition_key AND r.room = 0)
                ORDER BY d.priority DESC, d.visible_at, d.id;
                INSERT INTO @v_window (id, message_id, priority, visible_at, partition_key)
                SELECT TOP (@v_share * 4) d.id, d.message_id, d.priority, d.visible_at, d.partition_key
                FROM workqueue.delivery AS d
                WHERE d.subscription_id = @v_subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.priority = 0 AND d.visible_at <= @v_now
                  AND NOT EXISTS (SELECT 1 FROM @v_room AS r WHERE r.partition_key = d.partition_key AND r.room = 0)
                ORDER BY d.visible_at, d.id;
                WITH ranked AS (
                    SELECT w.id, w.message_id, w.priority, w.visible_at, w.partition_key,
                           ROW_NUMBER() OVER (PARTITION BY w.partition_key
                                              ORDER BY w.priority DESC, w.visible_at, w.id) AS rn
                    FROM @v_window AS w
                )
                INSERT INTO @v_unkeyed (id, message_id)
                SELECT TOP (@v_share) x.id, x.message_id
                FROM ranked AS x
                LEFT JOIN @v_room AS r ON r.partition_key = x.partition_key
                WHERE x.partition_key IS NULL OR x.rn <= COALESCE(r.room, @v_default_room)
                ORDER BY x.priority DESC, x.visible_at, x.id;
                SET @v_unkeyed_count = @@ROWCOUNT;
                IF @v_unkeyed_count < @v_share AND @v_held IS NULL AND EXISTS (
                    SELECT 1 FROM workqueue.delivery AS d
                    WHERE d.subscription_id = @v_subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                      AND d.visible_at <= @v_now AND NOT EXISTS (SELECT 1 FROM @v_unkeyed AS u WHERE u.id = d.id)
                )
                    SET @v_held = CASE WHEN @v_key_rate IS NOT NULL AND (@v_key_spent = 1 OR @v_key_concurrency IS NULL)
                                       THEN N'KeyRateLimit' ELSE N'KeyConcurrency' END;
            END
            ELSE IF @v_share > 0
            BEGIN
                IF EXISTS (SELECT 1 FROM workqueue.delivery AS d
                           WHERE d.subscription_id = @v_subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                             AND d.priority > 0)
                BEGIN
                    INSERT INTO @v_unkeyed (id, message_id)
                    SELECT TOP (@v_share) d.id, d.message_id
                    FROM workqueue.delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
                    WHERE d.subscription_id = @v_subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                      AND d.priority > 0 AND d.visible_at <= @v_now
                    ORDER BY d.priority DESC, d.visible_at, d.id;
                    SET @v_unkeyed_count = @@ROWCOUNT;
                END;
                IF @v_unkeyed_count < @v_share
                BEGIN
                    INSERT INTO @v_unkeyed (id, message_id)
                    SELECT TOP (@v_share - @v_unkeyed_count) d.id, d.message_id
                    FROM workqueue.delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
                    WHERE d.subscription_id = @v_subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                      AND d.priority = 0 AND d.visible_at <= @v_now
                    ORDER BY d.visible_at, d.id;
                    SET @v_unkeyed_count = @v_unkeyed_count + @@ROWCOUNT;
                END;
            END;

            IF @v_keyed_count > 0 AND @v_unkeyed_count > 0 AND @v_keyed_count + @v_unkeyed_count > @v_limit
            BEGIN
                IF @v_limit = 1
                BEGIN
                    -- One of each: the first in claim order is taken.
                    IF EXISTS (SELECT 1
                               FROM @v_keyed AS k INNER JOIN workqueue.delivery AS kd ON kd.id = k.next_id
                               CROSS JOIN @v_unkeyed AS u INNER JOIN workqueue.delivery AS ud ON ud.id = u.id
                               WHERE kd.priority < ud.priority
                                  OR (kd.priority = ud.priority AND (kd.visible_at > ud.visible_at
                                      OR (kd.visible_at = ud.visible_at AND kd.id > ud.id))))
                    BEGIN
                        DELETE FROM @v_keyed;
                        SET @v_keyed_count = 0;
                    END
                    ELSE
                    BEGIN
                        DELETE FROM @v_unkeyed;
                        SET @v_unkeyed_count = 0;
                    END;
                END
                ELSE
                BEGIN
                    DELETE FROM @v_keyed WHERE ord > @v_limit - @v_unkeyed_count;
                    SET @v_keyed_count = @v_limit - @v_unkeyed_count;
                END;
            END;

            INSERT INTO @v_ids (id)
            SELECT k.next_id FROM @v_keyed AS k
            UNION
            SELECT u.id FROM @v_unkeyed AS u;
            SET @v_wanted = @@ROWCOUNT;

            IF @v_wanted > 0
            BEGIN
                UPDATE d
                SET status = N'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
                    lease_token = NEWID(), lease_expires_at = @v_lease_expires_at, claimed_at = @v_now,
                    held_by = @p_holder, progress_percent = NULL, progress_message = NULL
                OUTPUT inserted.id, inserted.lease_token, inserted.attempt, inserted.max_attempts,
                       inserted.lease_expires_at, inserted.message_id, inserted.partition_key, inserted.key_mode,
                       inserted.priority, inserted.visible_at
                INTO @v_claimed (id, lease_token, attempt, max_attempts, lease_expires_at, message_id,
                                 partition_key, key_mode, priority, visible_at)
                FROM workqueue.delivery AS d
                INNER JOIN @v_ids AS x ON x.id = d.id
                WHERE d.status = N'Pending';
                SET @v_got = @@ROWCOUNT;

                UPDATE pt
                SET holder_id = c.id, next_id = NULL, next_visible_at = NULL, next_priority = 0
                FROM workqueue.partition AS pt
                INNER JOIN @v_claimed AS c
                    ON pt.subscription_id = @v_subscription_id AND pt.partition_key = c.partition_key
                WHERE c.key_mode > 0
                  AND pt.partition_key IN (SELECT k.partition_key FROM @v_keyed AS k);

                IF @v_got < @v_wanted AND @v_keyed_count > 0
                BEGIN
                    -- A key pointed at a delivery that was no longer Pending: re-derive those keys.
                    WHILE 1 = 1
                    BEGIN
                        SET @v_key = NULL;
                        SELECT TOP (1) @v_ord = k.ord, @v_key = k.partition_key
                        FROM @v_keyed AS k
                        WHERE k.ord > @v_ord
                        ORDER BY k.ord;
                        IF @v_key IS NULL
                            BREAK;
                        IF EXISTS (
                            SELECT 1 FROM workqueue.partition AS pt
                            WHERE pt.subscription_id = @v_subscription_id AND pt.partition_key = @v_key
                              AND pt.holder_id IS NULL
                        )
                            EXEC workqueue.refresh_partition
                                @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_mode;
                    END;
                END;
            END;

            IF @v_limited = 1
            BEGIN
                -- Under flow limits: what was claimed is spent from the buckets, and when a limit
                -- kept claimable work back, a row without a delivery says which, and when a token
                -- is due.
                IF @v_got > 0 AND @v_rate IS NOT NULL
                BEGIN
                    UPDATE b SET tokens = @v_tokens - @v_got, updated_at = @v_now
                    FROM workqueue.rate_bucket AS b
                    WHERE b.subscription_id = @v_subscription_id AND b.per_key = 0 AND b.partition_key = N'';
                    IF @@ROWCOUNT = 0
                        INSERT INTO workqueue.rate_bucket (subscription_id, per_key, partition_key, tokens, updated_at)
                        VALUES (@v_subscription_id, 0, N'', @v_tokens - @v_got, @v_now);
                END;
                IF @v_got > 0 AND @v_key_rate IS NOT NULL
                BEGIN
                    WITH spent AS (
                        SELECT c.partition_key, COUNT(*) AS n FROM @v_claimed AS c
                        WHERE c.partition_key IS NOT NULL GROUP BY c.partition_key
                    )
                    MERGE workqueue.rate_bucket AS b
                    USING spent AS x
                        ON b.subscription_id = @v_subscription_id AND b.per_key = 1 AND b.partition_key = x.partition_key
                    WHEN MATCHED THEN UPDATE SET
                        tokens = CASE WHEN b.tokens + CASE WHEN b.updated_at < @v_now
                                                           THEN DATEDIFF_BIG(microsecond, b.updated_at, @v_now) / 1000000.0
                                                           ELSE 0 END * @v_key_rate > @v_key_burst
                                      THEN @v_key_burst
                                      ELSE b.tokens + CASE WHEN b.updated_at < @v_now
                                                           THEN DATEDIFF_BIG(microsecond, b.updated_at, @v_now) / 1000000.0
                                                           ELSE 0 END * @v_key_rate END - x.n,
                        updated_at = @v_now
                    WHEN NOT MATCHED THEN
                        INSERT (subscription_id, per_key, partition_key, tokens, updated_at)
                        VALUES (@v_subscription_id, 1, x.partition_key, @v_key_burst - x.n, @v_now);
                END;
                IF @v_held IS NULL AND @v_has_blocked = 1 AND @v_got < @p_limit
                    SET @v_held = CASE WHEN @v_key_rate IS NOT NULL AND (@v_key_spent = 1 OR @v_key_concurrency IS NULL)
                                       THEN N'KeyRateLimit' ELSE N'KeyConcurrency' END;
                IF @v_held = N'RateLimit' COLLATE Latin1_General_100_BIN2
                    SET @v_retry = (1 - (@v_tokens - @v_got)) / @v_rate;
                ELSE IF @v_held = N'KeyRateLimit' COLLATE Latin1_General_100_BIN2
                BEGIN
                    -- When the fullest spent bucket of a key gets its next token.
                    SELECT @v_fullest = MAX(CASE WHEN f.t > @v_key_burst THEN @v_key_burst ELSE f.t END)
                    FROM workqueue.rate_bucket AS b
                    CROSS APPLY (SELECT b.tokens + CASE WHEN b.updated_at < @v_now
                                                        THEN DATEDIFF_BIG(microsecond, b.updated_at, @v_now) / 1000000.0
                                                        ELSE 0 END * @v_key_rate AS t) AS f
                    WHERE b.subscription_id = @v_subscription_id AND b.per_key = 1 AND f.t < 1;
                    SET @v_retry = (1 - @v_fullest) / @v_key_rate;
                END;
                IF @v_held IS NOT NULL AND @v_got < @p_limit AND (
                    EXISTS (SELECT 1 FROM workqueue.delivery AS d
                            WHERE d.subscription_id = @v_subscription_id AND d.status = N'Pending'
                              AND d.key_mode = 0 AND d.visible_at <= @v_now)
                    OR EXISTS (SELECT 1 FROM workqueue.partition AS pt
                               WHERE pt.subscription_id = @v_subscription_id AND pt.holder_id IS NULL
                                 AND pt.next_id IS NOT NULL AND pt.next_visible_at <= @v_now)
                )
                    INSERT INTO @v_claimed (id, held_back, retry_after)
                    VALUES (0, @v_held, CASE WHEN @v_retry < 0 THEN 0 ELSE @v_retry END);
            END;

            IF @v_own_transaction = 1
                COMMIT TRANSACTION;
        END;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT NULLIF(c.id, 0) AS delivery_id, c.lease_token, c.attempt, c.max_attempts, c.lease_expires_at,
           m.id AS message_id, m.topic, m.partition_key, m.attributes, m.payload, m.payload_ref,
           m.correlation_id, m.published_at, c.held_back, c.retry_after
    FROM @v_claimed AS c
    LEFT JOIN workqueue.message AS m ON m.id = c.message_id
    ORDER BY CASE WHEN c.id = 0 THEN 1 ELSE 0 END, c.priority DESC, c.visible_at, c.id;
END;
GO

-- Claims up to @p_limit visible deliveries across several None-mode subscriptions (a JSON array
-- of names), the oldest due first (visible_at, then id) whatever their subscription, each leased
-- for its own subscription's lease_seconds and answered with that subscription's name. Paused
-- subscriptions (or topics) and unknown names give nothing; an Exclusive or Ordered one is
-- refused (THROW 51005; claim takes those). Each subscription's claim index gives at most
-- @p_limit candidates; the first @p_limit of them all set each subscription's share, which is
-- locked from the same index UPDLOCK, READPAST, ROWLOCK, as claim locks (reading message_id,
-- which the index does not cover, so the row itself is locked: see the top of this file).
-- returns: subscription, delivery_id, lease_token, attempt, max_attempts, lease_expires_at, message_id, topic, partition_key, attributes, payload, payload_ref, correlation_id, published_at
CREATE OR ALTER PROCEDURE workqueue.claim_many
    @p_subscriptions nvarchar(max),
    @p_limit int,
    @p_holder uniqueidentifier = NULL,
    @p_now datetimeoffset(6) = NULL,
    @p_lease_seconds nvarchar(max) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    DECLARE @v_keyed nvarchar(max);
    DECLARE @v_message nvarchar(2048);
    DECLARE @v_names TABLE (name nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY);
    DECLARE @v_subs TABLE (
        id int NOT NULL PRIMARY KEY,
        name nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
        lease_seconds float NOT NULL
    );
    DECLARE @v_candidates TABLE (
        id bigint NOT NULL PRIMARY KEY,
        subscription_id int NOT NULL,
        priority smallint NOT NULL,
        visible_at datetimeoffset(6) NOT NULL
    );
    DECLARE @v_shares TABLE (subscription_id int NOT NULL PRIMARY KEY, urgent int NOT NULL, n int NOT NULL);
    DECLARE @v_ids TABLE (id bigint NOT NULL PRIMARY KEY);
    DECLARE @v_claimed TABLE (
        id bigint NOT NULL PRIMARY KEY,
        subscription_id int NOT NULL,
        lease_token uniqueidentifier NOT NULL,
        attempt int NOT NULL,
        max_attempts int NOT NULL,
        lease_expires_at datetimeoffset(6) NOT NULL,
        message_id uniqueidentifier NOT NULL,
        visible_at datetimeoffset(6) NOT NULL,
        priority smallint NOT NULL
    );

    -- Names compare in binary, as everywhere (not in the database's default collation), and a name
    -- longer than a subscription's can be is no subscription's (not cut to one that is).
    INSERT INTO @v_names (name)
    SELECT DISTINCT CAST(j.value AS nvarchar(200)) COLLATE Latin1_General_100_BIN2
    FROM OPENJSON(@p_subscriptions) AS j
    WHERE j.value IS NOT NULL AND LEN(j.value) <= 200;
    SELECT @v_keyed = MIN(CASE WHEN s.partition_mode <> N'None' THEN CONCAT(s.name, N' is ', s.partition_mode)
                               ELSE CONCAT(s.name, N' has flow limits') END)
    FROM workqueue.subscription AS s
    INNER JOIN @v_names AS n ON n.name = s.name
    WHERE s.partition_mode <> N'None' OR s.max_in_flight IS NOT NULL OR s.key_concurrency IS NOT NULL
       OR s.rate_limit IS NOT NULL OR s.key_rate_limit IS NOT NULL;
    IF @v_keyed IS NOT NULL
    BEGIN
        SET @v_message = CONCAT(
            N'claim_many takes None-mode subscriptions only (', @v_keyed,
            N'); claim an Exclusive or Ordered subscription, or one with flow limits, with claim');
        THROW 51005, @v_message, 1;
    END;

    BEGIN TRY
        IF @p_limit >= 1
        BEGIN
            -- Each leased for what the claiming process counts (@p_lease_seconds, in the order of
            -- @p_subscriptions), else for the subscription's own lease.
            INSERT INTO @v_subs (id, name, lease_seconds)
            SELECT s.id, s.name,
                   COALESCE((SELECT TOP (1) TRY_CAST(l.value AS float)
                             FROM OPENJSON(@p_lease_seconds) AS l
                             INNER JOIN OPENJSON(@p_subscriptions) AS o ON o.[key] = l.[key]
                             WHERE CAST(o.value AS nvarchar(200)) COLLATE Latin1_General_100_BIN2 = s.name
                               AND TRY_CAST(l.value AS float) > 0 AND TRY_CAST(l.value AS float) < 1e9),
                            s.lease_seconds)
            FROM workqueue.subscription AS s
            INNER JOIN @v_names AS n ON n.name = s.name
            INNER JOIN workqueue.topic AS t ON t.name = s.topic
            WHERE s.status = N'Active' AND t.status = N'Active';

            IF @v_own_transaction = 1
                BEGIN TRANSACTION;

            -- Each subscription's candidates: those with a priority (an index that is empty without
            -- them), then the oldest due of the others.
            INSERT INTO @v_candidates (id, subscription_id, priority, visible_at)
            SELECT d.id, s.id, d.priority, d.visible_at
            FROM @v_subs AS s
            CROSS APPLY (
                SELECT TOP (@p_limit) d.id, d.visible_at, d.priority
                FROM workqueue.delivery AS d
                WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.priority > 0 AND d.visible_at <= @v_now
                ORDER BY d.priority DESC, d.visible_at, d.id
            ) AS d;
            INSERT INTO @v_candidates (id, subscription_id, priority, visible_at)
            SELECT d.id, s.id, d.priority, d.visible_at
            FROM @v_subs AS s
            CROSS APPLY (
                SELECT TOP (@p_limit) d.id, d.visible_at, d.priority
                FROM workqueue.delivery AS d
                WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.priority = 0 AND d.visible_at <= @v_now
                ORDER BY d.visible_at, d.id
            ) AS d;

            -- Each subscription's share of the @p_limit first of them all: the highest priority,
            -- then the oldest due.
            INSERT INTO @v_shares (subscription_id, urgent, n)
            SELECT c.subscription_id, SUM(CASE WHEN c.priority > 0 THEN 1 ELSE 0 END),
                   SUM(CASE WHEN c.priority = 0 THEN 1 ELSE 0 END)
            FROM (
                SELECT TOP (@p_limit) x.subscription_id, x.priority
                FROM @v_candidates AS x
                ORDER BY x.priority DESC, x.visible_at, x.id
            ) AS c
            GROUP BY c.subscription_id;

            -- Each share, locked from its subscription's indexes past the rows other claimers hold.
            INSERT INTO @v_ids (id)
            SELECT l.id
            FROM @v_shares AS k
            CROSS APPLY (
                SELECT TOP (k.urgent) d.id, d.message_id
                FROM workqueue.delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
                WHERE d.subscription_id = k.subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.priority > 0 AND d.visible_at <= @v_now
                ORDER BY d.priority DESC, d.visible_at, d.id
            ) AS l;
            INSERT INTO @v_ids (id)
            SELECT l.id
            FROM @v_shares AS k
            CROSS APPLY (
                SELECT TOP (k.n) d.id, d.message_id
                FROM workqueue.delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
                WHERE d.subscription_id = k.subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.priority = 0 AND d.visible_at <= @v_now
                ORDER BY d.visible_at, d.id
            ) AS l;

            UPDATE d
            SET status = N'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
                lease_token = NEWID(),
                lease_expires_at = DATEADD(
                    microsecond, CAST((s.lease_seconds - FLOOR(s.lease_seconds)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(s.lease_seconds) AS int), @v_now)),
                claimed_at = @v_now, held_by = @p_holder, progress_percent = NULL, progress_message = NULL
            OUTPUT inserted.id, inserted.subscription_id, inserted.lease_token, inserted.attempt,
                   inserted.max_attempts, inserted.lease_expires_at, inserted.message_id, inserted.visible_at,
                   inserted.priority
            INTO @v_claimed (id, subscription_id, lease_token, attempt, max_attempts, lease_expires_at,
                             message_id, visible_at, priority)
            FROM workqueue.delivery AS d
            INNER JOIN @v_ids AS x ON x.id = d.id
            INNER JOIN @v_subs AS s ON s.id = d.subscription_id
            WHERE d.status = N'Pending';

            IF @v_own_transaction = 1
                COMMIT TRANSACTION;
        END;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT s.name AS subscription, c.id AS delivery_id, c.lease_token, c.attempt, c.max_attempts,
           c.lease_expires_at, m.id AS message_id, m.topic, m.partition_key, m.attributes, m.payload,
           m.payload_ref, m.correlation_id, m.published_at
    FROM @v_claimed AS c
    INNER JOIN @v_subs AS s ON s.id = c.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = c.message_id
    ORDER BY c.priority DESC, c.visible_at, c.id;
END;
GO

-- Renews the leases of the given deliveries and stores their progress. alive is false once the
-- token is stale (the lease was lost) or an operator asked to cancel; a cancelled delivery's
-- lease is not renewed, so a holder that ignores the cancel loses it.
-- returns: delivery_id, alive, cancel_requested, lease_expires_at
CREATE OR ALTER PROCEDURE workqueue.heartbeat
    @p_ids nvarchar(max),
    @p_tokens nvarchar(max),
    @p_percents nvarchar(max),
    @p_messages nvarchar(max),
    @p_now datetimeoffset(6) = NULL,
    @p_lease_seconds nvarchar(max) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    DECLARE @v_i TABLE (
        ord int NOT NULL PRIMARY KEY,
        id bigint NULL,
        token uniqueidentifier NULL,
        pct smallint NULL,
        msg nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        lease float NULL
    );
    DECLARE @v_u TABLE (
        id bigint NOT NULL PRIMARY KEY,
        cancel_requested bit NOT NULL,
        lease_expires_at datetimeoffset(6) NULL
    );

    INSERT INTO @v_i (ord, id, token, pct, msg, lease)
    SELECT CAST(a.[key] AS int), CAST(a.value AS bigint), TRY_CAST(b.value AS uniqueidentifier),
           CAST(c.value AS smallint), e.value,
           CASE WHEN TRY_CAST(f.value AS float) > 0 AND TRY_CAST(f.value AS float) < 1e9
                THEN TRY_CAST(f.value AS float) END
    FROM OPENJSON(@p_ids) AS a
    LEFT JOIN OPENJSON(@p_tokens) AS b ON b.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_percents) AS c ON c.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_messages) AS e ON e.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_lease_seconds) AS f ON f.[key] = a.[key];

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        UPDATE d
        -- A cancel-requested delivery is renewed too (its handler is winding down; its key stays busy).
        SET lease_expires_at = DATEADD(
                microsecond, CAST((g.secs - FLOOR(g.secs)) * 1000000 AS int),
                DATEADD(second, CAST(FLOOR(g.secs) AS int), @v_now)),
            progress_percent = COALESCE(i.pct, d.progress_percent),
            progress_message = COALESCE(i.msg, d.progress_message)
        OUTPUT inserted.id, inserted.cancel_requested, inserted.lease_expires_at
        INTO @v_u (id, cancel_requested, lease_expires_at)
        FROM workqueue.delivery AS d
        INNER JOIN @v_i AS i ON i.id = d.id AND i.token = d.lease_token
        INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
        CROSS APPLY (SELECT COALESCE(i.lease, s.lease_seconds) AS secs) AS g  -- the process's lease, as claim
        WHERE d.status = N'InFlight';
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT i.id AS delivery_id,
           CAST(CASE WHEN u.id IS NOT NULL AND u.cancel_requested = 0 THEN 1 ELSE 0 END AS bit) AS alive,
           CAST(COALESCE(u.cancel_requested, 0) AS bit) AS cancel_requested,
           u.lease_expires_at
    FROM @v_i AS i
    LEFT JOIN @v_u AS u ON u.id = i.id
    ORDER BY i.ord;
END;
GO

-- Settles deliveries with their current lease token. Outcomes: Complete, Retry (explicit, with a
-- reason and optional delay), Fail (an error), DeadLetter, Discard (Discarded with the reason,
-- never retried), Release (shutdown, or a busy once key: back to Pending after the optional delay
-- without consuming the attempt). A cancel-requested delivery becomes Discarded whatever the
-- outcome. A stale token changes nothing and answers LeaseLost. (An id given twice is settled
-- once, by its first item.) @p_draws are the caller's jitter draws; the batch's
-- terminal settles are counted in settled_count.
-- returns: delivery_id, result
CREATE OR ALTER PROCEDURE workqueue.settle
    @p_ids nvarchar(max),
    @p_tokens nvarchar(max),
    @p_outcomes nvarchar(max),
    @p_delays nvarchar(max),
    @p_reasons nvarchar(max),
    @p_errors nvarchar(max),
    @p_draws nvarchar(max) = NULL,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    DECLARE @v_settled nvarchar(max);
    DECLARE @v_claimable TABLE (subscription_id int NOT NULL);
    DECLARE @v_i TABLE (
        ord int NOT NULL PRIMARY KEY,
        id bigint NULL,
        token uniqueidentifier NULL,
        outcome nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
        delay float NULL,
        reason nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        error nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        draw float NULL
    );
    DECLARE @v_locked TABLE (
        id bigint NOT NULL PRIMARY KEY,
        lease_token uniqueidentifier NOT NULL,
        attempt int NOT NULL,
        max_attempts int NOT NULL,
        cancel_requested bit NOT NULL,
        backoff_base_seconds float NOT NULL,
        backoff_max_seconds float NOT NULL,
        backoff_schedule nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
    );
    DECLARE @v_plan TABLE (
        id bigint NOT NULL PRIMARY KEY,
        outcome nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
        delay float NULL,
        reason nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        error nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        draw float NULL,
        cancel_requested bit NOT NULL,
        new_status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        wait_seconds float NULL
    );
    DECLARE @v_u TABLE (
        id bigint NOT NULL PRIMARY KEY,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        attempt int NOT NULL,
        claimed_at datetimeoffset(6) NULL,
        held_by uniqueidentifier NULL,
        reason nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        outcome nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
        error nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
    );

    INSERT INTO @v_i (ord, id, token, outcome, delay, reason, error, draw)
    SELECT CAST(a.[key] AS int), CAST(a.value AS bigint), TRY_CAST(b.value AS uniqueidentifier),
           c.value, CAST(e.value AS float), f.value, g.value, CAST(h.value AS float)
    FROM OPENJSON(@p_ids) AS a
    LEFT JOIN OPENJSON(@p_tokens) AS b ON b.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_outcomes) AS c ON c.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_delays) AS e ON e.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_reasons) AS f ON f.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_errors) AS g ON g.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_draws) AS h ON h.[key] = a.[key];

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- Lock the InFlight deliveries that still carry a given token, in id order.
        INSERT INTO @v_locked (
            id, lease_token, attempt, max_attempts, cancel_requested, backoff_base_seconds,
            backoff_max_seconds, backoff_schedule)
        SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds,
               d.backoff_max_seconds, d.backoff_schedule
        FROM workqueue.delivery AS d WITH (UPDLOCK, ROWLOCK)
        WHERE d.id IN (SELECT i.id FROM @v_i AS i) AND d.status = N'InFlight'
          AND d.lease_token IN (SELECT i.token FROM @v_i AS i)
        ORDER BY d.id;

        INSERT INTO @v_plan (id, outcome, delay, reason, error, draw, cancel_requested, new_status)
        SELECT l.id, i.outcome, i.delay, i.reason, i.error, i.draw, l.cancel_requested,
               CASE WHEN l.cancel_requested = 1 THEN N'Discarded'
                    WHEN i.outcome = N'Complete' THEN N'Completed'
                    WHEN i.outcome = N'Discard' THEN N'Discarded'
                    WHEN i.outcome = N'Release' THEN N'Pending'
                    WHEN i.outcome = N'DeadLetter' THEN N'DeadLettered'
                    WHEN l.attempt >= l.max_attempts THEN N'DeadLettered'
                    ELSE N'Pending' END
        FROM @v_locked AS l
        CROSS APPLY (
            SELECT TOP (1) x.outcome, x.delay, x.reason, x.error, x.draw
            FROM @v_i AS x
            WHERE x.id = l.id AND x.token = l.lease_token
            ORDER BY x.ord
        ) AS i;

        -- The wait before a Pending delivery is visible again: the caller's draw of the item, or
        -- (none given) one drawn here per delivery.
        UPDATE p
        SET wait_seconds = CASE
                WHEN p.new_status <> N'Pending' THEN NULL
                WHEN p.outcome = N'Release' THEN COALESCE(p.delay, 0)
                WHEN p.delay IS NOT NULL THEN p.delay
                ELSE workqueue.backoff_seconds(l.attempt, l.backoff_base_seconds, l.backoff_max_seconds,
                                               l.backoff_schedule, p.draw)
            END
        FROM @v_plan AS p
        INNER JOIN @v_locked AS l ON l.id = p.id;

        UPDATE d
        SET status = p.new_status,
            attempt = CASE
                WHEN p.outcome = N'Release' AND p.new_status = N'Pending'
                    THEN CASE WHEN d.attempt > 1 THEN d.attempt - 1 ELSE 0 END
                ELSE d.attempt
            END,
            visible_at = CASE
                WHEN p.new_status <> N'Pending' THEN d.visible_at
                ELSE DATEADD(
                    microsecond, CAST((p.wait_seconds - FLOOR(p.wait_seconds)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(p.wait_seconds) AS int), @v_now))
            END,
            lease_token = NULL,
            lease_expires_at = NULL,
            reason = CASE
                WHEN p.cancel_requested = 1 THEN d.reason
                WHEN p.outcome = N'Complete' THEN NULL
                WHEN p.new_status = N'DeadLettered' AND p.outcome <> N'DeadLetter'
                    THEN COALESCE(N'max attempts reached: ' + COALESCE(p.reason, p.error), N'max attempts reached')
                ELSE COALESCE(p.reason, d.reason)
            END,
            last_error = COALESCE(p.error, d.last_error),
            settled_at = CASE WHEN p.new_status IN (N'Completed', N'Discarded', N'DeadLettered') THEN @v_now END
        OUTPUT inserted.id, inserted.status, inserted.key_mode, inserted.subscription_id, inserted.partition_key,
               inserted.attempt, inserted.claimed_at, inserted.held_by, inserted.reason, p.outcome, p.error
        INTO @v_u (id, status, key_mode, subscription_id, partition_key, attempt, claimed_at, held_by, reason,
                   outcome, error)
        FROM workqueue.delivery AS d
        INNER JOIN @v_plan AS p ON p.id = d.id;

        -- An attempt off the happy path is kept (delivery_attempt); a completion or a release
        -- writes nothing there.
        INSERT INTO workqueue.delivery_attempt (delivery_id, attempt, started_at, ended_at, held_by, outcome,
                                                reason, error)
        SELECT u.id, u.attempt, u.claimed_at, @v_now, u.held_by,
               CASE WHEN u.status = N'Pending' THEN N'Failed' ELSE u.status END, u.reason, u.error
        FROM @v_u AS u
        WHERE u.status <> N'Completed' AND NOT (u.outcome = N'Release' AND u.status = N'Pending');
        IF @@ROWCOUNT > 0
        BEGIN
            -- Keep the newest 50 attempts of each delivery.
            DELETE a
            FROM workqueue.delivery_attempt AS a
            WHERE a.delivery_id IN (SELECT u.id FROM @v_u AS u WHERE u.status <> N'Completed')
              AND a.id <= (SELECT b.id FROM workqueue.delivery_attempt AS b WHERE b.delivery_id = a.delivery_id
                           ORDER BY b.id DESC OFFSET 50 ROWS FETCH NEXT 1 ROWS ONLY);
        END;

        -- The batch's terminal settles, one row per subscription (settled_count).
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, SUM(CASE WHEN u.status = N'Completed' THEN CAST(1 AS bigint) ELSE 0 END),
               SUM(CASE WHEN u.status = N'Discarded' THEN CAST(1 AS bigint) ELSE 0 END)
        FROM @v_u AS u
        WHERE u.status IN (N'Completed', N'Discarded')
        GROUP BY u.subscription_id;

        -- Free the keys of the settled deliveries, all at once (release_keys takes those nobody
        -- else holds, in key order, and marks the others stale). Its result, the subscriptions
        -- with a key claimable now, is what PostgreSQL notifies; consumers poll here, so it is only
        -- read to keep it from the client.
        IF EXISTS (SELECT 1 FROM @v_u AS u WHERE u.key_mode > 0)
        BEGIN
            SELECT @v_settled = N'[' + STRING_AGG(CAST(u.id AS nvarchar(max)), N',') + N']'
            FROM @v_u AS u;
            INSERT INTO @v_claimable (subscription_id)
            EXEC workqueue.release_keys @p_ids = @v_settled;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT i.id AS delivery_id, COALESCE(u.status, N'LeaseLost') AS result
    FROM @v_i AS i
    LEFT JOIN @v_u AS u ON u.id = i.id
    ORDER BY i.ord;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Sweeper and retention
-- ---------------------------------------------------------------------------------------------

-- Each of these reads the time once: @p_now when the caller gives it (a test's clock), else
-- SYSDATETIMEOFFSET() (docs/design/time.md).

-- InFlight deliveries whose lease ran out: Discarded when a cancel was requested, DeadLettered
-- when the attempt was the last, otherwise Pending again after backoff (the attempt counts).
-- The locking read takes the backoff columns, which no index of the InFlight rows covers, so
-- it locks the delivery rows themselves (see the top of this file).
--
-- PostgreSQL frees the keys of the expired deliveries with release_keys. Here each key is
-- re-derived with refresh_partition, in key order (the same result): sweep reads this procedure's
-- result with INSERT ... EXEC, and SQL Server does not allow a procedure run that way to read
-- release_keys the same way (INSERT ... EXEC cannot nest). As in release_keys, a
-- key another transaction holds is not waited for: it is marked stale and re-derived later.
-- returns: delivery_id, result
CREATE OR ALTER PROCEDURE workqueue.expire_leases
    @p_limit int,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    DECLARE @v_k int;
    DECLARE @v_k_count int;
    DECLARE @v_key_subscription int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_mode smallint;
    DECLARE @v_key_found bit;
    DECLARE @v_key_holder bigint;
    DECLARE @v_expired TABLE (
        id bigint NOT NULL PRIMARY KEY,
        attempt int NOT NULL,
        max_attempts int NOT NULL,
        cancel_requested bit NOT NULL,
        backoff_base_seconds float NOT NULL,
        backoff_max_seconds float NOT NULL,
        backoff_schedule nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        wait_seconds float NULL
    );
    DECLARE @v_u TABLE (
        id bigint NOT NULL PRIMARY KEY,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        attempt int NOT NULL,
        claimed_at datetimeoffset(6) NULL,
        held_by uniqueidentifier NULL,
        reason nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
    );
    DECLARE @v_keys TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        INSERT INTO @v_expired (
            id, attempt, max_attempts, cancel_requested, backoff_base_seconds, backoff_max_seconds,
            backoff_schedule)
        SELECT TOP (@p_limit) d.id, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds,
               d.backoff_max_seconds, d.backoff_schedule
        FROM workqueue.delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
        WHERE d.status = N'InFlight' AND d.lease_expires_at < @v_now
        ORDER BY d.lease_expires_at;

        IF @@ROWCOUNT > 0
        BEGIN
            -- The backoff of the deliveries that go back to Pending, drawn once per delivery.
            UPDATE @v_expired
            SET wait_seconds = workqueue.backoff_seconds(
                attempt, backoff_base_seconds, backoff_max_seconds, backoff_schedule, NULL)
            WHERE cancel_requested = 0 AND attempt < max_attempts;

            UPDATE d
            SET status = CASE WHEN d.cancel_requested = 1 THEN N'Discarded'
                              WHEN d.attempt >= d.max_attempts THEN N'DeadLettered'
                              ELSE N'Pending' END,
                visible_at = CASE
                    WHEN d.cancel_requested = 1 OR d.attempt >= d.max_attempts THEN d.visible_at
                    ELSE DATEADD(
                        microsecond, CAST((e.wait_seconds - FLOOR(e.wait_seconds)) * 1000000 AS int),
                        DATEADD(second, CAST(FLOOR(e.wait_seconds) AS int), @v_now))
                END,
                reason = CASE WHEN d.cancel_requested = 1 THEN d.reason
                              WHEN d.attempt >= d.max_attempts THEN N'lease expired on the final attempt'
                              ELSE N'lease expired' END,
                last_error = CASE WHEN d.cancel_requested = 1 THEN d.last_error
                                  ELSE N'lease expired: the holder stopped renewing it' END,
                lease_token = NULL,
                lease_expires_at = NULL,
                settled_at = CASE WHEN d.cancel_requested = 1 OR d.attempt >= d.max_attempts THEN @v_now END
            OUTPUT inserted.id, inserted.status, inserted.key_mode, inserted.subscription_id, inserted.partition_key,
                   inserted.attempt, inserted.claimed_at, inserted.held_by, inserted.reason
            INTO @v_u (id, status, key_mode, subscription_id, partition_key, attempt, claimed_at, held_by, reason)
            FROM workqueue.delivery AS d
            INNER JOIN @v_expired AS e ON e.id = d.id;

            INSERT INTO workqueue.delivery_attempt (delivery_id, attempt, started_at, ended_at, held_by, outcome,
                                                    reason, error)
            SELECT u.id, u.attempt, u.claimed_at, @v_now, u.held_by, N'LeaseExpired', u.reason,
                   N'lease expired: the holder stopped renewing it'
            FROM @v_u AS u;
            -- Keep the newest 50 attempts of each delivery.
            DELETE a
            FROM workqueue.delivery_attempt AS a
            WHERE a.delivery_id IN (SELECT u.id FROM @v_u AS u)
              AND a.id <= (SELECT b.id FROM workqueue.delivery_attempt AS b WHERE b.delivery_id = a.delivery_id
                           ORDER BY b.id DESC OFFSET 50 ROWS FETCH NEXT 1 ROWS ONLY);

            INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
            SELECT u.subscription_id, 0, COUNT_BIG(*)
            FROM @v_u AS u
            WHERE u.status = N'Discarded'
            GROUP BY u.subscription_id;

            INSERT INTO @v_keys (subscription_id, partition_key, key_mode)
            SELECT DISTINCT u.subscription_id, u.partition_key, u.key_mode
            FROM @v_u AS u
            WHERE u.key_mode > 0
            ORDER BY u.subscription_id, u.partition_key;
            SET @v_k_count = @@ROWCOUNT;
            SET @v_k = 1;
            WHILE @v_k <= @v_k_count
            BEGIN
                SELECT @v_key_subscription = k.subscription_id, @v_key = k.partition_key, @v_key_mode = k.key_mode
                FROM @v_keys AS k
                WHERE k.ord = @v_k;
                -- A key another transaction holds (a producer) is marked stale instead of waited for,
                -- as release_keys does; a key without a row is re-derived (refresh_partition creates
                -- its row). (PostgreSQL notifies when the key became claimable; consumers poll here.)
                SET @v_key_found = 0;
                SELECT @v_key_found = 1, @v_key_holder = p.holder_id
                FROM workqueue.partition AS p WITH (UPDLOCK, READPAST, ROWLOCK)
                WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key;
                IF @v_key_found = 1 OR NOT EXISTS (
                    SELECT 1 FROM workqueue.partition AS p
                    WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key
                )
                    EXEC workqueue.refresh_partition
                        @p_subscription_id = @v_key_subscription, @p_key = @v_key, @p_mode = @v_key_mode;
                ELSE
                BEGIN
                    -- Reading key_mode locks an existing marker's row (see release_keys).
                    SET @v_key_found = 0;
                    SELECT @v_key_found = 1, @v_key_holder = ps.key_mode
                    FROM workqueue.partition_stale AS ps WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                    WHERE ps.subscription_id = @v_key_subscription AND ps.partition_key = @v_key;
                    IF @v_key_found = 0
                        INSERT INTO workqueue.partition_stale (subscription_id, partition_key, key_mode)
                        VALUES (@v_key_subscription, @v_key, @v_key_mode);
                END;
                SET @v_k = @v_k + 1;
            END;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT u.id AS delivery_id, u.status AS result
    FROM @v_u AS u
    ORDER BY u.id;
END;
GO

-- Terminal deliveries past their subscription's retention, then messages that no delivery
-- references any more (kept as long as the longest retention of their topic, for duplicate
-- detection), then expired deduplication keys (READPAST: a producer taking an expired key over
-- holds its row until it commits). Pending, InFlight and DeadLettered are never
-- purged.
-- returns: purged_deliveries, purged_messages, purged_deduplication
CREATE OR ALTER PROCEDURE workqueue.purge
    @p_limit int,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    DECLARE @v_deliveries int = 0;
    DECLARE @v_messages int = 0;
    DECLARE @v_dedup int = 0;
    DECLARE @v_seconds float;
    DECLARE @v_settled_before datetimeoffset(6);
    DECLARE @v_published_before datetimeoffset(6);
    DECLARE @v_gone TABLE (
        subscription_id int NOT NULL,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- None settled after now minus the shortest retention of any subscription can go yet.
        SELECT @v_seconds = MIN(s.retention_seconds) FROM workqueue.subscription AS s;
        IF @v_seconds IS NOT NULL
        BEGIN
            SET @v_settled_before = DATEADD(
                microsecond, -CAST((@v_seconds - FLOOR(@v_seconds)) * 1000000 AS int),
                DATEADD(second, -CAST(FLOOR(@v_seconds) AS int), @v_now));
            DELETE FROM workqueue.delivery
            OUTPUT deleted.subscription_id, deleted.status INTO @v_gone (subscription_id, status)
            WHERE id IN (
                SELECT TOP (@p_limit) x.id
                FROM workqueue.delivery AS x
                INNER JOIN workqueue.subscription AS s ON s.id = x.subscription_id
                WHERE x.status IN (N'Completed', N'Discarded')
                  AND x.settled_at < @v_settled_before
                  AND x.settled_at < DATEADD(
                      microsecond, -CAST((s.retention_seconds - FLOOR(s.retention_seconds)) * 1000000 AS int),
                      DATEADD(second, -CAST(FLOOR(s.retention_seconds) AS int), @v_now))
                ORDER BY x.settled_at
            );
            SET @v_deliveries = @@ROWCOUNT;
            INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
            SELECT g.subscription_id, -SUM(CASE WHEN g.status = N'Completed' THEN CAST(1 AS bigint) ELSE 0 END),
                   -SUM(CASE WHEN g.status = N'Discarded' THEN CAST(1 AS bigint) ELSE 0 END)
            FROM @v_gone AS g
            GROUP BY g.subscription_id;
        END;

        -- None published after now minus the shortest topic retention (a week at the most) can.
        SELECT @v_seconds = MIN(r.seconds)
        FROM (SELECT MAX(s.retention_seconds) AS seconds FROM workqueue.subscription AS s GROUP BY s.topic) AS r;
        IF @v_seconds IS NULL OR @v_seconds > 604800
            SET @v_seconds = 604800;
        SET @v_published_before = DATEADD(
            microsecond, -CAST((@v_seconds - FLOOR(@v_seconds)) * 1000000 AS int),
            DATEADD(second, -CAST(FLOOR(@v_seconds) AS int), @v_now));

        DELETE FROM workqueue.message
        WHERE id IN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.message AS x
            CROSS APPLY (
                SELECT COALESCE(MAX(s.retention_seconds), 604800) AS seconds
                FROM workqueue.subscription AS s
                WHERE s.topic = x.topic
            ) AS r
            WHERE x.published_at < @v_published_before
              AND x.published_at < DATEADD(
                      microsecond, -CAST((r.seconds - FLOOR(r.seconds)) * 1000000 AS int),
                      DATEADD(second, -CAST(FLOOR(r.seconds) AS int), @v_now))
              AND NOT EXISTS (SELECT 1 FROM workqueue.delivery AS d WHERE d.message_id = x.id)
            ORDER BY x.published_at
        );
        SET @v_messages = @@ROWCOUNT;

        WITH expired AS (
            SELECT TOP (@p_limit) dd.topic, dd.deduplication_key
            FROM workqueue.deduplication AS dd WITH (UPDLOCK, READPAST, ROWLOCK)
            WHERE dd.expires_at <= @v_now
            ORDER BY dd.expires_at
        )
        DELETE FROM expired;
        SET @v_dedup = @@ROWCOUNT;

        -- Token buckets that are full again (idle for as long as an empty one takes to fill), or
        -- whose subscription has no such rate limit any more.
        -- (An empty bucket fills in burst / rate: one second, or 1 / rate below one a second.)
        DELETE TOP (@p_limit) b
        FROM workqueue.rate_bucket AS b WITH (UPDLOCK, READPAST, ROWLOCK)
        LEFT JOIN workqueue.subscription AS s ON s.id = b.subscription_id
        CROSS APPLY (SELECT workqueue.rate_per_second(
                         CASE WHEN b.per_key = 1 THEN s.key_rate_limit ELSE s.rate_limit END) AS rate) AS r
        WHERE r.rate IS NULL
           OR DATEADD(millisecond, CAST(1000.0 * (CASE WHEN r.rate > 1 THEN r.rate ELSE 1 END) / r.rate AS int),
                      b.updated_at) <= @v_now;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_deliveries AS purged_deliveries, @v_messages AS purged_messages,
           @v_dedup AS purged_deduplication;
END;
GO

-- Replaces the rows of each subscription that has more than one by their sum (dropping sums of
-- zero). Rows another transaction is still appending are skipped (READPAST) and stay for the next
-- fold. PostgreSQL returns void: no result set here.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.fold_settled_counts
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_folded TABLE (
        subscription_id int NOT NULL,
        completed bigint NOT NULL,
        discarded bigint NOT NULL
    );
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        DELETE c
        OUTPUT deleted.subscription_id, deleted.completed, deleted.discarded
        INTO @v_folded (subscription_id, completed, discarded)
        FROM workqueue.settled_count AS c WITH (READPAST)
        WHERE c.subscription_id IN (
            SELECT x.subscription_id FROM workqueue.settled_count AS x
            GROUP BY x.subscription_id
            HAVING COUNT(*) > 1 OR (SUM(x.completed) = 0 AND SUM(x.discarded) = 0)
        );
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT f.subscription_id, SUM(f.completed), SUM(f.discarded)
        FROM @v_folded AS f
        GROUP BY f.subscription_id
        HAVING SUM(f.completed) <> 0 OR SUM(f.discarded) <> 0;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

-- One sweeper pass. A transaction-owned application lock lets only one pass run at a time across
-- every process; a pass that finds the lock taken returns ran = 0 and does nothing. The lock is
-- released when the pass's transaction ends (PostgreSQL: pg_try_advisory_xact_lock). Expiry and
-- purge run as the procedures above (their one result set each is read with INSERT ... EXEC),
-- then the keys left stale are re-derived, settled_count is folded and
-- expired once markers are dropped (not counted).
-- returns: ran, retried, dead_lettered, discarded, purged_deliveries, purged_messages, purged_deduplication, taken_back
CREATE OR ALTER PROCEDURE workqueue.sweep
    @p_limit int = 1000,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6);
    DECLARE @v_lock int;
    DECLARE @v_ran bit = 0;
    DECLARE @v_retried int = 0;
    DECLARE @v_dead int = 0;
    DECLARE @v_discarded int = 0;
    DECLARE @v_purged_deliveries int = 0;
    DECLARE @v_purged_messages int = 0;
    DECLARE @v_purged_deduplication int = 0;
    DECLARE @v_taken_back nvarchar(max) = N'[]';
    DECLARE @v_expired TABLE (
        delivery_id bigint NOT NULL,
        result nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
    );
    DECLARE @v_purged TABLE (
        purged_deliveries int NOT NULL,
        purged_messages int NOT NULL,
        purged_deduplication int NOT NULL
    );

    -- @p_now, a test's clock, is the database owner's only: the runtime and operator roles run
    -- sweeps, and a clock of their choosing would take back leases that have time left.
    IF @p_now IS NOT NULL AND IS_MEMBER(N'db_owner') = 0 AND IS_SRVROLEMEMBER(N'sysadmin') = 0
        THROW 51040, N'@p_now (a test''s clock) is given only by the owner of the database; call sweep without it', 1;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        EXEC @v_lock = sp_getapplock
            @Resource = N'workqueue.sweep',
            @LockMode = N'Exclusive',
            @LockOwner = N'Transaction',
            @LockTimeout = 0;

        IF @v_lock >= 0
        BEGIN
            SET @v_ran = 1;
            INSERT INTO @v_expired (delivery_id, result)
            EXEC workqueue.expire_leases @p_limit = @p_limit, @p_now = @p_now;
            SELECT @v_retried = COALESCE(SUM(CASE WHEN e.result = N'Pending' THEN 1 ELSE 0 END), 0),
                   @v_dead = COALESCE(SUM(CASE WHEN e.result = N'DeadLettered' THEN 1 ELSE 0 END), 0),
                   @v_discarded = COALESCE(SUM(CASE WHEN e.result = N'Discarded' THEN 1 ELSE 0 END), 0)
            FROM @v_expired AS e;
            -- Each lease taken back, with its subscription and the process that held it (for the log).
            SET @v_taken_back = COALESCE((
                SELECT e.delivery_id, s.name AS subscription, e.result, d.attempt, d.held_by AS holder_id,
                       p.hostname AS holder_host, p.pid AS holder_pid
                FROM @v_expired AS e
                INNER JOIN workqueue.delivery AS d ON d.id = e.delivery_id
                INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
                LEFT JOIN workqueue.process AS p ON p.id = d.held_by
                ORDER BY e.delivery_id
                FOR JSON PATH, INCLUDE_NULL_VALUES), N'[]');

            -- Keys left stale by settles and by the expiry above, where nobody holds them now.
            EXEC workqueue.rederive_stale @p_subscription_ids = NULL, @p_limit = @p_limit;

            INSERT INTO @v_purged (purged_deliveries, purged_messages, purged_deduplication)
            EXEC workqueue.purge @p_limit = @p_limit, @p_now = @p_now;
            SELECT @v_purged_deliveries = p.purged_deliveries, @v_purged_messages = p.purged_messages,
                   @v_purged_deduplication = p.purged_deduplication
            FROM @v_purged AS p;

            EXEC workqueue.fold_settled_counts;

            SET @v_now = COALESCE(@p_now, SYSDATETIMEOFFSET());
            WITH expired AS (
                SELECT TOP (@p_limit) o.[key]
                FROM workqueue.once_marker AS o WITH (UPDLOCK, READPAST, ROWLOCK)
                WHERE o.expires_at <= @v_now
                ORDER BY o.expires_at
            )
            DELETE FROM expired;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_ran AS ran, @v_retried AS retried, @v_dead AS dead_lettered, @v_discarded AS discarded,
           @v_purged_deliveries AS purged_deliveries, @v_purged_messages AS purged_messages,
           @v_purged_deduplication AS purged_deduplication, @v_taken_back AS taken_back;
END;
GO

-- Purges terminal deliveries (Completed, Discarded) settled more than @p_older_than_seconds ago,
-- whatever their subscription's retention, in batches; returns how many it removed. Used by
-- `workqueue prune`; the sweeper keeps applying each subscription's retention by itself. What it
-- removes is counted out of settled_count, whose rows it then folds (as the sweeper does).
-- returns: prune
CREATE OR ALTER PROCEDURE workqueue.prune
    @p_older_than_seconds float,
    @p_limit int,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    DECLARE @v_cutoff datetimeoffset(6);
    DECLARE @v_count int = 0;
    DECLARE @v_gone TABLE (
        subscription_id int NOT NULL,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
    );
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SET @v_cutoff = DATEADD(
            microsecond, -CAST((@p_older_than_seconds - FLOOR(@p_older_than_seconds)) * 1000000 AS int),
            DATEADD(second, -CAST(FLOOR(@p_older_than_seconds) AS int), @v_now));
        DELETE FROM workqueue.delivery
        OUTPUT deleted.subscription_id, deleted.status INTO @v_gone (subscription_id, status)
        WHERE id IN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.delivery AS x
            WHERE x.status IN (N'Completed', N'Discarded') AND x.settled_at < @v_cutoff
            ORDER BY x.settled_at
        );
        SET @v_count = @@ROWCOUNT;
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT g.subscription_id, -SUM(CASE WHEN g.status = N'Completed' THEN CAST(1 AS bigint) ELSE 0 END),
               -SUM(CASE WHEN g.status = N'Discarded' THEN CAST(1 AS bigint) ELSE 0 END)
        FROM @v_gone AS g
        GROUP BY g.subscription_id;
        EXEC workqueue.fold_settled_counts;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_count AS prune;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Once markers
-- ---------------------------------------------------------------------------------------------

-- ---------------------------------------------------------------------------------------------
-- Once markers: context.once(key, fn) runs fn unless it already succeeded for the key
-- ---------------------------------------------------------------------------------------------

-- Run: the caller holds the key for @p_running_seconds and must finish or abort it. Done: it ran
-- already (within its TTL). Busy: another attempt is running it now. A key is at most 850
-- characters here (the width of the primary key); a longer one is refused with error 51003.
-- returns: state, token
CREATE OR ALTER PROCEDURE workqueue.once_begin
    @p_key nvarchar(max),
    @p_running_seconds float
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_token uniqueidentifier = NEWID();
    DECLARE @v_key nvarchar(850);
    DECLARE @v_found bit = 0;
    DECLARE @v_state nvarchar(20);
    DECLARE @v_expires_at datetimeoffset(6);
    DECLARE @v_running_until datetimeoffset(6);
    DECLARE @v_result_state nvarchar(20);
    DECLARE @v_result_token uniqueidentifier;

    BEGIN TRY
        IF DATALENGTH(@p_key) > 1700
            THROW 51003, N'a once key is at most 850 characters on SQL Server; use a shorter key (for example a hash of it)', 1;
        SET @v_key = @p_key;
        SET @v_running_until = DATEADD(
            microsecond, CAST((@p_running_seconds - FLOOR(@p_running_seconds)) * 1000000 AS int),
            DATEADD(second, CAST(FLOOR(@p_running_seconds) AS int), @v_now));
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        SELECT @v_found = 1, @v_state = o.state, @v_expires_at = o.expires_at
        FROM workqueue.once_marker AS o WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
        WHERE o.[key] = @v_key;

        IF @v_found = 0
        BEGIN
            INSERT INTO workqueue.once_marker ([key], state, token, expires_at)
            VALUES (@v_key, N'Running', @v_token, @v_running_until);
            SET @v_result_state = N'Run';
            SET @v_result_token = @v_token;
        END
        ELSE IF @v_expires_at <= @v_now
        BEGIN
            -- The marker expired (a Done TTL ran out, or a holder died while running): take it.
            UPDATE workqueue.once_marker
            SET state = N'Running', token = @v_token, expires_at = @v_running_until
            WHERE [key] = @v_key;
            SET @v_result_state = N'Run';
            SET @v_result_token = @v_token;
        END
        ELSE
            SET @v_result_state = CASE WHEN @v_state = N'Done' COLLATE Latin1_General_100_BIN2 THEN N'Done'
                                       ELSE N'Busy' END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_result_state AS state, @v_result_token AS token;
END;
GO

-- returns: once_finish
CREATE OR ALTER PROCEDURE workqueue.once_finish
    @p_key nvarchar(max),
    @p_token uniqueidentifier,
    @p_ttl_seconds float
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_done bit = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF DATALENGTH(@p_key) <= 1700
        BEGIN
            UPDATE workqueue.once_marker
            SET state = N'Done', token = NULL,
                expires_at = DATEADD(
                    microsecond, CAST((@p_ttl_seconds - FLOOR(@p_ttl_seconds)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(@p_ttl_seconds) AS int), @v_now))
            WHERE [key] = CAST(@p_key AS nvarchar(850)) AND token = @p_token;
            IF @@ROWCOUNT > 0
                SET @v_done = 1;
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_done AS once_finish;
END;
GO

-- returns: once_abort
CREATE OR ALTER PROCEDURE workqueue.once_abort
    @p_key nvarchar(max),
    @p_token uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_aborted bit = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF DATALENGTH(@p_key) <= 1700
        BEGIN
            DELETE FROM workqueue.once_marker
            WHERE [key] = CAST(@p_key AS nvarchar(850)) AND token = @p_token;
            IF @@ROWCOUNT > 0
                SET @v_aborted = 1;
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_aborted AS once_abort;
END;
GO

-- Keeps a Running key held for @p_running_seconds more while the caller's token holds it (an
-- overlap lock renewed while its attempt runs); 0 once the token no longer holds it.
-- returns: once_renew
CREATE OR ALTER PROCEDURE workqueue.once_renew
    @p_key nvarchar(max),
    @p_token uniqueidentifier,
    @p_running_seconds float
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_renewed bit = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF DATALENGTH(@p_key) <= 1700
        BEGIN
            UPDATE workqueue.once_marker
            SET expires_at = DATEADD(
                    microsecond, CAST((@p_running_seconds - FLOOR(@p_running_seconds)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(@p_running_seconds) AS int), @v_now))
            WHERE [key] = CAST(@p_key AS nvarchar(850)) AND token = @p_token
              AND state = N'Running';
            IF @@ROWCOUNT > 0
                SET @v_renewed = 1;
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_renewed AS once_renew;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Deduplication keys and step results: a unique job frees its key, a job's durable steps
-- ---------------------------------------------------------------------------------------------

-- Frees a topic's deduplication key if the given message holds it; 1 when it held it live (a key
-- of that message that had expired already goes too, and answers 0).
-- returns: release_deduplication_key
CREATE OR ALTER PROCEDURE workqueue.release_deduplication_key
    @p_topic nvarchar(200),
    @p_key nvarchar(max),
    @p_message_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_gone TABLE (expires_at datetimeoffset(6) NOT NULL);
    BEGIN TRY
        DELETE FROM workqueue.deduplication
        OUTPUT deleted.expires_at INTO @v_gone (expires_at)
        WHERE topic = @p_topic AND deduplication_key = @p_key AND message_id = @p_message_id;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
    SELECT CAST(CASE WHEN EXISTS (SELECT 1 FROM @v_gone AS g WHERE g.expires_at > @v_now) THEN 1 ELSE 0 END AS bit)
        AS release_deduplication_key;
END;
GO

-- The stored result of one step (no row when none is stored).
-- returns: value
CREATE OR ALTER PROCEDURE workqueue.step_get
    @p_message_id uniqueidentifier,
    @p_name nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SELECT r.value
    FROM workqueue.step_result AS r
    WHERE r.message_id = @p_message_id AND r.name = @p_name;
END;
GO

-- Stores the result of one step; the first write wins (a second put keeps the first value). The
-- message must be stored (THROW 51006); a step name is at most 400 characters (THROW 51007).
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.step_put
    @p_message_id uniqueidentifier,
    @p_name nvarchar(max),
    @p_value nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_message nvarchar(2048);
    BEGIN TRY
        IF DATALENGTH(@p_name) > 800
            THROW 51007, N'a step name is at most 400 characters on SQL Server; use a shorter name', 1;
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF NOT EXISTS (SELECT 1 FROM workqueue.message AS m WHERE m.id = @p_message_id)
        BEGIN
            SET @v_message = CONCAT(
                N'message ', LOWER(CAST(@p_message_id AS nvarchar(36))),
                N' is not stored (never published, or purged): a step result belongs to a stored message');
            THROW 51006, @v_message, 1;
        END;
        INSERT INTO workqueue.step_result (message_id, name, value)
        SELECT @p_message_id, @p_name, @p_value
        WHERE NOT EXISTS (
            SELECT 1 FROM workqueue.step_result AS r WITH (UPDLOCK, HOLDLOCK)
            WHERE r.message_id = @p_message_id AND r.name = @p_name
        );
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Results: what a completed message's work returned (a job's stored result)
-- ---------------------------------------------------------------------------------------------

-- Keeps the result of the delivery's message, in the transaction of the settle that completed it
-- (the transport's settle_with_follow_ups); a later completion's result replaces it.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.result_put
    @p_delivery_id bigint,
    @p_value nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_message_id uniqueidentifier;
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SELECT @v_message_id = d.message_id FROM workqueue.delivery AS d WHERE d.id = @p_delivery_id;
        IF @v_message_id IS NOT NULL
        BEGIN
            UPDATE workqueue.message_result WITH (UPDLOCK, HOLDLOCK)
            SET value = @p_value, stored_at = SYSDATETIMEOFFSET()
            WHERE message_id = @v_message_id;
            IF @@ROWCOUNT = 0
                INSERT INTO workqueue.message_result (message_id, value) VALUES (@v_message_id, @p_value);
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

-- The stored result of a message (no row when none is stored).
-- returns: value, stored_at
CREATE OR ALTER PROCEDURE workqueue.result_get
    @p_message_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SELECT r.value, r.stored_at
    FROM workqueue.message_result AS r
    WHERE r.message_id = @p_message_id;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Debounce: one pending message per key, its payload and due time replaced by each publish
-- ---------------------------------------------------------------------------------------------

-- The message that holds the topic's deduplication key takes the payload and comes due
-- @p_seconds from now while it still waits out its window (every delivery Pending, unkeyed, never
-- claimed, not yet due), and the key lives as long; answered with its MessageID. Otherwise the key
-- is freed and no row is answered: the caller publishes a new message (PostgreSQL's says more).
-- returns: message_id
CREATE OR ALTER PROCEDURE workqueue.debounce
    @p_topic nvarchar(200),
    @p_key nvarchar(max),
    @p_payload nvarchar(max),
    @p_content_hash nvarchar(128),
    @p_envelope_bytes int,
    @p_seconds float,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    DECLARE @v_due datetimeoffset(6) = DATEADD(
        microsecond, CAST((@p_seconds - FLOOR(@p_seconds)) * 1000000 AS int),
        DATEADD(second, CAST(FLOOR(@p_seconds) AS int), @v_now));
    DECLARE @v_message_id uniqueidentifier;
    DECLARE @v_cap int;
    DECLARE @v_replaced bit = 0;
    DECLARE @v_message nvarchar(2048);
    DECLARE @v_deliveries TABLE (waiting bit NOT NULL);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SELECT @v_message_id = dd.message_id
        FROM workqueue.deduplication AS dd WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
        WHERE dd.topic = @p_topic AND dd.deduplication_key = @p_key;
        IF @v_message_id IS NOT NULL
        BEGIN
            INSERT INTO @v_deliveries (waiting)
            SELECT CASE WHEN d.status = N'Pending' AND d.key_mode = 0 AND d.claimed_at IS NULL
                             AND d.visible_at > @v_now THEN 1 ELSE 0 END
            FROM workqueue.delivery AS d WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
            WHERE d.message_id = @v_message_id;
            IF EXISTS (SELECT 1 FROM @v_deliveries)
               AND NOT EXISTS (SELECT 1 FROM @v_deliveries AS x WHERE x.waiting = 0)
            BEGIN
                SELECT @v_cap = t.max_payload_bytes FROM workqueue.topic AS t WHERE t.name = @p_topic;
                IF @v_cap IS NOT NULL AND @p_envelope_bytes > @v_cap
                BEGIN
                    SET @v_message = CONCAT(
                        N'the debounced envelope is ', @p_envelope_bytes, N' bytes; topic ''', @p_topic,
                        N''' accepts at most ', @v_cap, N' bytes (max_payload_bytes)');
                    THROW 51008, @v_message, 1;
                END;
                UPDATE workqueue.message SET payload = @p_payload, content_hash = @p_content_hash
                WHERE id = @v_message_id;
                UPDATE workqueue.delivery SET visible_at = @v_due WHERE message_id = @v_message_id;
                UPDATE workqueue.deduplication SET expires_at = @v_due
                WHERE topic = @p_topic AND deduplication_key = @p_key;
                SET @v_replaced = 1;
            END
            ELSE
                DELETE FROM workqueue.deduplication WHERE topic = @p_topic AND deduplication_key = @p_key;
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_message_id AS message_id WHERE @v_replaced = 1;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Groups (fan-in): a message held until its members end
-- ---------------------------------------------------------------------------------------------

-- Makes a group's held message due at @p_at (its Pending, unkeyed deliveries). SQL Server has no
-- wake-ups: its consumers find the message on their next poll.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.release_group_message
    @p_message_id uniqueidentifier,
    @p_at datetimeoffset(6)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    BEGIN TRY
        UPDATE workqueue.delivery SET visible_at = @p_at
        WHERE message_id = @p_message_id AND status = N'Pending' AND key_mode = 0;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO

-- What happens when deliveries end (Completed, DeadLettered or Discarded), whichever procedure ends
-- them: a group member's first end counts its group down under the group's row lock, and the end
-- that counts it to 0 makes the group's held message due. A statement that changes no status, or
-- no group member's, returns at once.
CREATE OR ALTER TRIGGER workqueue.delivery_ended ON workqueue.delivery
AFTER UPDATE
AS
BEGIN
    SET NOCOUNT ON;
    IF NOT UPDATE(status)
        RETURN;
    DECLARE @v_ended TABLE (
        group_id uniqueidentifier NOT NULL, message_id uniqueidentifier NOT NULL, ended_at datetimeoffset(6) NOT NULL
    );
    DECLARE @v_counted TABLE (group_id uniqueidentifier NOT NULL, ended_at datetimeoffset(6) NOT NULL);
    DECLARE @v_released TABLE (then_message_id uniqueidentifier NOT NULL, released_at datetimeoffset(6) NOT NULL);
    DECLARE @v_then uniqueidentifier;
    DECLARE @v_at datetimeoffset(6);

    INSERT INTO @v_ended (group_id, message_id, ended_at)
    SELECT i.group_id, i.message_id, COALESCE(i.settled_at, SYSDATETIMEOFFSET())
    FROM inserted AS i
    INNER JOIN deleted AS o ON o.id = i.id
    WHERE i.group_id IS NOT NULL AND i.status IN (N'Completed', N'DeadLettered', N'Discarded')
      AND o.status <> i.status;
    IF NOT EXISTS (SELECT 1 FROM @v_ended)
        RETURN;

    UPDATE mm SET ended_at = e.ended_at
    OUTPUT inserted.group_id, inserted.ended_at INTO @v_counted (group_id, ended_at)
    FROM workqueue.message_group_member AS mm WITH (UPDLOCK, ROWLOCK)
    INNER JOIN @v_ended AS e ON e.group_id = mm.group_id AND e.message_id = mm.message_id
    WHERE mm.ended_at IS NULL;

    UPDATE g SET remaining = g.remaining - c.n,
                 released_at = CASE WHEN g.remaining = c.n THEN c.at END
    OUTPUT inserted.then_message_id, inserted.released_at INTO @v_released (then_message_id, released_at)
    FROM workqueue.message_group AS g WITH (UPDLOCK, ROWLOCK)
    INNER JOIN (
        SELECT x.group_id, COUNT(*) AS n, MAX(x.ended_at) AS at FROM @v_counted AS x GROUP BY x.group_id
    ) AS c ON c.group_id = g.id;

    DECLARE released CURSOR LOCAL FAST_FORWARD FOR
        SELECT r.then_message_id, r.released_at FROM @v_released AS r WHERE r.released_at IS NOT NULL;
    OPEN released;
    FETCH NEXT FROM released INTO @v_then, @v_at;
    WHILE @@FETCH_STATUS = 0
    BEGIN
        EXEC workqueue.release_group_message @p_message_id = @v_then, @p_at = @v_at;
        FETCH NEXT FROM released INTO @v_then, @v_at;
    END;
    CLOSE released;
    DEALLOCATE released;
END;
GO

-- Makes @p_members (a JSON array of MessageIDs, in order) a group whose end releases @p_then, all
-- published in the caller's transaction (@p_then held: visible at 9999-12-31). A member that has
-- ended already, or has no delivery, counts as ended; when every member has, @p_then is due now.
-- returns: remaining
CREATE OR ALTER PROCEDURE workqueue.group_create
    @p_group uniqueidentifier,
    @p_members nvarchar(max),
    @p_then uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_remaining int;
    DECLARE @v_members TABLE (message_id uniqueidentifier NOT NULL PRIMARY KEY, ordinal int NOT NULL);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        INSERT INTO @v_members (message_id, ordinal)
        SELECT CAST(j.value AS uniqueidentifier), CAST(j.[key] AS int) + 1 FROM OPENJSON(@p_members) AS j;
        INSERT INTO workqueue.message_group (id, then_message_id, members, remaining)
        SELECT @p_group, @p_then, COUNT(*), 0 FROM @v_members;
        INSERT INTO workqueue.message_group_member (group_id, message_id, ordinal)
        SELECT @p_group, v.message_id, v.ordinal FROM @v_members AS v;
        UPDATE d SET group_id = @p_group
        FROM workqueue.delivery AS d WITH (UPDLOCK, ROWLOCK)
        INNER JOIN @v_members AS v ON v.message_id = d.message_id;
        UPDATE mm SET ended_at = @v_now
        FROM workqueue.message_group_member AS mm
        WHERE mm.group_id = @p_group AND NOT EXISTS (
            SELECT 1 FROM workqueue.delivery AS d
            WHERE d.message_id = mm.message_id AND d.status IN (N'Pending', N'InFlight'));
        SELECT @v_remaining = COUNT(*) FROM workqueue.message_group_member AS mm
        WHERE mm.group_id = @p_group AND mm.ended_at IS NULL;
        UPDATE workqueue.message_group
        SET remaining = @v_remaining, released_at = CASE WHEN @v_remaining = 0 THEN @v_now END
        WHERE id = @p_group;
        IF @v_remaining = 0
            EXEC workqueue.release_group_message @p_message_id = @p_then, @p_at = @v_now;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_remaining AS remaining;
END;
GO

-- The members of a group, in order, each with its first delivery and its stored result.
-- returns: ordinal, message_id, ended_at, delivery_id, subscription, status, attempt, max_attempts, visible_at, reason, last_error, created_at, claimed_at, settled_at, attributes, result
CREATE OR ALTER PROCEDURE workqueue.group_members
    @p_group uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SELECT mm.ordinal, mm.message_id, mm.ended_at, d.id AS delivery_id, s.name AS subscription, d.status,
           d.attempt, d.max_attempts, d.visible_at, d.reason, d.last_error, d.created_at, d.claimed_at,
           d.settled_at, m.attributes, r.value AS result
    FROM workqueue.message_group_member AS mm
    OUTER APPLY (
        SELECT TOP (1) x.id, x.subscription_id, x.status, x.attempt, x.max_attempts, x.visible_at, x.reason,
               x.last_error, x.created_at, x.claimed_at, x.settled_at
        FROM workqueue.delivery AS x WHERE x.message_id = mm.message_id ORDER BY x.id
    ) AS d
    LEFT JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    LEFT JOIN workqueue.message AS m ON m.id = mm.message_id
    LEFT JOIN workqueue.message_result AS r ON r.message_id = mm.message_id
    WHERE mm.group_id = @p_group
    ORDER BY mm.ordinal;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Operator actions
-- ---------------------------------------------------------------------------------------------

-- DeadLettered -> Pending with the same MessageID and the same place in its Ordered key,
-- attempts reset, the operator's note kept.
-- returns: result, delivery_status
CREATE OR ALTER PROCEDURE workqueue.replay
    @p_subscription nvarchar(200),
    @p_delivery_id bigint,
    @p_note nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_found bit = 0;
    DECLARE @v_key_mode smallint;
    DECLARE @v_subscription_id int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_found bit = 0;
    DECLARE @v_key_holder bigint;
    DECLARE @v_result nvarchar(20) = N'NotFound';
    DECLARE @v_status nvarchar(20);
    DECLARE @v_attempt int;

    SELECT @v_found = 1, @v_key_mode = d.key_mode, @v_subscription_id = d.subscription_id,
           @v_key = d.partition_key, @v_attempt = d.attempt
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    WHERE d.id = @p_delivery_id AND s.name = @p_subscription;

    BEGIN TRY
        IF @v_found = 1
        BEGIN
            IF @v_own_transaction = 1
                BEGIN TRANSACTION;
            IF @v_key_mode > 0
            BEGIN
                -- The key's row first (lock order), created where needed.
                SELECT @v_key_found = 1, @v_key_holder = p.holder_id
                FROM workqueue.partition AS p WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                WHERE p.subscription_id = @v_subscription_id AND p.partition_key = @v_key;
                IF @v_key_found = 0
                    INSERT INTO workqueue.partition (subscription_id, partition_key)
                    VALUES (@v_subscription_id, @v_key);
            END;

            UPDATE workqueue.delivery
            SET status = N'Pending', attempt = 0, visible_at = @v_now, note = @p_note, reason = NULL,
                settled_at = NULL, cancel_requested = 0
            WHERE id = @p_delivery_id AND status = N'DeadLettered';

            IF @@ROWCOUNT = 0
            BEGIN
                IF @v_key_mode > 0
                    EXEC workqueue.refresh_partition
                        @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_key_mode;
                SELECT @v_status = d.status FROM workqueue.delivery AS d WHERE d.id = @p_delivery_id;
                SET @v_result = N'NotDeadLettered';
            END
            ELSE
            BEGIN
                -- (PostgreSQL notifies when the delivery is claimable now; consumers poll here.)
                IF @v_key_mode > 0
                    EXEC workqueue.refresh_partition
                        @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_key_mode;
                -- The replay is kept as an attempt of its own, so the error before it reads as a
                -- past attempt.
                INSERT INTO workqueue.delivery_attempt (delivery_id, attempt, ended_at, outcome, reason)
                VALUES (@p_delivery_id, @v_attempt, @v_now, N'Replayed', @p_note);
                -- Keep the newest 50 attempts of each delivery.
                DELETE a
                FROM workqueue.delivery_attempt AS a
                WHERE a.delivery_id IN (@p_delivery_id)
                  AND a.id <= (SELECT b.id FROM workqueue.delivery_attempt AS b WHERE b.delivery_id = a.delivery_id
                               ORDER BY b.id DESC OFFSET 50 ROWS FETCH NEXT 1 ROWS ONLY);
                SET @v_result = N'Replayed';
                SET @v_status = N'Pending';
            END;

            IF @v_own_transaction = 1
                COMMIT TRANSACTION;
        END;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_result AS result, @v_status AS delivery_status;
END;
GO

-- Pending or DeadLettered -> Discarded with the reason. InFlight -> cancel requested: the
-- holder's next heartbeat reports it and the delivery becomes Discarded when the holder settles
-- (or at lease expiry if the holder died). It is never retried. Error 51001 is PostgreSQL's
-- serialization_failure (the transport retries it).
-- returns: result, cancel_requested, delivery_status
CREATE OR ALTER PROCEDURE workqueue.discard
    @p_subscription nvarchar(200),
    @p_delivery_id bigint,
    @p_reason nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_found bit = 0;
    DECLARE @v_key_mode smallint;
    DECLARE @v_subscription_id int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_found bit;
    DECLARE @v_key_holder bigint;
    DECLARE @v_try int = 1;
    DECLARE @v_result nvarchar(20);
    DECLARE @v_cancel_requested bit = 0;
    DECLARE @v_status nvarchar(20);
    DECLARE @v_message nvarchar(2048);

    SELECT @v_found = 1, @v_key_mode = d.key_mode, @v_subscription_id = d.subscription_id,
           @v_key = d.partition_key
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    WHERE d.id = @p_delivery_id AND s.name = @p_subscription;
    IF @v_found = 0
        SET @v_result = N'NotFound';

    BEGIN TRY
        IF @v_found = 1
        BEGIN
            IF @v_own_transaction = 1
                BEGIN TRANSACTION;
            WHILE @v_result IS NULL AND @v_try <= 3
            BEGIN
                -- An InFlight delivery is only flagged: that needs no key lock.
                UPDATE workqueue.delivery
                -- (a second cancel keeps the first one's reason)
                SET reason = CASE WHEN cancel_requested = 1 THEN reason ELSE @p_reason END, cancel_requested = 1
                WHERE id = @p_delivery_id AND status = N'InFlight';
                IF @@ROWCOUNT > 0
                BEGIN
                    SET @v_result = N'CancelRequested';
                    SET @v_cancel_requested = 1;
                    SET @v_status = N'InFlight';
                END
                ELSE
                BEGIN
                    IF @v_key_mode > 0
                    BEGIN
                        SET @v_key_found = 0;
                        SELECT @v_key_found = 1, @v_key_holder = p.holder_id
                        FROM workqueue.partition AS p WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                        WHERE p.subscription_id = @v_subscription_id AND p.partition_key = @v_key;
                        IF @v_key_found = 0
                            INSERT INTO workqueue.partition (subscription_id, partition_key)
                            VALUES (@v_subscription_id, @v_key);
                    END;
                    UPDATE workqueue.delivery
                    SET status = N'Discarded', reason = @p_reason, settled_at = @v_now, lease_token = NULL,
                        lease_expires_at = NULL
                    WHERE id = @p_delivery_id AND status IN (N'Pending', N'DeadLettered');
                    IF @@ROWCOUNT > 0
                    BEGIN
                        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
                        VALUES (@v_subscription_id, 0, 1);
                        -- (PostgreSQL notifies when the key became claimable; consumers poll here.)
                        IF @v_key_mode > 0
                            EXEC workqueue.refresh_partition
                                @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_key_mode;
                        SET @v_result = N'Discarded';
                        SET @v_status = N'Discarded';
                    END
                    ELSE
                    BEGIN
                        SELECT @v_status = d.status FROM workqueue.delivery AS d WHERE d.id = @p_delivery_id;
                        IF @v_status IN (N'Completed', N'Discarded')
                        BEGIN
                            IF @v_key_mode > 0
                                EXEC workqueue.refresh_partition
                                    @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_key_mode;
                            SET @v_result = N'AlreadyTerminal';
                        END;
                        -- Otherwise it was claimed between the two updates: go round again.
                    END;
                END;
                SET @v_try = @v_try + 1;
            END;
            IF @v_result IS NULL
            BEGIN
                SET @v_message = CONCAT(N'delivery ', @p_delivery_id, N' changed state while being discarded; retry');
                THROW 51001, @v_message, 1;
            END;
            IF @v_own_transaction = 1
                COMMIT TRANSACTION;
        END;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_result AS result, @v_cancel_requested AS cancel_requested, @v_status AS delivery_status;
END;
GO

-- Discards up to @p_limit DeadLettered deliveries of a subscription settled before
-- @p_settled_before (reason 'pruned'), oldest id first, counted in settled_count, their keys
-- handed over by release_keys as a settle hands them; answers how many it discarded. A dead letter
-- another transaction holds (a replay) is skipped (READPAST).
-- returns: discard_dead_letters
CREATE OR ALTER PROCEDURE workqueue.discard_dead_letters
    @p_subscription nvarchar(200),
    @p_settled_before datetimeoffset(6),
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_count int = 0;
    DECLARE @v_settled nvarchar(max);
    DECLARE @v_claimable TABLE (subscription_id int NOT NULL);
    DECLARE @v_u TABLE (id bigint NOT NULL PRIMARY KEY, subscription_id int NOT NULL, key_mode smallint NOT NULL);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        UPDATE d
        SET status = N'Discarded', reason = N'pruned', settled_at = @v_now, lease_token = NULL,
            lease_expires_at = NULL
        OUTPUT inserted.id, inserted.subscription_id, inserted.key_mode INTO @v_u (id, subscription_id, key_mode)
        FROM workqueue.delivery AS d
        INNER JOIN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.delivery AS x WITH (UPDLOCK, READPAST, ROWLOCK)
            INNER JOIN workqueue.subscription AS s ON s.id = x.subscription_id
            WHERE s.name = @p_subscription AND x.status = N'DeadLettered' AND x.settled_at < @p_settled_before
            ORDER BY x.id
        ) AS c ON c.id = d.id;
        SET @v_count = @@ROWCOUNT;

        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, 0, COUNT_BIG(*)
        FROM @v_u AS u
        GROUP BY u.subscription_id;

        -- (PostgreSQL notifies the subscriptions whose key became claimable; consumers poll here.)
        IF EXISTS (SELECT 1 FROM @v_u AS u WHERE u.key_mode > 0)
        BEGIN
            SELECT @v_settled = N'[' + STRING_AGG(CAST(u.id AS nvarchar(max)), N',') + N']'
            FROM @v_u AS u;
            INSERT INTO @v_claimable (subscription_id)
            EXEC workqueue.release_keys @p_ids = @v_settled;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_count AS discard_dead_letters;
END;
GO

-- Replaces a stored message's payload and content hash (re-encryption with a new key) while none
-- of its deliveries is InFlight or ended Completed or Discarded; 1 when it rewrote, 0 when the
-- message is not stored or a delivery forbids it. Its deliveries are locked first (UPDLOCK,
-- HOLDLOCK), so none is claimed meanwhile. An envelope over the topic's cap is refused (THROW
-- 51008).
-- returns: rewrite_payload
CREATE OR ALTER PROCEDURE workqueue.rewrite_payload
    @p_message_id uniqueidentifier,
    @p_payload nvarchar(max),
    @p_content_hash nvarchar(128),
    @p_envelope_bytes int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_found bit = 0;
    DECLARE @v_topic nvarchar(200);
    DECLARE @v_cap int;
    DECLARE @v_done bit = 0;
    DECLARE @v_message nvarchar(2048);
    DECLARE @v_statuses TABLE (status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL);

    SELECT @v_found = 1, @v_topic = m.topic, @v_cap = t.max_payload_bytes
    FROM workqueue.message AS m
    LEFT JOIN workqueue.topic AS t ON t.name = m.topic
    WHERE m.id = @p_message_id;
    IF @v_found = 1 AND @v_cap IS NOT NULL AND @p_envelope_bytes > @v_cap
    BEGIN
        SET @v_message = CONCAT(
            N'the rewritten envelope is ', @p_envelope_bytes, N' bytes; topic ''', @v_topic,
            N''' accepts at most ', @v_cap, N' bytes (max_payload_bytes)');
        THROW 51008, @v_message, 1;
    END;

    BEGIN TRY
        IF @v_found = 1
        BEGIN
            IF @v_own_transaction = 1
                BEGIN TRANSACTION;
            INSERT INTO @v_statuses (status)
            SELECT d.status
            FROM workqueue.delivery AS d WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
            WHERE d.message_id = @p_message_id;
            IF NOT EXISTS (
                SELECT 1 FROM @v_statuses AS x WHERE x.status IN (N'InFlight', N'Completed', N'Discarded')
            )
            BEGIN
                UPDATE workqueue.message
                SET payload = @p_payload, content_hash = @p_content_hash
                WHERE id = @p_message_id;
                IF @@ROWCOUNT > 0
                    SET @v_done = 1;
            END;
            IF @v_own_transaction = 1
                COMMIT TRANSACTION;
        END;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_done AS rewrite_payload;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Operator reads
-- ---------------------------------------------------------------------------------------------

-- Each count reads the rows of its state through a filtered index: Pending in three parts (by key
-- mode, the indexes claims use), InFlight (delivery_in_flight), DeadLettered; Completed and
-- Discarded, the states history accumulates in, are the sums of settled_count.
-- returns: subscription, topic, subscription_status, partition_mode, pending, claimable, in_flight, dead_lettered, completed, discarded, oldest_pending_at
CREATE OR ALTER PROCEDURE workqueue.stats
    @p_subscription nvarchar(200) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT s.name AS subscription, s.topic,
           CASE WHEN s.status = N'Active' AND s.retired_at IS NOT NULL THEN N'Retired' ELSE s.status END AS subscription_status,
           s.partition_mode,
           p.pending, COALESCE(cl.claimable, 0) AS claimable, f.in_flight, dl.dead_lettered,
           COALESCE(t.completed, 0) AS completed, COALESCE(t.discarded, 0) AS discarded,
           p.oldest_pending_at
    FROM workqueue.subscription AS s
    LEFT JOIN (
        SELECT c.subscription_id, SUM(c.completed) AS completed, SUM(c.discarded) AS discarded
        FROM workqueue.settled_count AS c
        GROUP BY c.subscription_id
    ) AS t ON t.subscription_id = s.id
    OUTER APPLY (
        -- oldest_pending_at: since when the longest-waiting due delivery waits (one still
        -- delayed or backing off is not waiting yet)
        SELECT COUNT_BIG(*) AS pending,
               MIN(CASE WHEN w.visible_at <= SYSDATETIMEOFFSET() THEN w.visible_at END) AS oldest_pending_at
        FROM (
            SELECT d.visible_at FROM workqueue.delivery AS d
            WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
            UNION ALL
            SELECT d.visible_at FROM workqueue.delivery AS d
            WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 1
            UNION ALL
            SELECT d.visible_at FROM workqueue.delivery AS d
            WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 2
        ) AS w
    ) AS p
    OUTER APPLY (
        SELECT COUNT_BIG(*) AS in_flight FROM workqueue.delivery AS d
        WHERE d.subscription_id = s.id AND d.status = N'InFlight'
    ) AS f
    OUTER APPLY (
        SELECT COUNT_BIG(*) AS dead_lettered FROM workqueue.delivery AS d
        WHERE d.subscription_id = s.id AND d.status = N'DeadLettered'
    ) AS dl
    JOIN workqueue.topic AS tp ON tp.name = s.topic
    OUTER APPLY (
        -- (nothing is claimable while the subscription or its topic is paused, as backlog says)
        SELECT (SELECT COUNT_BIG(*) FROM workqueue.delivery AS d
                WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.visible_at <= @v_now)
             + (SELECT COUNT_BIG(*) FROM workqueue.partition AS pt
                WHERE pt.subscription_id = s.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
                  AND pt.next_visible_at <= @v_now) AS claimable
        WHERE s.status = N'Active' AND tp.status = N'Active'
    ) AS cl
    WHERE @p_subscription IS NULL OR s.name = @p_subscription
    ORDER BY s.name;
END;
GO

-- Backlog for autoscalers: claimable Pending (single flight per key applied) plus InFlight. A
-- paused subscription has nothing claimable.
-- returns: subscription, claimable, in_flight, backlog
CREATE OR ALTER PROCEDURE workqueue.backlog
    @p_subscription nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    WITH s AS (
        SELECT s.id, s.name,
               CASE WHEN s.status = N'Active' AND t.status = N'Active' THEN 1 ELSE 0 END AS active
        FROM workqueue.subscription AS s
        INNER JOIN workqueue.topic AS t ON t.name = s.topic
        WHERE s.name = @p_subscription
    ), n AS (
        SELECT s.name,
               CASE WHEN s.active = 1 THEN
                   (SELECT COUNT_BIG(*) FROM workqueue.delivery AS d
                    WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
                      AND d.visible_at <= @v_now)
                 + (SELECT COUNT_BIG(*) FROM workqueue.partition AS p
                    WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                      AND p.next_visible_at <= @v_now)
               ELSE CAST(0 AS bigint) END AS claimable,
               (SELECT COUNT_BIG(*) FROM workqueue.delivery AS d
                WHERE d.subscription_id = s.id AND d.status = N'InFlight') AS in_flight
        FROM s
    )
    SELECT n.name AS subscription, n.claimable, n.in_flight, n.claimable + n.in_flight AS backlog
    FROM n;
END;
GO

-- returns: delivery_id, subscription, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id, holder_id, holder_host, holder_pid, holder_started_at
CREATE OR ALTER PROCEDURE workqueue.get_delivery
    @p_delivery_id bigint
AS
BEGIN
    SET NOCOUNT ON;
    SELECT d.id AS delivery_id, s.name AS subscription, d.message_id, m.topic, d.partition_key,
           d.status, d.attempt, d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id,
           d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid, p.started_at AS holder_started_at
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    LEFT JOIN workqueue.process AS p ON p.id = d.held_by
    WHERE d.id = @p_delivery_id;
END;
GO

-- Deliveries found by a delivery id, a MessageID, a partition key, a correlation ID or a job name
-- (matched says which), newest first, at most @p_limit (at most 100); each branch through an index.
-- returns: delivery_id, subscription, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id, holder_id, holder_host, holder_pid, holder_started_at, matched
CREATE OR ALTER PROCEDURE workqueue.search_deliveries
    @p_query nvarchar(512),
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_limit int = CASE WHEN @p_limit IS NULL THEN 25 WHEN @p_limit < 1 THEN 1
                                WHEN @p_limit > 100 THEN 100 ELSE @p_limit END;
    DECLARE @v_query nvarchar(512) = LTRIM(RTRIM(@p_query));
    DECLARE @v_found TABLE (
        ord int IDENTITY(1, 1) NOT NULL,
        delivery_id bigint NULL,
        message_id uniqueidentifier NULL,
        what nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
    );

    IF @v_query <> N''
    BEGIN
        IF LEN(@v_query) <= 18 AND @v_query NOT LIKE N'%[^0-9]%'
            INSERT INTO @v_found (delivery_id, what) VALUES (CAST(@v_query AS bigint), N'delivery id');
        IF LEN(@v_query) = 36 AND TRY_CAST(@v_query AS uniqueidentifier) IS NOT NULL
            INSERT INTO @v_found (message_id, what) VALUES (TRY_CAST(@v_query AS uniqueidentifier), N'MessageID');
        INSERT INTO @v_found (message_id, what)
        SELECT TOP (@v_limit) m.id, N'partition key'
        FROM workqueue.message AS m
        WHERE m.partition_key = @v_query
        ORDER BY m.published_at DESC;
        INSERT INTO @v_found (message_id, what)
        SELECT TOP (@v_limit) m.id, N'correlation ID'
        FROM workqueue.message AS m
        WHERE m.correlation_id = @v_query
        ORDER BY m.published_at DESC;
        INSERT INTO @v_found (message_id, what)
        SELECT TOP (@v_limit) m.id, N'job'
        FROM workqueue.message AS m
        WHERE m.job = CAST(@v_query AS nvarchar(200))
        ORDER BY m.published_at DESC;
    END;

    SELECT TOP (@v_limit) d.id AS delivery_id, s.name AS subscription, d.message_id, m.topic, d.partition_key,
           d.status, d.attempt, d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id,
           d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid, p.started_at AS holder_started_at,
           k.what AS matched
    FROM (
        -- Each delivery once, with the first way it matched (in the order found above).
        SELECT u.id, u.what, ROW_NUMBER() OVER (PARTITION BY u.id ORDER BY u.ord) AS rn
        FROM (
            SELECT x.id, f.what, f.ord FROM @v_found AS f
            INNER JOIN workqueue.delivery AS x ON x.id = f.delivery_id
            UNION ALL
            SELECT x.id, f.what, f.ord FROM @v_found AS f
            INNER JOIN workqueue.delivery AS x ON x.message_id = f.message_id
        ) AS u
    ) AS k
    INNER JOIN workqueue.delivery AS d ON d.id = k.id AND k.rn = 1
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    LEFT JOIN workqueue.process AS p ON p.id = d.held_by
    ORDER BY d.id DESC;
END;
GO

-- Which of the given MessageIDs (a JSON array) the store has.
-- returns: message_id
CREATE OR ALTER PROCEDURE workqueue.known_messages
    @p_ids nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SELECT m.id AS message_id
    FROM workqueue.message AS m
    WHERE m.id IN (SELECT TRY_CAST(j.value AS uniqueidentifier) FROM OPENJSON(@p_ids) AS j);
END;
GO

-- The kept attempts of one delivery, oldest first, each with the process that held it.
-- returns: attempt, started_at, ended_at, outcome, reason, error, holder_id, holder_host, holder_pid, holder_started_at
CREATE OR ALTER PROCEDURE workqueue.delivery_attempts
    @p_delivery_id bigint
AS
BEGIN
    SET NOCOUNT ON;
    SELECT TOP (50) a.attempt, a.started_at, a.ended_at, a.outcome, a.reason, a.error,
           a.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid, p.started_at AS holder_started_at
    FROM workqueue.delivery_attempt AS a
    LEFT JOIN workqueue.process AS p ON p.id = a.held_by
    WHERE a.delivery_id = @p_delivery_id
    ORDER BY a.id;
END;
GO

-- Every delivery of one message, each with its subscription, as get_delivery answers, by id.
-- returns: delivery_id, subscription, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id, holder_id, holder_host, holder_pid, holder_started_at
CREATE OR ALTER PROCEDURE workqueue.message_deliveries
    @p_message_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SELECT d.id AS delivery_id, s.name AS subscription, d.message_id, m.topic, d.partition_key,
           d.status, d.attempt, d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id,
           d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid, p.started_at AS holder_started_at
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    LEFT JOIN workqueue.process AS p ON p.id = d.held_by
    WHERE d.message_id = @p_message_id
    ORDER BY d.id;
END;
GO

-- Deliveries of one subscription in one state, oldest first, paged by id. DeadLettered and InFlight
-- are named literally, so their pages read their filtered indexes (a state given as a parameter can
-- use none); the page's ids come first, then their rows.
-- returns: delivery_id, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id, holder_id, holder_host, holder_pid, holder_started_at
CREATE OR ALTER PROCEDURE workqueue.list_deliveries
    @p_subscription nvarchar(200),
    @p_status nvarchar(20),
    @p_limit int,
    @p_after_id bigint = 0
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_subscription int;
    DECLARE @v_after bigint = COALESCE(@p_after_id, 0);
    DECLARE @v_page TABLE (id bigint NOT NULL PRIMARY KEY);
    SELECT @v_subscription = s.id FROM workqueue.subscription AS s WHERE s.name = @p_subscription;
    IF @p_status = N'DeadLettered'
        INSERT INTO @v_page (id)
        SELECT TOP (@p_limit) d.id FROM workqueue.delivery AS d
        WHERE d.subscription_id = @v_subscription AND d.status = N'DeadLettered' AND d.id > @v_after
        ORDER BY d.id;
    ELSE IF @p_status = N'InFlight'
        INSERT INTO @v_page (id)
        SELECT TOP (@p_limit) d.id FROM workqueue.delivery AS d
        WHERE d.subscription_id = @v_subscription AND d.status = N'InFlight' AND d.id > @v_after
        ORDER BY d.id;
    ELSE
        INSERT INTO @v_page (id)
        SELECT TOP (@p_limit) d.id FROM workqueue.delivery AS d
        WHERE d.subscription_id = @v_subscription AND d.status = @p_status AND d.id > @v_after
        ORDER BY d.id;
    SELECT d.id AS delivery_id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts,
           d.visible_at, d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message,
           d.reason, d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload,
           m.correlation_id, d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid,
           p.started_at AS holder_started_at
    FROM @v_page AS v
    INNER JOIN workqueue.delivery AS d ON d.id = v.id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    LEFT JOIN workqueue.process AS p ON p.id = d.held_by
    ORDER BY d.id;
END;
GO

-- A process's beat: its row written (or renewed) with what it serves now; rows unseen for a
-- week are deleted.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.process_beat
    @p_id uniqueidentifier,
    @p_hostname nvarchar(255),
    @p_pid int,
    @p_started_at datetimeoffset(6),
    @p_version nvarchar(64),
    @p_subscriptions nvarchar(max),
    @p_slots int,
    @p_busy int,
    @p_beat_interval_seconds float
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        UPDATE workqueue.process WITH (UPDLOCK, SERIALIZABLE)
        SET version = @p_version, subscriptions = @p_subscriptions, slots = @p_slots, busy = @p_busy,
            beat_interval_seconds = @p_beat_interval_seconds, last_seen_at = @v_now, stopped_at = NULL
        WHERE id = @p_id;
        IF @@ROWCOUNT = 0
            INSERT INTO workqueue.process (
                id, hostname, pid, started_at, version, subscriptions, slots, busy, beat_interval_seconds,
                last_seen_at, stopped_at
            ) VALUES (
                @p_id, @p_hostname, @p_pid, @p_started_at, @p_version, @p_subscriptions, @p_slots, @p_busy,
                @p_beat_interval_seconds, @v_now, NULL
            );
        DELETE FROM workqueue.process WHERE last_seen_at < DATEADD(day, -7, @v_now);
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

-- A process's host stopped: its row stays (the deliveries it held name it) with stopped_at set.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.process_stop
    @p_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    BEGIN TRY
        UPDATE workqueue.process
        SET stopped_at = @v_now, busy = 0, last_seen_at = @v_now
        WHERE id = @p_id;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO

-- The processes known, live ones first, each with its state (Running, Stopped, Gone: not seen
-- within three beat intervals) and the deliveries it holds InFlight now.
-- returns: process_id, hostname, pid, started_at, version, subscriptions, slots, busy, last_seen_at, stopped_at, state, in_flight
CREATE OR ALTER PROCEDURE workqueue.list_processes
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT p.id AS process_id, p.hostname, p.pid, p.started_at, p.version, p.subscriptions, p.slots, p.busy,
           p.last_seen_at, p.stopped_at,
           CASE WHEN p.stopped_at IS NOT NULL THEN N'Stopped'
                WHEN p.last_seen_at < DATEADD(millisecond, CAST(-3000 * p.beat_interval_seconds AS int), @v_now)
                    THEN N'Gone'
                ELSE N'Running' END AS state,
           (SELECT CAST(COUNT(*) AS bigint) FROM workqueue.delivery AS d
            WHERE d.status = N'InFlight' AND d.held_by = p.id) AS in_flight
    FROM workqueue.process AS p
    ORDER BY CASE WHEN p.stopped_at IS NULL THEN 0 ELSE 1 END, p.last_seen_at DESC, p.id;
END;
GO

-- Keys of an Exclusive or Ordered subscription with live work. condition: InFlight (a delivery
-- of the key is running), Blocked (Ordered: the head is dead-lettered, or waiting to be retried),
-- Idle (waiting work, nothing running, not blocked). Keys sort in binary (code point) order.
-- returns: partition_key, condition, head_delivery_id, head_status, head_attempt, head_visible_at, waiting_items
CREATE OR ALTER PROCEDURE workqueue.partitions
    @p_subscription nvarchar(200),
    @p_condition nvarchar(20),
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    WITH s AS (
        SELECT s.id, s.partition_mode FROM workqueue.subscription AS s WHERE s.name = @p_subscription
    ), k AS (
        SELECT p.partition_key,
               CASE WHEN p.holder_id IS NOT NULL THEN N'InFlight'
                    WHEN p.blocked_id IS NOT NULL THEN N'Blocked'
                    WHEN s.partition_mode = N'Ordered' AND h.attempt > 0 AND p.next_visible_at > @v_now
                        THEN N'Blocked'
                    ELSE N'Idle' END AS condition,
               COALESCE(p.holder_id, p.blocked_id, p.next_id) AS head_id
        FROM workqueue.partition AS p
        INNER JOIN s ON s.id = p.subscription_id
        LEFT JOIN workqueue.delivery AS h ON h.id = COALESCE(p.holder_id, p.blocked_id, p.next_id)
    )
    SELECT TOP (@p_limit)
           k.partition_key, k.condition, k.head_id AS head_delivery_id, h.status AS head_status,
           h.attempt AS head_attempt, h.visible_at AS head_visible_at,
           (SELECT COUNT_BIG(*) FROM workqueue.delivery AS w CROSS JOIN s
            WHERE w.subscription_id = s.id AND w.partition_key = k.partition_key
              AND w.status = N'Pending' AND w.id <> k.head_id) AS waiting_items
    FROM k
    LEFT JOIN workqueue.delivery AS h ON h.id = k.head_id
    WHERE @p_condition IS NULL OR k.condition = @p_condition COLLATE Latin1_General_100_BIN2
    ORDER BY k.partition_key;
END;
GO

-- Writes this minute's row of every subscription unless a row of this minute exists (or another
-- transaction holds the lock); answers how many it wrote. @p_now stands in for the clock (tests).
-- The minute starts are counted in UTC, as datetimeoffset compares.
-- returns: record_stats_history
CREATE OR ALTER PROCEDURE workqueue.record_stats_history
    @p_keep_seconds float = 86400,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_epoch datetimeoffset(6) = CAST(N'2000-01-01T00:00:00+00:00' AS datetimeoffset(6));
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());
    DECLARE @v_minute datetimeoffset(6);
    DECLARE @v_to datetimeoffset(6);
    DECLARE @v_from datetimeoffset(6);
    DECLARE @v_last datetimeoffset(6);
    DECLARE @v_lock int;
    DECLARE @v_rows int = 0;
    DECLARE @v_stats TABLE (
        subscription nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY,
        topic nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
        subscription_status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        partition_mode nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        pending bigint NOT NULL,
        claimable bigint NOT NULL,
        in_flight bigint NOT NULL,
        dead_lettered bigint NOT NULL,
        completed bigint NOT NULL,
        discarded bigint NOT NULL,
        oldest_pending_at datetimeoffset(6) NULL
    );
    SET @v_minute = DATEADD(minute, DATEDIFF(minute, @v_epoch, @v_now), @v_epoch);
    SET @v_to = DATEADD(second, -30, @v_now);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        EXEC @v_lock = sp_getapplock
            @Resource = N'workqueue.stats_history',
            @LockMode = N'Exclusive',
            @LockOwner = N'Transaction',
            @LockTimeout = 0;

        IF @v_lock >= 0
        BEGIN
            SELECT @v_last = MAX(h.recorded_at) FROM workqueue.stats_history AS h;
            IF @v_last IS NULL OR @v_last < @v_minute
            BEGIN
                SET @v_from = CASE WHEN @v_last > DATEADD(hour, -1, @v_now) THEN DATEADD(second, -30, @v_last)
                                   ELSE DATEADD(minute, -1, @v_to) END;
                INSERT INTO @v_stats (subscription, topic, subscription_status, partition_mode, pending, claimable,
                                      in_flight, dead_lettered, completed, discarded, oldest_pending_at)
                EXEC workqueue.stats @p_subscription = NULL;

                INSERT INTO workqueue.stats_history
                    (subscription_id, recorded_at, pending, in_flight, dead_lettered, completed, window_seconds)
                SELECT s.id, @v_now, st.pending, st.in_flight, st.dead_lettered, COALESCE(c.completed, 0),
                       CAST(DATEDIFF(millisecond, @v_from, @v_to) AS float) / 1000
                FROM @v_stats AS st
                INNER JOIN workqueue.subscription AS s ON s.name = st.subscription
                LEFT JOIN (
                    SELECT d.subscription_id, COUNT_BIG(*) AS completed
                    FROM workqueue.delivery AS d
                    WHERE d.status = N'Completed' AND d.settled_at >= @v_from AND d.settled_at < @v_to
                    GROUP BY d.subscription_id
                ) AS c ON c.subscription_id = s.id;
                SET @v_rows = @@ROWCOUNT;

                DELETE FROM workqueue.stats_history
                WHERE recorded_at < DATEADD(second, -CAST(@p_keep_seconds AS int), @v_now);
            END;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_rows AS record_stats_history;
END;
GO

-- The rows recorded since @p_since (at most a day back: no more is kept), of one subscription or
-- of all, oldest first.
-- returns: subscription, recorded_at, pending, in_flight, dead_lettered, completed, window_seconds
CREATE OR ALTER PROCEDURE workqueue.stats_history
    @p_since datetimeoffset(6),
    @p_subscription nvarchar(200) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_since datetimeoffset(6) = DATEADD(day, -1, SYSDATETIMEOFFSET());
    IF @p_since > @v_since
        SET @v_since = @p_since;
    SELECT s.name AS subscription, h.recorded_at, h.pending, h.in_flight, h.dead_lettered, h.completed,
           h.window_seconds
    FROM workqueue.stats_history AS h
    INNER JOIN workqueue.subscription AS s ON s.id = h.subscription_id
    WHERE h.recorded_at >= @v_since AND (@p_subscription IS NULL OR s.name = @p_subscription)
    ORDER BY h.recorded_at, s.name;
END;
GO

-- Each subscription's live counts, each stopping at @p_cap (a page shows "@p_cap or more"): at most
-- @p_cap index entries a state, whatever the backlog (stats counts every live row).
-- oldest_pending_at: since when the longest-waiting claimable work waits (the heads of
-- delivery_claim and partition_ready); stuck: InFlight claimed before @p_stuck_before, among the
-- first @p_cap InFlight.
-- returns: subscription, pending, in_flight, dead_lettered, oldest_pending_at, stuck
CREATE OR ALTER PROCEDURE workqueue.live_counts
    @p_subscription nvarchar(200) = NULL,
    @p_cap int = 1000,
    @p_stuck_before datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SELECT c.subscription,
           CASE WHEN c.pending > @p_cap THEN CAST(@p_cap AS bigint) ELSE c.pending END AS pending,
           c.in_flight, c.dead_lettered,
           CASE WHEN c.claim_head IS NULL THEN c.key_head
                WHEN c.key_head IS NULL OR c.claim_head <= c.key_head THEN c.claim_head
                ELSE c.key_head END AS oldest_pending_at,
           c.stuck
    FROM (
        SELECT s.name AS subscription,
               (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'Pending'
                                            AND d.key_mode = 0 ORDER BY d.visible_at, d.id) AS x)
             + (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'Pending'
                                            AND d.key_mode = 1
                                          ORDER BY d.partition_key, d.visible_at, d.id) AS x)
             + (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'Pending'
                                            AND d.key_mode = 2 ORDER BY d.partition_key, d.id) AS x) AS pending,
               (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'InFlight') AS x)
                   AS in_flight,
               (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'DeadLettered'
                                          ORDER BY d.id) AS x)
                   AS dead_lettered,
               (SELECT TOP (1) d.visible_at FROM workqueue.delivery AS d
                WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
                ORDER BY d.visible_at, d.id) AS claim_head,
               (SELECT TOP (1) p.next_visible_at FROM workqueue.partition AS p
                WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                ORDER BY p.next_visible_at) AS key_head,
               CASE WHEN @p_stuck_before IS NULL THEN CAST(0 AS bigint) ELSE
                   (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.claimed_at FROM workqueue.delivery AS d
                                              WHERE d.subscription_id = s.id AND d.status = N'InFlight') AS x
                    WHERE x.claimed_at < @p_stuck_before) END AS stuck
        FROM workqueue.subscription AS s
        WHERE @p_subscription IS NULL OR s.name = @p_subscription
    ) AS c
    ORDER BY c.subscription;
END;
GO

-- How full a subscription's flow limits are (PostgreSQL's flow_state says what it counts), each
-- count stopping at @p_cap. No row for an unknown name.
-- returns: in_flight, tokens, keys_at_limit, waiting
CREATE OR ALTER PROCEDURE workqueue.flow_state
    @p_subscription nvarchar(200),
    @p_cap int = 1000,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());
    DECLARE @v_subscription_id int;
    DECLARE @v_max_in_flight int;
    DECLARE @v_key_concurrency int;
    DECLARE @v_rate float;
    DECLARE @v_key_rate float;
    DECLARE @v_in_flight bigint;
    DECLARE @v_tokens float;
    DECLARE @v_full bit = 0;
    DECLARE @v_waiting bigint;
    DECLARE @v_paused bit = 0;
    DECLARE @v_keys TABLE (partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY);

    SELECT @v_subscription_id = s.id, @v_max_in_flight = s.max_in_flight,
           @v_key_concurrency = CASE WHEN s.partition_mode = N'None' THEN s.key_concurrency END,
           @v_rate = workqueue.rate_per_second(s.rate_limit), @v_key_rate = workqueue.rate_per_second(s.key_rate_limit),
           @v_paused = CASE WHEN s.status = N'Paused' OR t.status = N'Paused' THEN 1 ELSE 0 END
    FROM workqueue.subscription AS s
    INNER JOIN workqueue.topic AS t ON t.name = s.topic
    WHERE s.name = @p_subscription;

    IF @v_subscription_id IS NOT NULL
    BEGIN
        SELECT @v_in_flight = COUNT_BIG(*) FROM (
            SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
            WHERE d.subscription_id = @v_subscription_id AND d.status = N'InFlight' AND d.lease_expires_at > @v_now
        ) AS x;
        IF @v_rate IS NOT NULL
        BEGIN
            SELECT @v_tokens = b.tokens + CASE WHEN b.updated_at < @v_now
                                               THEN DATEDIFF_BIG(microsecond, b.updated_at, @v_now) / 1000000.0
                                               ELSE 0 END * @v_rate
            FROM workqueue.rate_bucket AS b
            WHERE b.subscription_id = @v_subscription_id AND b.per_key = 0 AND b.partition_key = N'';
            IF @v_tokens IS NULL OR @v_tokens > CASE WHEN @v_rate > 1 THEN @v_rate ELSE 1 END
                SET @v_tokens = CASE WHEN @v_rate > 1 THEN @v_rate ELSE 1 END;
        END;
        INSERT INTO @v_keys (partition_key)
        SELECT TOP (@p_cap) k.k FROM (
            SELECT d.partition_key AS k FROM workqueue.delivery AS d
            WHERE @v_key_concurrency IS NOT NULL AND d.subscription_id = @v_subscription_id
              AND d.status = N'InFlight' AND d.lease_expires_at > @v_now AND d.partition_key IS NOT NULL
            GROUP BY d.partition_key
            HAVING COUNT(*) >= @v_key_concurrency
            UNION
            SELECT b.partition_key FROM workqueue.rate_bucket AS b
            WHERE @v_key_rate IS NOT NULL AND b.subscription_id = @v_subscription_id AND b.per_key = 1
              AND b.tokens + CASE WHEN b.updated_at < @v_now
                                  THEN DATEDIFF_BIG(microsecond, b.updated_at, @v_now) / 1000000.0
                                  ELSE 0 END * @v_key_rate < 1
        ) AS k;
        IF (@v_max_in_flight IS NOT NULL AND @v_in_flight >= @v_max_in_flight) OR @v_tokens < 1
            SET @v_full = 1;
        SELECT @v_waiting = COUNT_BIG(*) FROM (
            SELECT TOP (@p_cap) w.one FROM (
                SELECT 1 AS one FROM workqueue.delivery AS d
                WHERE d.subscription_id = @v_subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.visible_at <= @v_now AND @v_paused = 0  -- (paused: nothing is claimable)
                  AND (@v_full = 1 OR d.partition_key IN (SELECT k.partition_key FROM @v_keys AS k))
                UNION ALL
                SELECT 1 AS one FROM workqueue.partition AS p
                WHERE p.subscription_id = @v_subscription_id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                  AND p.next_visible_at <= @v_now AND @v_paused = 0
                  AND (@v_full = 1 OR p.partition_key IN (SELECT k.partition_key FROM @v_keys AS k))
            ) AS w
        ) AS x;
    END;
    SELECT @v_in_flight AS in_flight, @v_tokens AS tokens,
           (SELECT COUNT_BIG(*) FROM @v_keys) AS keys_at_limit, @v_waiting AS waiting
    WHERE @v_subscription_id IS NOT NULL;
END;
GO

-- The heads that block keys of an Ordered subscription, oldest first, at most @p_limit: a
-- dead-lettered head (through delivery_dead_letters) or a head waiting to be retried (through
-- partition_ready); waiting_items counts the key's deliveries behind it, up to @p_cap.
-- returns: partition_key, head_delivery_id, head_status, head_attempt, head_visible_at, head_reason, waiting_items
CREATE OR ALTER PROCEDURE workqueue.blocked_keys
    @p_subscription nvarchar(200),
    @p_limit int,
    @p_cap int = 1000
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_subscription_id int;
    DECLARE @v_heads TABLE (id bigint NOT NULL PRIMARY KEY);
    SELECT @v_subscription_id = s.id
    FROM workqueue.subscription AS s
    WHERE s.name = @p_subscription AND s.partition_mode = N'Ordered';

    INSERT INTO @v_heads (id)
    SELECT TOP (@p_limit) d.id FROM workqueue.delivery AS d
    WHERE d.subscription_id = @v_subscription_id AND d.status = N'DeadLettered' AND d.key_mode = 2
    ORDER BY d.id;
    INSERT INTO @v_heads (id)
    SELECT w.next_id FROM (
        SELECT TOP (@p_limit) p.next_id FROM workqueue.partition AS p
        WHERE p.subscription_id = @v_subscription_id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
          AND p.next_visible_at > @v_now
        ORDER BY p.next_visible_at
    ) AS w
    WHERE NOT EXISTS (SELECT 1 FROM @v_heads AS h WHERE h.id = w.next_id);

    SELECT TOP (@p_limit) d.partition_key, d.id AS head_delivery_id, d.status AS head_status,
           d.attempt AS head_attempt, d.visible_at AS head_visible_at, d.reason AS head_reason,
           (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) w.id FROM workqueue.delivery AS w
                                      WHERE w.subscription_id = d.subscription_id
                                        AND w.partition_key = d.partition_key AND w.key_mode = 2
                                        AND w.status = N'Pending' AND w.id > d.id ORDER BY w.id) AS x)
               AS waiting_items
    FROM @v_heads AS h
    INNER JOIN workqueue.delivery AS d ON d.id = h.id
    WHERE d.status = N'DeadLettered' OR d.attempt > 0
    ORDER BY d.id;
END;
GO

-- Which migrations this database has (for validate-bindings). The table is created by the
-- migration runner before the first migration (fastapi_workqueue/database/mssql.py).
-- returns: version, name, checksum
CREATE OR ALTER PROCEDURE workqueue.schema_versions
AS
BEGIN
    SET NOCOUNT ON;
    SELECT m.version, m.name, m.checksum
    FROM workqueue.schema_migration AS m
    ORDER BY m.version;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- API keys of the REST API
-- ---------------------------------------------------------------------------------------------

-- A name an unrevoked key has is refused with THROW 51004 (PostgreSQL: unique_violation).
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.api_key_create
    @p_id uniqueidentifier,
    @p_name nvarchar(max),
    @p_prefix nvarchar(200),
    @p_key_hash nvarchar(200),
    @p_scopes nvarchar(max),
    @p_expires_at datetimeoffset(6),
    @p_topics nvarchar(max) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_message nvarchar(2048);
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF EXISTS (
            SELECT 1 FROM workqueue.api_key AS k WITH (UPDLOCK, HOLDLOCK)
            WHERE k.name = @p_name AND k.revoked_at IS NULL
        )
        BEGIN
            SET @v_message = CONCAT(
                N'an API key named ''', REPLACE(@p_name, N'''', N''''''), N''' exists already; revoke it first ',
                N'(workqueue api-keys revoke ''', REPLACE(@p_name, N'''', N''''''), N''') or pick another name');
            THROW 51004, @v_message, 1;
        END;
        INSERT INTO workqueue.api_key (id, name, prefix, key_hash, scopes, expires_at, topics)
        VALUES (@p_id, @p_name, @p_prefix, @p_key_hash, @p_scopes, @p_expires_at, @p_topics);
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

-- The key behind a prefix whose SHA-256 is @p_key_hash, if it is usable now; never its hash.
-- returns: id, name, scopes, topics, session_generation
CREATE OR ALTER PROCEDURE workqueue.api_key_verify
    @p_prefix nvarchar(200),
    @p_key_hash nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT k.id, k.name, k.scopes, k.topics, k.session_generation
    FROM workqueue.api_key AS k
    WHERE k.prefix = @p_prefix AND k.key_hash = @p_key_hash AND k.revoked_at IS NULL
      AND (k.expires_at IS NULL OR k.expires_at > @v_now);
END;
GO

-- The key behind a prefix, if it is usable now, for a session the application signed; never its hash.
-- returns: id, name, scopes, topics, session_generation
CREATE OR ALTER PROCEDURE workqueue.api_key_session
    @p_prefix nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT k.id, k.name, k.scopes, k.topics, k.session_generation
    FROM workqueue.api_key AS k
    WHERE k.prefix = @p_prefix AND k.revoked_at IS NULL
      AND (k.expires_at IS NULL OR k.expires_at > @v_now);
END;
GO

-- Ends the dashboard sessions of a key issued at @p_session_generation (a sign-out).
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.api_key_end_sessions
    @p_id uniqueidentifier,
    @p_session_generation int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    BEGIN TRY
        UPDATE workqueue.api_key
        SET session_generation = session_generation + 1
        WHERE id = @p_id AND session_generation = @p_session_generation;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO

-- Marks a key used (at most once a minute); called once the key's hash matched.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.api_key_touch
    @p_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    BEGIN TRY
        UPDATE workqueue.api_key
        SET last_used_at = @v_now
        WHERE id = @p_id AND revoked_at IS NULL
          AND (last_used_at IS NULL OR last_used_at < DATEADD(minute, -1, @v_now));
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO

-- returns: id, name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at, topics
CREATE OR ALTER PROCEDURE workqueue.api_key_list
AS
BEGIN
    SET NOCOUNT ON;
    SELECT k.id, k.name, k.prefix, k.scopes, k.created_at, k.expires_at, k.revoked_at, k.last_used_at, k.topics
    FROM workqueue.api_key AS k
    ORDER BY k.created_at, k.name;
END;
GO

-- Revokes by id, prefix or name; returns how many keys it revoked now.
-- returns: api_key_revoke
CREATE OR ALTER PROCEDURE workqueue.api_key_revoke
    @p_key nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_count int = 0;
    BEGIN TRY
        UPDATE workqueue.api_key
        SET revoked_at = SYSDATETIMEOFFSET()
        WHERE revoked_at IS NULL
          AND (id = TRY_CAST(@p_key AS uniqueidentifier) OR prefix = @p_key OR name = @p_key);
        SET @v_count = @@ROWCOUNT;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
    SELECT @v_count AS api_key_revoke;
END;
GO

-- The AWS transport: the imported bindings and the outbox of publishes to aws topics made in a
-- caller's transaction; the outbox's topic and partition key compare in the binary collation, the
-- key up to 512 characters. The AWS layer reaches both through the procedures below
-- (fastapi_workqueue/aws/outbox_store.py); roles/aws_role.sql grants EXECUTE on them, and
-- aws_binding_replace (an import of bindings, a deployment step) is left to the schema owner.
CREATE TABLE workqueue.aws_binding (
    kind         nvarchar(20) NOT NULL CONSTRAINT aws_binding_kind CHECK (kind IN (N'topic', N'subscription')),
    name         nvarchar(200) NOT NULL,
    region       nvarchar(64) NOT NULL,
    binding      nvarchar(max) NOT NULL,
    imported_at  datetimeoffset(6) NOT NULL CONSTRAINT aws_binding_imported_at DEFAULT SYSDATETIMEOFFSET(),
    CONSTRAINT aws_binding_pk PRIMARY KEY CLUSTERED (kind, name)
);
GO

CREATE TABLE workqueue.aws_outbox (
    id               bigint IDENTITY(1, 1) NOT NULL,
    topic            nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    message_id       uniqueidentifier NOT NULL,
    partition_key    nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
    body             nvarchar(max) NOT NULL,
    attributes       nvarchar(max) NOT NULL,
    created_at       datetimeoffset(6) NOT NULL CONSTRAINT aws_outbox_created_at DEFAULT SYSDATETIMEOFFSET(),
    next_attempt_at  datetimeoffset(6) NOT NULL CONSTRAINT aws_outbox_next_attempt_at DEFAULT SYSDATETIMEOFFSET(),
    attempts         int NOT NULL CONSTRAINT aws_outbox_attempts DEFAULT 0,
    last_error       nvarchar(4000) NULL,
    sent_at          datetimeoffset(6) NULL,
    CONSTRAINT aws_outbox_pk PRIMARY KEY CLUSTERED (id)
);
CREATE INDEX aws_outbox_unsent ON workqueue.aws_outbox (id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_unsent_key ON workqueue.aws_outbox (topic, partition_key, id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_sent ON workqueue.aws_outbox (sent_at) WHERE sent_at IS NOT NULL;
GO

-- Writes one outbox row per message (the JSON arrays are parallel; an attributes item is the JSON
-- text of the message's attributes), in the caller's transaction and in the order given.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.aws_outbox_write
    @p_topic nvarchar(200),
    @p_message_ids nvarchar(max),
    @p_partition_keys nvarchar(max),
    @p_bodies nvarchar(max),
    @p_attributes nvarchar(max),
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        INSERT INTO workqueue.aws_outbox (topic, message_id, partition_key, body, attributes, created_at, next_attempt_at)
        SELECT @p_topic, CAST(m.value AS uniqueidentifier), k.value, b.value, a.value, @v_now, @v_now
        FROM OPENJSON(@p_message_ids) AS m
        INNER JOIN OPENJSON(@p_partition_keys) AS k ON k.[key] = m.[key]
        INNER JOIN OPENJSON(@p_bodies) AS b ON b.[key] = m.[key]
        INNER JOIN OPENJSON(@p_attributes) AS a ON a.[key] = m.[key]
        ORDER BY CAST(m.[key] AS int);
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

-- The relay's take: locks up to @p_limit due unsent rows, oldest first, with UPDLOCK, READPAST,
-- ROWLOCK (rows another relay holds are skipped, not waited for), and answers those with no earlier
-- unsent row of their topic and key outside the set it locked (a key another relay holds, or whose
-- head waits out a deferral, is left alone; that check reads past no row). The locks last until the
-- caller's transaction ends: the relay sends, marks and commits in it.
-- returns: id, topic, message_id, partition_key, body, attributes, attempts
CREATE OR ALTER PROCEDURE workqueue.aws_outbox_take
    @p_limit int,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    DECLARE @v_locked TABLE (
        id bigint NOT NULL PRIMARY KEY,
        topic nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL
    );
    INSERT INTO @v_locked (id, topic, partition_key)
    SELECT TOP (@p_limit) o.id, o.topic, o.partition_key
    FROM workqueue.aws_outbox AS o WITH (UPDLOCK, READPAST, ROWLOCK)
    WHERE o.sent_at IS NULL AND o.next_attempt_at <= @v_now
    ORDER BY o.id;
    SELECT o.id, o.topic, o.message_id, o.partition_key, o.body, o.attributes, o.attempts
    FROM @v_locked AS l
    INNER JOIN workqueue.aws_outbox AS o ON o.id = l.id
    WHERE l.partition_key IS NULL OR NOT EXISTS (
        SELECT 1
        FROM workqueue.aws_outbox AS e
        WHERE e.topic = l.topic AND e.partition_key = l.partition_key AND e.sent_at IS NULL AND e.id < l.id
          AND e.id NOT IN (SELECT x.id FROM @v_locked AS x)
    )
    ORDER BY o.id;
END;
GO

-- Marks rows the relay sent (SNS accepted them); @p_ids is a JSON array.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.aws_outbox_mark_sent
    @p_ids nvarchar(max),
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    BEGIN TRY
        UPDATE workqueue.aws_outbox
        SET sent_at = @v_now, attempts = attempts + 1, last_error = NULL
        WHERE id IN (SELECT t.id FROM OPENJSON(@p_ids) WITH (id bigint '$') AS t);
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO

-- Puts off a row SNS refused or throttled by @p_delay_seconds (to the millisecond), keeping the error.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.aws_outbox_defer
    @p_id bigint,
    @p_error nvarchar(4000),
    @p_delay_seconds float,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    BEGIN TRY
        UPDATE workqueue.aws_outbox
        SET attempts = attempts + 1, last_error = @p_error,
            next_attempt_at = DATEADD(millisecond, CAST(ROUND(@p_delay_seconds * 1000, 0) AS int), @v_now)
        WHERE id = @p_id;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO

-- The stored bindings, by kind and name.
-- returns: kind, name, region, binding
CREATE OR ALTER PROCEDURE workqueue.aws_binding_list
AS
BEGIN
    SET NOCOUNT ON;
    SELECT b.kind, b.name, b.region, b.binding
    FROM workqueue.aws_binding AS b
    ORDER BY b.kind, b.name;
END;
GO

-- Replaces every stored binding with the given ones (the JSON arrays are parallel; a bindings item
-- is the JSON text of one binding), in one transaction.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.aws_binding_replace
    @p_region nvarchar(64),
    @p_kinds nvarchar(max),
    @p_names nvarchar(max),
    @p_bindings nvarchar(max),
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());  -- @p_now: a test's clock
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        DELETE FROM workqueue.aws_binding;
        INSERT INTO workqueue.aws_binding (kind, name, region, binding, imported_at)
        SELECT k.value, n.value, @p_region, b.value, @v_now
        FROM OPENJSON(@p_kinds) AS k
        INNER JOIN OPENJSON(@p_names) AS n ON n.[key] = k.[key]
        INNER JOIN OPENJSON(@p_bindings) AS b ON b.[key] = k.[key];
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO
