-- fastapi-workqueue: the PostgreSQL schema, as a fresh install ends with it (through migration 0001).
--
-- This file is for reading: the tables and their indexes first, then every function grouped by
-- concern, each with what it does; docs/design/ says why the code is written the way it is.
-- `workqueue migrate` applies the numbered migrations (NNNN_*.sql): 0001_schema.sql is this file as
-- release 0.1.0 ships it, and each later release adds one migration and makes the same change here,
-- never an edit of a migration a release shipped (docs/design/migrations.md).
-- tests/test_schema_file.py replays the migrations on an empty database and checks that the
-- catalog equals what this file builds on another (tables, columns, indexes, constraints,
-- functions and grants), so the two cannot drift apart.
--
-- Every write goes through the functions, which are SECURITY DEFINER: the roles of roles/ hold
-- EXECUTE on them and no privilege on any table, and no function is executable by PUBLIC.

CREATE SCHEMA IF NOT EXISTS workqueue;

-- The migration runner's record of what it applied (fastapi_workqueue/database/migrations.py
-- creates it before the first migration).
CREATE TABLE IF NOT EXISTS workqueue.schema_migration (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- ---------------------------------------------------------------------------------------------
-- Topology: topics, and their subscriptions with their policies
-- ---------------------------------------------------------------------------------------------

CREATE TABLE workqueue.topic (
    name               text PRIMARY KEY,
    transport          text NOT NULL DEFAULT 'database',
    max_payload_bytes  integer CHECK (max_payload_bytes IS NULL OR max_payload_bytes > 0),
    is_fifo            boolean NOT NULL DEFAULT false,
    status             text NOT NULL DEFAULT 'Active' CHECK (status IN ('Active', 'Paused')),
    binding_config     jsonb,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    retired_at         timestamptz
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
    updated_at              timestamptz NOT NULL DEFAULT now(),
    retired_at              timestamptz,  -- retired: no new deliveries, what it holds drains
    -- Flow limits, held across every process (docs/design/flow-control.md); NULL: none.
    max_in_flight           integer CHECK (max_in_flight IS NULL OR max_in_flight >= 1),
    key_concurrency         integer CHECK (key_concurrency IS NULL OR key_concurrency >= 1),
    rate_limit              text CHECK (rate_limit IS NULL OR rate_limit ~ '^[1-9][0-9]{0,8}/[smh]$'),
    key_rate_limit          text CHECK (key_rate_limit IS NULL OR key_rate_limit ~ '^[1-9][0-9]{0,8}/[smh]$')
);
CREATE INDEX subscription_topic ON workqueue.subscription (topic);

-- ---------------------------------------------------------------------------------------------
-- The work: messages, one delivery per matching subscription, and the state of keys
-- ---------------------------------------------------------------------------------------------
-- Partition keys are COLLATE "C" wherever they are stored: they compare byte by byte (as SQL
-- Server's BIN2 columns), not by the database's locale, in every index and join on a key.

CREATE TABLE workqueue.message (
    id                 uuid PRIMARY KEY,
    topic              text NOT NULL,
    partition_key      text COLLATE "C",
    attributes         jsonb NOT NULL DEFAULT '{}'::jsonb,
    payload            text,              -- JSON text, kept as sent (jsonb would refuse \u0000)
    payload_ref        text,
    correlation_id     text,
    deduplication_key  text,
    content_hash       text NOT NULL,
    published_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX message_published_at ON workqueue.message (published_at);
-- Search only (search_deliveries): a message by its partition key, correlation ID or job name,
-- newest first. Partial, so a message without one costs its publish nothing here.
CREATE INDEX message_partition_key ON workqueue.message (partition_key, published_at)
    WHERE partition_key IS NOT NULL;
CREATE INDEX message_correlation_id ON workqueue.message (correlation_id, published_at)
    WHERE correlation_id IS NOT NULL;
CREATE INDEX message_job ON workqueue.message ((attributes ->> 'job'), published_at)
    WHERE attributes ? 'job';

-- status: Pending, InFlight, Completed, DeadLettered or Discarded. key_mode: 0 = the delivery is
-- claimed on its own (None mode, or no partition key); 1 = Exclusive key, 2 = Ordered key: claimed
-- through its row in workqueue.partition. Only the functions write this table, and only those
-- values: no CHECK constraint, which PostgreSQL would plan again for every statement that writes
-- the table (docs/design/claims-and-keys.md).
CREATE TABLE workqueue.delivery (
    id                    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription_id       integer NOT NULL,
    message_id            uuid NOT NULL,
    partition_key         text COLLATE "C",
    key_mode              smallint NOT NULL DEFAULT 0,
    status                text NOT NULL DEFAULT 'Pending',
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
    settled_at            timestamptz,
    held_by               uuid,
    watched               boolean,         -- true: its end is announced (delivery_ended, for wait)
    group_id              uuid,            -- a member of this group (message_group): its end is counted
    priority              smallint NOT NULL DEFAULT 0   -- 0..9, higher claimed first
) WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);

-- Claimable work without a key lock: the head of this index is the next delivery to claim.
CREATE INDEX delivery_claim ON workqueue.delivery (subscription_id, visible_at, id)
    WHERE status = 'Pending' AND key_mode = 0;
-- The same work with a priority above 0, claimed first, one level at a time (9 down to 1). Empty
-- while nobody publishes with a priority: a message of priority 0 costs nothing here, and a claim
-- probes it once (docs/design/flow-control.md).
CREATE INDEX delivery_claim_priority ON workqueue.delivery (subscription_id, priority, visible_at, id)
    WHERE status = 'Pending' AND key_mode = 0 AND priority > 0;
-- Ordered keys: the next one is the lowest id among Pending and DeadLettered (a DeadLettered one
-- blocks the key). An InFlight delivery is the key's holder, which its partition row names: left
-- out, so that a claim writes no entry here.
CREATE INDEX delivery_ordered_head ON workqueue.delivery (subscription_id, partition_key, id)
    WHERE key_mode = 2 AND status IN ('Pending', 'DeadLettered');
-- Exclusive keys: the next delivery is the earliest visible Pending one.
CREATE INDEX delivery_exclusive_next ON workqueue.delivery (subscription_id, partition_key, visible_at, id)
    WHERE key_mode = 1 AND status = 'Pending';
CREATE INDEX delivery_dead_letters ON workqueue.delivery (subscription_id, id) WHERE status = 'DeadLettered';
CREATE INDEX delivery_settled ON workqueue.delivery (settled_at) WHERE status IN ('Completed', 'Discarded');
CREATE INDEX delivery_message ON workqueue.delivery (message_id);
-- The InFlight set (the sweeper filters it on lease_expires_at): on a column a heartbeat never
-- changes, so that no index names what a heartbeat writes and heartbeats are HOT updates.
CREATE INDEX delivery_in_flight ON workqueue.delivery (subscription_id) WHERE status = 'InFlight';

-- The attempts of a delivery off the happy path, one row each: a settle that retries, dead-letters
-- or discards, a lease expiry, a replay (outcome Failed, DeadLettered, Discarded, LeaseExpired or
-- Replayed). A delivery claimed and completed writes no row here. At most 50 rows a delivery (the
-- oldest go), removed with the delivery by the foreign key.
CREATE TABLE workqueue.delivery_attempt (
    delivery_id  bigint NOT NULL REFERENCES workqueue.delivery (id) ON DELETE CASCADE,
    id           bigint GENERATED ALWAYS AS IDENTITY,
    attempt      integer NOT NULL,
    started_at   timestamptz,
    ended_at     timestamptz NOT NULL,
    held_by      uuid,
    outcome      text NOT NULL,
    reason       text,
    error        text,
    PRIMARY KEY (delivery_id, id)
);

-- One row per (subscription, key) with live keyed work: the lock and the state of the key.
--   holder_id: the InFlight delivery of the key (at most one, ever).
--   next_id / next_visible_at: the delivery a claim takes next when there is no holder.
--   next_priority: the priority of next_id (0 without one): keys are claimed by it.
--   blocked_id: Ordered only, the DeadLettered head that blocks the key.
-- A key with none of the three has no row.
CREATE TABLE workqueue.partition (
    subscription_id   integer NOT NULL,
    partition_key     text COLLATE "C" NOT NULL,
    holder_id         bigint,
    next_id           bigint,
    next_visible_at   timestamptz,
    blocked_id        bigint,
    next_priority     smallint NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription_id, partition_key)
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);
CREATE INDEX partition_ready ON workqueue.partition (subscription_id, next_visible_at, next_id)
    WHERE holder_id IS NULL AND next_id IS NOT NULL;
-- Keys whose next delivery has a priority above 0, claimed first (as delivery_claim_priority).
CREATE INDEX partition_ready_priority ON workqueue.partition (subscription_id, next_priority, next_visible_at, next_id)
    WHERE holder_id IS NULL AND next_id IS NOT NULL AND next_priority > 0;

-- Keys a settle or lease expiry could not hand over because another transaction (a producer)
-- held their partition row: the row may still name a settled holder until rederive_stale
-- re-derives it. Empty but under contention.
CREATE TABLE workqueue.partition_stale (
    subscription_id  integer NOT NULL,
    partition_key    text COLLATE "C" NOT NULL,
    key_mode         smallint NOT NULL,
    PRIMARY KEY (subscription_id, partition_key)
);

-- The token buckets of rate limits, shared by every process: a subscription's own (rate_limit:
-- per_key false, partition_key '') and one per partition key (key_rate_limit), made by the first
-- claim that spends from it and purged once it is full again (idle). tokens as of updated_at; a
-- claim adds what the rate gave since, up to one second of tokens (at least one).
CREATE TABLE workqueue.rate_bucket (
    subscription_id  integer NOT NULL,
    per_key          boolean NOT NULL,
    partition_key    text COLLATE "C" NOT NULL,
    tokens           double precision NOT NULL,
    updated_at       timestamptz NOT NULL,
    PRIMARY KEY (subscription_id, per_key, partition_key)
);

-- Deduplication keys of a topic while they live.
CREATE TABLE workqueue.deduplication (
    topic              text NOT NULL,
    deduplication_key  text NOT NULL,
    message_id         uuid NOT NULL,
    expires_at         timestamptz NOT NULL,
    PRIMARY KEY (topic, deduplication_key)
);
CREATE INDEX deduplication_expires_at ON workqueue.deduplication (expires_at);

-- Deltas of each subscription's Completed and Discarded deliveries, whose sums are the counts
-- stats shows: one row per settle batch (and per lease expiry, discard, purge and prune), folded
-- by the sweeper into one per subscription. No key and no index: rows are only appended, summed
-- all at once, and folded; nobody updates a row another transaction appends beside.
CREATE TABLE workqueue.settled_count (
    subscription_id  integer NOT NULL,
    completed        bigint NOT NULL,
    discarded        bigint NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);

-- The JSON result of each named step of a message's work (the jobs layer's durable steps), the
-- first write winning. The foreign key takes a message's steps away when purge deletes it.
CREATE TABLE workqueue.step_result (
    message_id  uuid NOT NULL REFERENCES workqueue.message (id) ON DELETE CASCADE,
    name        text NOT NULL,
    value       text NOT NULL,              -- JSON text, kept as sent
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (message_id, name)
);

-- The result of a message's work (a job declared store_result=True): JSON text written by
-- result_put in the transaction that completes the delivery, removed with the message (foreign key).
CREATE TABLE workqueue.message_result (
    message_id  uuid PRIMARY KEY REFERENCES workqueue.message (id) ON DELETE CASCADE,
    value       text NOT NULL,              -- JSON text, kept as sent
    stored_at   timestamptz NOT NULL DEFAULT now()
);

-- Groups (fan-in): a message held back (its deliveries visible at 9999-12-31) until every member
-- message has ended. remaining counts the members not ended yet; the end of each (the trigger
-- delivery_ended, in the transaction that ends it) counts one down under the group's row lock, and
-- the one that reaches 0 makes the held message due (released_at): exactly once, whichever
-- processes end the last members at once. The group goes with its held message (foreign key), and
-- its members with it.
CREATE TABLE workqueue.message_group (
    id               uuid PRIMARY KEY,
    then_message_id  uuid NOT NULL REFERENCES workqueue.message (id) ON DELETE CASCADE,
    members          integer NOT NULL,
    remaining        integer NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    released_at      timestamptz
);
CREATE INDEX message_group_then ON workqueue.message_group (then_message_id);

CREATE TABLE workqueue.message_group_member (
    group_id    uuid NOT NULL REFERENCES workqueue.message_group (id) ON DELETE CASCADE,
    message_id  uuid NOT NULL,
    ordinal     integer NOT NULL,
    ended_at    timestamptz,
    PRIMARY KEY (group_id, message_id)
);

-- One row per subscription per minute, written by the sweeper (record_stats_history): the live
-- counts as stats reads them and the deliveries Completed in the window since the previous row
-- (window_seconds long). Kept a day; the dashboard charts the last hour.
CREATE TABLE workqueue.stats_history (
    subscription_id  integer NOT NULL,
    recorded_at      timestamptz NOT NULL,
    pending          bigint NOT NULL,
    in_flight        bigint NOT NULL,
    dead_lettered    bigint NOT NULL,
    completed        bigint NOT NULL,
    window_seconds   double precision NOT NULL,
    PRIMARY KEY (subscription_id, recorded_at)
);
CREATE INDEX stats_history_recorded_at ON workqueue.stats_history (recorded_at);

-- ---------------------------------------------------------------------------------------------
-- Once markers and API keys
-- ---------------------------------------------------------------------------------------------

CREATE TABLE workqueue.once_marker (
    key         text PRIMARY KEY,
    state       text NOT NULL CHECK (state IN ('Running', 'Done')),
    token       uuid,
    expires_at  timestamptz NOT NULL
);
CREATE INDEX once_marker_expires_at ON workqueue.once_marker (expires_at);

-- The public prefix finds a key, its SHA-256 proves it; scopes are workqueue:publish, :jobs,
-- :read, :operate and :admin. Two unrevoked keys never share a name. topics: the topics (or
-- patterns with *) the key may publish to, NULL for every topic but the job queues'.
-- session_generation: counted up when a person signs out of the dashboard, which ends the
-- sessions made with the key before.
CREATE TABLE workqueue.api_key (
    id            uuid PRIMARY KEY,
    name          text NOT NULL,
    prefix        text NOT NULL UNIQUE,
    key_hash      text NOT NULL,
    scopes        text[] NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz,
    revoked_at    timestamptz,
    last_used_at  timestamptz,
    topics        text[],
    session_generation integer NOT NULL DEFAULT 0
);

-- The processes that run a host (an app's lifespan or `workqueue work`). Each one writes its row
-- when its host starts and again every reconcile interval (last_seen_at), and marks it stopped when
-- its host stops; a claim records the claiming process in delivery.held_by. A process whose row
-- was not renewed within three of its beat intervals is gone (killed, or cut off from the
-- database). A row unseen for a week is deleted by the next beat of any process.
CREATE TABLE workqueue.process (
    id                     uuid PRIMARY KEY,
    hostname               text NOT NULL,
    pid                    integer NOT NULL,
    started_at             timestamptz NOT NULL,
    version                text NOT NULL,
    subscriptions          jsonb NOT NULL,
    slots                  integer NOT NULL,
    busy                   integer NOT NULL,
    beat_interval_seconds  double precision NOT NULL,
    last_seen_at           timestamptz NOT NULL,
    stopped_at             timestamptz
);
CREATE UNIQUE INDEX api_key_name_live ON workqueue.api_key (name) WHERE revoked_at IS NULL;

-- ---------------------------------------------------------------------------------------------
-- Helpers
-- ---------------------------------------------------------------------------------------------

-- Full-jitter exponential backoff, p_draw x min(p_max, p_base x 2^(attempt - 1)) with the caller's
-- draw p_draw in [0, 1) (random() when it is NULL), or the fixed schedule a delivery was
-- published with.
CREATE OR REPLACE FUNCTION workqueue.backoff_seconds(
    p_attempt integer, p_base double precision, p_max double precision, p_schedule double precision[],
    p_draw double precision DEFAULT NULL
) RETURNS double precision
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN p_schedule IS NOT NULL AND cardinality(p_schedule) > 0
            THEN p_schedule[least(greatest(p_attempt, 1), cardinality(p_schedule))]
        -- (the exponent capped at 64, as SQL Server's: a delivery retried past 1,024 attempts overflowed)
        ELSE coalesce(p_draw, random()) * least(p_max, p_base * power(2::double precision,
                                                                     least(greatest(p_attempt, 1) - 1, 64)))
    END
$$;

-- The filter subset: {"field","operator","value"} leaves with eq, neq, startswith, isnull,
-- isnotnull, combined by {"logic": "and"|"or", "filters": [...]}. Case-sensitive. An attribute
-- that is absent matches only isnull. The allowed shape is checked when a subscription is saved;
-- this only evaluates.
CREATE OR REPLACE FUNCTION workqueue.filter_matches(p_filter jsonb, p_attributes jsonb)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_child jsonb;
    v_value text;
    v_logic text;
BEGIN
    IF p_filter IS NULL OR p_filter = 'null'::jsonb THEN
        RETURN true;
    END IF;
    IF p_filter ? 'filters' THEN
        v_logic := coalesce(p_filter ->> 'logic', 'and');
        FOR v_child IN SELECT jsonb_array_elements(p_filter -> 'filters') LOOP
            IF v_logic = 'or' AND workqueue.filter_matches(v_child, p_attributes) THEN
                RETURN true;
            ELSIF v_logic = 'and' AND NOT workqueue.filter_matches(v_child, p_attributes) THEN
                RETURN false;
            END IF;
        END LOOP;
        RETURN v_logic = 'and';
    END IF;
    v_value := coalesce(p_attributes, '{}'::jsonb) ->> (p_filter ->> 'field');
    RETURN CASE p_filter ->> 'operator'
        WHEN 'eq' THEN v_value IS NOT NULL AND v_value = (p_filter ->> 'value')
        WHEN 'neq' THEN v_value IS NOT NULL AND v_value <> (p_filter ->> 'value')
        WHEN 'startswith' THEN v_value IS NOT NULL AND left(v_value, length(p_filter ->> 'value')) = (p_filter ->> 'value')
        WHEN 'isnull' THEN v_value IS NULL
        WHEN 'isnotnull' THEN v_value IS NOT NULL
        ELSE false
    END;
END
$$;

-- A rate limit ('50/s', '10/m', '3/h') in tokens per second; NULL for none.
CREATE OR REPLACE FUNCTION workqueue.rate_per_second(p_rate text)
RETURNS double precision
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT split_part(p_rate, '/', 1)::double precision
           / CASE split_part(p_rate, '/', 2) WHEN 's' THEN 1 WHEN 'm' THEN 60 ELSE 3600 END
$$;

-- ---------------------------------------------------------------------------------------------
-- Topology
-- ---------------------------------------------------------------------------------------------

-- Creates or updates a topic's definition.
CREATE OR REPLACE FUNCTION workqueue.sync_topic(
    p_name text, p_max_payload_bytes integer, p_is_fifo boolean, p_transport text DEFAULT 'database'
) RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO workqueue.topic AS t (name, transport, max_payload_bytes, is_fifo)
    VALUES (p_name, p_transport, p_max_payload_bytes, p_is_fifo)
    ON CONFLICT (name) DO UPDATE
    SET max_payload_bytes = EXCLUDED.max_payload_bytes, is_fifo = EXCLUDED.is_fifo,
        transport = EXCLUDED.transport, updated_at = now()
    WHERE (t.max_payload_bytes, t.is_fifo, t.transport)
          IS DISTINCT FROM (EXCLUDED.max_payload_bytes, EXCLUDED.is_fifo, EXCLUDED.transport)
$$;

-- Creates or updates a subscription's definition. The status (Active/Paused) is the operators'
-- and is only set when the subscription is created. Its topic never changes (a rolling deploy's
-- older processes still publish to the old one); its partition mode cannot change while it has
-- live work (its deliveries were routed for the old one).
CREATE OR REPLACE FUNCTION workqueue.sync_subscription(
    p_name text, p_topic text, p_handler_key text, p_partition_mode text,
    p_lease_seconds double precision, p_max_attempts integer,
    p_backoff_base_seconds double precision, p_backoff_max_seconds double precision,
    p_max_processing_seconds double precision, p_heartbeat_mode text, p_filter jsonb,
    p_host_type text, p_retention_seconds double precision, p_status text DEFAULT 'Active',
    p_max_in_flight integer DEFAULT NULL, p_key_concurrency integer DEFAULT NULL,
    p_rate_limit text DEFAULT NULL, p_key_rate_limit text DEFAULT NULL
) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_existing workqueue.subscription%ROWTYPE;
    v_id integer;
BEGIN
    SELECT * INTO v_existing FROM workqueue.subscription s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO workqueue.subscription (
            name, topic, handler_key, partition_mode, lease_seconds, max_attempts,
            backoff_base_seconds, backoff_max_seconds, max_processing_seconds, heartbeat_mode,
            filter, host_type, retention_seconds, status, max_in_flight, key_concurrency,
            rate_limit, key_rate_limit)
        VALUES (p_name, p_topic, p_handler_key, p_partition_mode, p_lease_seconds, p_max_attempts,
            p_backoff_base_seconds, p_backoff_max_seconds, p_max_processing_seconds, p_heartbeat_mode,
            p_filter, p_host_type, p_retention_seconds, p_status, p_max_in_flight, p_key_concurrency,
            p_rate_limit, p_key_rate_limit)
        ON CONFLICT (name) DO NOTHING
        RETURNING id INTO v_id;
        IF v_id IS NULL THEN   -- created concurrently by another process: update it instead
            RETURN workqueue.sync_subscription(p_name, p_topic, p_handler_key, p_partition_mode,
                p_lease_seconds, p_max_attempts, p_backoff_base_seconds, p_backoff_max_seconds,
                p_max_processing_seconds, p_heartbeat_mode, p_filter, p_host_type,
                p_retention_seconds, p_status, p_max_in_flight, p_key_concurrency,
                p_rate_limit, p_key_rate_limit);
        END IF;
        RETURN v_id;
    END IF;
    IF v_existing.topic <> p_topic THEN
        RAISE EXCEPTION 'subscription % is on topic % in the store, and the code puts it on topic %: a subscription does not move between topics (what processes still running the code before publish to % would reach it no more); declare a new subscription on % and retire % (`workqueue subscriptions retire %`), or retire and delete % first',
            p_name, v_existing.topic, p_topic, v_existing.topic, p_topic, p_name, p_name, p_name
            USING ERRCODE = 'object_in_use';
    END IF;
    IF v_existing.partition_mode <> p_partition_mode AND EXISTS (
        SELECT 1 FROM workqueue.delivery d
        WHERE d.subscription_id = v_existing.id AND d.status IN ('Pending', 'InFlight', 'DeadLettered')
    ) THEN
        RAISE EXCEPTION 'subscription % has live deliveries routed for partition mode %; change it to % once they are settled or discarded, or create a new subscription',
            p_name, v_existing.partition_mode, p_partition_mode USING ERRCODE = 'object_in_use';
    END IF;
    UPDATE workqueue.subscription s SET
        topic = p_topic, handler_key = p_handler_key, partition_mode = p_partition_mode,
        lease_seconds = p_lease_seconds, max_attempts = p_max_attempts,
        backoff_base_seconds = p_backoff_base_seconds, backoff_max_seconds = p_backoff_max_seconds,
        max_processing_seconds = p_max_processing_seconds, heartbeat_mode = p_heartbeat_mode,
        filter = p_filter, host_type = p_host_type, retention_seconds = p_retention_seconds,
        max_in_flight = p_max_in_flight, key_concurrency = p_key_concurrency,
        rate_limit = p_rate_limit, key_rate_limit = p_key_rate_limit,
        updated_at = now()
    WHERE s.id = v_existing.id
      AND (s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
           s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds,
           s.heartbeat_mode, s.filter, s.host_type, s.retention_seconds,
           s.max_in_flight, s.key_concurrency, s.rate_limit, s.key_rate_limit)
          IS DISTINCT FROM
          (p_topic, p_handler_key, p_partition_mode, p_lease_seconds, p_max_attempts,
           p_backoff_base_seconds, p_backoff_max_seconds, p_max_processing_seconds,
           p_heartbeat_mode, p_filter, p_host_type, p_retention_seconds,
           p_max_in_flight, p_key_concurrency, p_rate_limit, p_key_rate_limit);
    RETURN v_existing.id;
END
$$;

-- Pause (Paused) or resume (Active) a subscription; a resumed one is notified.
CREATE OR REPLACE FUNCTION workqueue.set_subscription_status(p_name text, p_status text)
RETURNS TABLE (subscription text, status text, changed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_old text;
    v_retired boolean;
BEGIN
    SELECT s.status, s.retired_at IS NOT NULL INTO v_old, v_retired
    FROM workqueue.subscription s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_status = 'Paused' AND v_retired THEN
        -- Refused (status Retired, nothing changed): a paused retired subscription would show
        -- Paused, where deliveries accrue, while it takes none.
        RETURN QUERY SELECT p_name, 'Retired'::text, false;
        RETURN;
    END IF;
    IF p_status = 'Active' THEN  -- resume takes back a retired subscription too
        SELECT CASE WHEN s.retired_at IS NOT NULL AND s.status = 'Active' THEN 'Retired' ELSE s.status END
        INTO v_old FROM workqueue.subscription s WHERE s.name = p_name;
    END IF;
    UPDATE workqueue.subscription s
    SET status = p_status, retired_at = CASE WHEN p_status = 'Active' THEN NULL ELSE s.retired_at END,
        updated_at = now()
    WHERE s.name = p_name AND (s.status <> p_status OR (p_status = 'Active' AND s.retired_at IS NOT NULL));
    IF p_status = 'Active' AND v_old <> 'Active' THEN
        PERFORM pg_notify('workqueue', (SELECT s.id::text FROM workqueue.subscription s WHERE s.name = p_name));
    END IF;
    RETURN QUERY SELECT p_name, p_status, v_old <> p_status;
END
$$;

-- Retires a subscription (retired_at): publish gives it no new delivery from the commit on, while
-- what it holds still drains (claims go on: a paused one is paused no more) and its counts stay
-- readable; listings show it Retired, and it cannot be paused. resume (set_subscription_status
-- 'Active') takes it back. changed is false when it was retired already.
CREATE OR REPLACE FUNCTION workqueue.retire_subscription(p_name text)
RETURNS TABLE (subscription text, status text, changed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_old text;
BEGIN
    SELECT CASE WHEN s.retired_at IS NOT NULL THEN 'Retired' ELSE s.status END INTO v_old
    FROM workqueue.subscription s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE workqueue.subscription s SET retired_at = now(), status = 'Active', updated_at = now()
    WHERE s.name = p_name AND s.retired_at IS NULL;
    IF v_old = 'Paused' THEN  -- it drains from now on
        PERFORM pg_notify('workqueue', (SELECT s.id::text FROM workqueue.subscription s WHERE s.name = p_name));
    END IF;
    RETURN QUERY SELECT p_name, 'Retired'::text, v_old <> 'Retired';
END
$$;

-- Discards up to p_limit Pending deliveries of a subscription (visible or waiting out a delay or a
-- backoff), oldest id first, with p_reason, counted in settled_count, their keys handed over as a
-- settle hands them; returns how many it discarded. One another transaction holds (a claim) is
-- skipped: it is InFlight, and drains.
CREATE OR REPLACE FUNCTION workqueue.discard_pending(p_subscription text, p_reason text, p_limit integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    v_count integer;
    v_keyed boolean;
BEGIN
    WITH u AS (
        UPDATE workqueue.delivery d
        SET status = 'Discarded', reason = p_reason, settled_at = now(), lease_token = NULL,
            lease_expires_at = NULL
        WHERE d.id IN (
            SELECT x.id FROM workqueue.delivery x
            JOIN workqueue.subscription s ON s.id = x.subscription_id
            WHERE s.name = p_subscription AND x.status = 'Pending'
            ORDER BY x.id
            LIMIT p_limit
            FOR UPDATE OF x SKIP LOCKED
        ) AND d.status = 'Pending'
        RETURNING d.id, d.subscription_id, d.key_mode
    ), counted AS (
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, 0, count(*)
        FROM u
        GROUP BY u.subscription_id
    )
    SELECT array_agg(u.id), count(*), bool_or(u.key_mode > 0) INTO v_ids, v_count, v_keyed
    FROM u;
    IF v_keyed THEN
        PERFORM pg_notify('workqueue', r.subscription_id::text) FROM workqueue.release_keys(v_ids) r;
    END IF;
    RETURN v_count;
END
$$;

-- Deletes a retired subscription with its ended deliveries, keys, counts and history. result:
-- Deleted, NotFound, NotRetired (retire it first), or HasDeliveries (remaining says how many are
-- still Pending, InFlight or DeadLettered: drain, discard or replay them first).
CREATE OR REPLACE FUNCTION workqueue.delete_subscription(p_name text)
RETURNS TABLE (subscription text, result text, remaining bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_id integer;
    v_retired timestamptz;
    v_live bigint;
BEGIN
    SELECT s.id, s.retired_at INTO v_id, v_retired FROM workqueue.subscription s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT p_name, 'NotFound'::text, 0::bigint;
        RETURN;
    END IF;
    IF v_retired IS NULL THEN
        RETURN QUERY SELECT p_name, 'NotRetired'::text, 0::bigint;
        RETURN;
    END IF;
    SELECT count(*) INTO v_live FROM workqueue.delivery d
    WHERE d.subscription_id = v_id AND d.status IN ('Pending', 'InFlight', 'DeadLettered');
    IF v_live > 0 THEN
        RETURN QUERY SELECT p_name, 'HasDeliveries'::text, v_live;
        RETURN;
    END IF;
    DELETE FROM workqueue.delivery d WHERE d.subscription_id = v_id;
    DELETE FROM workqueue.partition p WHERE p.subscription_id = v_id;
    DELETE FROM workqueue.partition_stale p WHERE p.subscription_id = v_id;
    DELETE FROM workqueue.rate_bucket b WHERE b.subscription_id = v_id;
    DELETE FROM workqueue.settled_count c WHERE c.subscription_id = v_id;
    DELETE FROM workqueue.stats_history h WHERE h.subscription_id = v_id;
    DELETE FROM workqueue.subscription s WHERE s.id = v_id;
    RETURN QUERY SELECT p_name, 'Deleted'::text, 0::bigint;
END
$$;

-- Retires (p_status 'Retired': retired_at), pauses ('Paused') or takes back ('Active': active and
-- not retired) a topic. A retired topic refuses new messages (TopicRetired) while its
-- subscriptions drain what they hold.
CREATE OR REPLACE FUNCTION workqueue.set_topic_status(p_name text, p_status text)
RETURNS TABLE (topic text, status text, changed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_old text;
BEGIN
    -- What this call changes: a retire, whether the topic was retired; a pause, its status; a resume,
    -- either (it un-retires too).
    SELECT CASE p_status WHEN 'Retired' THEN CASE WHEN t.retired_at IS NULL THEN 'Active' ELSE 'Retired' END
                         WHEN 'Paused' THEN t.status
                         ELSE CASE WHEN t.retired_at IS NOT NULL THEN 'Retired' ELSE t.status END END
    INTO v_old FROM workqueue.topic t WHERE t.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_status NOT IN ('Active', 'Paused', 'Retired') THEN
        RAISE EXCEPTION 'a topic''s status is Active, Paused or Retired, not %', p_status
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE workqueue.topic t
    SET status = CASE WHEN p_status = 'Retired' THEN t.status ELSE p_status END,
        retired_at = CASE WHEN p_status = 'Retired' THEN coalesce(t.retired_at, now())
                          WHEN p_status = 'Active' THEN NULL ELSE t.retired_at END,
        updated_at = now()
    WHERE t.name = p_name;
    RETURN QUERY SELECT p_name, p_status, v_old <> p_status;
END
$$;

-- Deletes a retired topic that no subscription names any more (delete them first). result:
-- Deleted, NotFound, NotRetired, or HasSubscriptions (remaining says how many).
CREATE OR REPLACE FUNCTION workqueue.delete_topic(p_name text)
RETURNS TABLE (topic text, result text, remaining bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_retired timestamptz;
    v_subscriptions bigint;
BEGIN
    SELECT t.retired_at INTO v_retired FROM workqueue.topic t WHERE t.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT p_name, 'NotFound'::text, 0::bigint;
        RETURN;
    END IF;
    IF v_retired IS NULL THEN
        RETURN QUERY SELECT p_name, 'NotRetired'::text, 0::bigint;
        RETURN;
    END IF;
    SELECT count(*) INTO v_subscriptions FROM workqueue.subscription s WHERE s.topic = p_name;
    IF v_subscriptions > 0 THEN
        RETURN QUERY SELECT p_name, 'HasSubscriptions'::text, v_subscriptions;
        RETURN;
    END IF;
    DELETE FROM workqueue.deduplication dd WHERE dd.topic = p_name;
    DELETE FROM workqueue.topic t WHERE t.name = p_name;
    RETURN QUERY SELECT p_name, 'Deleted'::text, 0::bigint;
END
$$;

-- Every subscription with its topic's status, transport and limits.
CREATE OR REPLACE FUNCTION workqueue.list_subscriptions()
RETURNS TABLE (
    id integer, name text, topic text, handler_key text, partition_mode text,
    lease_seconds double precision, max_attempts integer, backoff_base_seconds double precision,
    backoff_max_seconds double precision, max_processing_seconds double precision,
    heartbeat_mode text, filter jsonb, status text, host_type text,
    retention_seconds double precision, topic_status text, transport text, is_fifo boolean,
    max_payload_bytes integer, max_in_flight integer, key_concurrency integer, rate_limit text,
    key_rate_limit text
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT s.id, s.name, s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
           s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds,
           s.heartbeat_mode, s.filter, CASE WHEN s.status = 'Active' AND s.retired_at IS NOT NULL THEN 'Retired' ELSE s.status END, s.host_type,
           s.retention_seconds, CASE WHEN t.status = 'Active' AND t.retired_at IS NOT NULL THEN 'Retired' ELSE t.status END, t.transport,
           t.is_fifo, t.max_payload_bytes, s.max_in_flight, s.key_concurrency, s.rate_limit,
           s.key_rate_limit
    FROM workqueue.subscription s
    JOIN workqueue.topic t ON t.name = s.topic
    ORDER BY s.name
$$;

-- Every topic.
CREATE OR REPLACE FUNCTION workqueue.list_topics()
RETURNS TABLE (name text, transport text, max_payload_bytes integer, is_fifo boolean, status text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT t.name, t.transport, t.max_payload_bytes, t.is_fifo,
           CASE WHEN t.status = 'Active' AND t.retired_at IS NOT NULL THEN 'Retired' ELSE t.status END
    FROM workqueue.topic t ORDER BY t.name
$$;

-- ---------------------------------------------------------------------------------------------
-- Publish
-- ---------------------------------------------------------------------------------------------

-- Publishes a batch of messages to one topic in the caller's transaction: one delivery per
-- matching subscription, in array order. Answers no rows when every item is Accepted (the caller
-- holds the MessageIDs), else one row per item. All-or-nothing: when any item is Rejected or a
-- MessageIDConflict, nothing is written and every other item reports BatchAborted. The common
-- cases are written in plain statements; the general path (deduplication keys, stored
-- MessageIDs, keyed subscriptions) classifies first, then reads the subscriptions, inserts the
-- deliveries and locks their keys in one statement, so each delivery's key mode follows its
-- subscription as that one statement sees it (docs/design/publish-paths.md).
CREATE OR REPLACE FUNCTION workqueue.publish(
    p_topic text,
    p_message_ids uuid[],
    p_partition_keys text[],
    p_attributes jsonb[],
    p_payloads text[],
    p_payload_refs text[],
    p_correlation_ids text[],
    p_content_hashes text[],
    p_deduplication_keys text[],
    p_deduplication_ttls double precision[],
    p_delays double precision[],
    p_not_befores timestamptz[],
    p_max_attempts integer[],
    p_backoff_schedules text[],
    p_envelope_bytes integer[],
    p_priorities smallint[] DEFAULT NULL   -- NULL: every item 0
) RETURNS TABLE (idx integer, status text, message_id uuid, error_code text, error_message text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_n integer := coalesce(cardinality(p_message_ids), 0);
    v_cap integer;
    v_plain boolean;
    v_has_dedup boolean;
    v_too_large boolean;
    v_status text[];
    v_ids uuid[];
    v_accept boolean[];
    v_inserted uuid[];
    v_failed integer;
    v_failed_code text;
    v_accepted integer;
    v_count integer;
    v_notify integer[];
    v_key record;
    v_all boolean;
    v_first bigint[];
    v_retired boolean;
BEGIN
    IF v_n = 0 THEN
        RETURN;
    END IF;
    IF v_n > 1 AND cardinality(p_attributes) = 1 THEN
        -- Attributes given once are every item's: a call whose items all carry the same ones (a
        -- job's name) sends and parses them once.
        p_attributes := array_fill(p_attributes[1], ARRAY[v_n]);
    END IF;
    IF v_n > 1 AND cardinality(p_max_attempts) = 1 THEN  -- the same for max attempts (a job's tries)
        p_max_attempts := array_fill(p_max_attempts[1], ARRAY[v_n]);
    END IF;
    IF p_deduplication_keys IS NULL THEN
        -- The common case: the guard's checks for the whole call, then the messages, then their
        -- deliveries and the wake-ups. The messages go in with a plain INSERT, which costs
        -- markedly less per row than ON CONFLICT; a MessageID that is stored already (or given
        -- twice in the call) makes it fail as a whole, and the INSERT runs again with ON
        -- CONFLICT, so that what follows can tell Duplicate from MessageIDConflict as before.
        -- (The block is a subtransaction, one per call. One message without a deduplication key
        -- goes to publish_one instead, which writes it without one.)
        SELECT true INTO v_plain
        FROM workqueue.topic t
        WHERE t.name = p_topic AND t.retired_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM workqueue.subscription s
                          WHERE s.topic = t.name AND s.partition_mode <> 'None' AND s.retired_at IS NULL)
          AND (t.max_payload_bytes IS NULL
               OR NOT EXISTS (SELECT 1 FROM unnest(p_envelope_bytes) b WHERE b > t.max_payload_bytes));
        IF v_plain THEN
            BEGIN
                INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                                    correlation_id, deduplication_key, content_hash)
                SELECT x.mid, p_topic, x.pkey, coalesce(x.attrs, '{}'::jsonb), x.payload, x.ref, x.corr, NULL, x.hash
                FROM unnest(p_message_ids, p_partition_keys, p_attributes, p_payloads, p_payload_refs,
                            p_correlation_ids, p_content_hashes)
                     WITH ORDINALITY AS x(mid, pkey, attrs, payload, ref, corr, hash, i)
                ORDER BY x.i;
                v_inserted := p_message_ids;
            EXCEPTION WHEN unique_violation THEN
                WITH ins AS (
                    INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                                        correlation_id, deduplication_key, content_hash)
                    SELECT x.mid, p_topic, x.pkey, coalesce(x.attrs, '{}'::jsonb), x.payload, x.ref, x.corr, NULL, x.hash
                    FROM unnest(p_message_ids, p_partition_keys, p_attributes, p_payloads, p_payload_refs,
                                p_correlation_ids, p_content_hashes)
                         WITH ORDINALITY AS x(mid, pkey, attrs, payload, ref, corr, hash, i)
                    ORDER BY x.i
                    ON CONFLICT (id) DO NOTHING
                    RETURNING m.id
                )
                SELECT array_agg(ins.id) INTO v_inserted FROM ins;
                -- A MessageID given more than once gets its deliveries from its first item only.
                SELECT array_agg(k.i) INTO v_first
                FROM (SELECT min(x.i) AS i FROM unnest(p_message_ids) WITH ORDINALITY AS x(mid, i)
                      WHERE x.mid = ANY (v_inserted) GROUP BY x.mid) k;
            END;
            v_all := coalesce(cardinality(v_inserted), 0) = v_n;
            -- Deliveries to the subscriptions without keys (the check saw no other kind; see the
            -- path of one message above).
            WITH new_delivery AS (
                INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
                    max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at, priority)
                SELECT s.id, x.mid, x.pkey, 0,
                       coalesce(x.max_attempts, s.max_attempts), s.backoff_base_seconds, s.backoff_max_seconds,
                       CASE WHEN x.backoff IS NULL THEN NULL
                            ELSE ARRAY(SELECT b::double precision FROM jsonb_array_elements_text(x.backoff::jsonb) AS b) END,
                       greatest(now(), coalesce(x.not_before, now() + make_interval(secs => coalesce(x.delay, 0)))),
                       coalesce(x.priority, 0)
                FROM unnest(p_message_ids, p_partition_keys, p_attributes, p_max_attempts, p_backoff_schedules,
                            p_not_befores, p_delays, p_priorities)
                     WITH ORDINALITY AS x(mid, pkey, attrs, max_attempts, backoff, not_before, delay, priority, i)
                JOIN workqueue.subscription s ON s.topic = p_topic AND s.partition_mode = 'None' AND s.retired_at IS NULL
                WHERE (v_all OR x.i = ANY (v_first))
                  AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, x.attrs))
                ORDER BY x.i, s.id
                RETURNING subscription_id, visible_at
            )
            SELECT count(pg_notify('workqueue', w.sid::text)) INTO v_count
            FROM (SELECT DISTINCT nd.subscription_id AS sid FROM new_delivery nd WHERE nd.visible_at <= now()) w;
            IF v_all THEN
                RETURN;  -- no rows: every item was Accepted (the caller knows their MessageIDs)
            END IF;
            -- Some items repeat a stored message (or an earlier item of the call): Duplicate when
            -- the content is the same, else the call is refused and what it wrote is taken back.
            WITH item AS (
                SELECT x.i::integer AS i, x.mid, x.hash,
                       min(x.i) OVER (PARTITION BY x.mid) AS first_by_id
                FROM unnest(p_message_ids, p_content_hashes) WITH ORDINALITY AS x(mid, hash, i)
            ), classified AS (
                SELECT it.i, it.mid,
                       CASE WHEN it.first_by_id = it.i AND it.mid = ANY (v_inserted) THEN 'Accepted'
                            WHEN s.content_hash = it.hash AND s.topic = p_topic THEN 'Duplicate'
                            ELSE 'MessageIDConflict' END AS st
                FROM item it
                LEFT JOIN workqueue.message s ON s.id = it.mid AND s.id = ANY (p_message_ids)
            )
            SELECT array_agg(c.st ORDER BY c.i), array_agg(c.mid ORDER BY c.i),
                   min(c.i) FILTER (WHERE c.st = 'MessageIDConflict')
            INTO v_status, v_ids, v_failed
            FROM classified c;
            IF v_failed IS NOT NULL THEN
                DELETE FROM workqueue.delivery d WHERE d.message_id = ANY (v_inserted);
                DELETE FROM workqueue.message m WHERE m.id = ANY (v_inserted);
                RETURN QUERY
                SELECT x.i::integer,
                       CASE WHEN x.st = 'MessageIDConflict' THEN x.st ELSE 'Rejected' END,
                       x.mid,
                       CASE WHEN x.st = 'MessageIDConflict' THEN x.st ELSE 'BatchAborted' END,
                       CASE WHEN x.st = 'MessageIDConflict'
                            THEN 'a message with this MessageID and different content, or on another topic, was already published; use a new MessageID for new content'
                            ELSE format('not published: item %s of this call was refused (MessageIDConflict) and a publish call is all-or-nothing',
                                        v_failed - 1) END
                FROM unnest(v_status, v_ids) WITH ORDINALITY AS x(st, mid, i);
                RETURN;
            END IF;
            RETURN QUERY SELECT x.i::integer, x.st, x.mid, NULL::text, NULL::text
            FROM unnest(v_status, v_ids) WITH ORDINALITY AS x(st, mid, i);
            RETURN;
        END IF;
        -- The guard failed, so nothing was written: an unknown topic, a keyed subscription, or an
        -- item over the topic's cap. The paths below tell which and answer.
    END IF;
    SELECT t.max_payload_bytes,
           EXISTS (SELECT 1 FROM unnest(p_deduplication_keys) k WHERE k IS NOT NULL),
           t.max_payload_bytes IS NOT NULL AND EXISTS (SELECT 1 FROM unnest(p_envelope_bytes) b WHERE b > t.max_payload_bytes),
           t.retired_at IS NOT NULL
    INTO v_cap, v_has_dedup, v_too_large, v_retired
    FROM workqueue.topic t WHERE t.name = p_topic;
    IF NOT FOUND THEN
        RETURN QUERY SELECT i::integer, 'Rejected'::text, m, 'UnknownTopic'::text,
            format('topic %L does not exist; declare it in the WorkQueue topics or create it first', p_topic)
        FROM unnest(p_message_ids) WITH ORDINALITY AS x(m, i);
        RETURN;
    END IF;
    IF v_retired THEN
        IF NOT EXISTS (SELECT 1 FROM unnest(p_message_ids, p_content_hashes) AS x(mid, hash)
                       WHERE NOT EXISTS (SELECT 1 FROM workqueue.message s
                                         WHERE s.id = x.mid AND s.topic = p_topic AND s.content_hash = x.hash)) THEN
            -- Every item repeats a message the topic took before it retired: a producer's retry,
            -- answered as before (Duplicate), so that it does not take what it stored for lost.
            RETURN QUERY SELECT i::integer, 'Duplicate'::text, m, NULL::text, NULL::text
            FROM unnest(p_message_ids) WITH ORDINALITY AS x(m, i);
            RETURN;
        END IF;
        RETURN QUERY SELECT i::integer, 'Rejected'::text, m, 'TopicRetired'::text,
            format('topic %L is retired and takes no new messages; publish to the topic that replaced it, '
                   'or take it back with `workqueue topics resume %s`', p_topic, p_topic)
        FROM unnest(p_message_ids) WITH ORDINALITY AS x(m, i);
        RETURN;
    END IF;


    IF NOT v_has_dedup AND NOT v_too_large THEN
        -- Fast path: write, then look at the items that clashed with a stored message.
        WITH ins AS (
            INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                                correlation_id, deduplication_key, content_hash)
            SELECT x.mid, p_topic, x.pkey, coalesce(x.attrs, '{}'::jsonb), x.payload, x.ref, x.corr, NULL, x.hash
            FROM unnest(p_message_ids, p_partition_keys, p_attributes, p_payloads, p_payload_refs,
                        p_correlation_ids, p_content_hashes)
                 WITH ORDINALITY AS x(mid, pkey, attrs, payload, ref, corr, hash, i)
            ORDER BY x.i
            ON CONFLICT (id) DO NOTHING
            RETURNING m.id
        )
        SELECT array_agg(ins.id) INTO v_inserted FROM ins;
        v_count := coalesce(cardinality(v_inserted), 0);

        IF v_count = v_n THEN
            v_status := array_fill('Accepted'::text, ARRAY[v_n]);
            v_ids := p_message_ids;
            v_accept := array_fill(true, ARRAY[v_n]);
        ELSE
            -- An item is accepted when this call inserted it and it is the first with its id; the
            -- others repeat a stored message (or an earlier item): same content, Duplicate.
            WITH item AS (
                SELECT x.i::integer AS i, x.mid, x.hash,
                       min(x.i) OVER (PARTITION BY x.mid) AS first_by_id
                FROM unnest(p_message_ids, p_content_hashes) WITH ORDINALITY AS x(mid, hash, i)
            ), classified AS (
                SELECT it.i, it.mid,
                       CASE WHEN it.first_by_id = it.i AND it.mid = ANY (v_inserted) THEN 'Accepted'
                            WHEN s.content_hash = it.hash AND s.topic = p_topic THEN 'Duplicate'
                            ELSE 'MessageIDConflict' END AS st
                FROM item it
                LEFT JOIN workqueue.message s ON s.id = it.mid AND s.id = ANY (p_message_ids)
            )
            SELECT array_agg(c.st ORDER BY c.i), array_agg(c.mid ORDER BY c.i),
                   array_agg(c.st = 'Accepted' ORDER BY c.i),
                   min(c.i) FILTER (WHERE c.st = 'MessageIDConflict')
            INTO v_status, v_ids, v_accept, v_failed
            FROM classified c;
            IF v_failed IS NOT NULL THEN
                DELETE FROM workqueue.message m WHERE m.id = ANY (v_inserted);
                RETURN QUERY
                SELECT x.i::integer,
                       CASE WHEN x.st = 'MessageIDConflict' THEN x.st ELSE 'Rejected' END,
                       x.mid,
                       CASE WHEN x.st = 'MessageIDConflict' THEN x.st ELSE 'BatchAborted' END,
                       CASE WHEN x.st = 'MessageIDConflict'
                            THEN 'a message with this MessageID and different content, or on another topic, was already published; use a new MessageID for new content'
                            ELSE format('not published: item %s of this call was refused (MessageIDConflict) and a publish call is all-or-nothing',
                                        v_failed - 1) END
                FROM unnest(v_status, v_ids) WITH ORDINALITY AS x(st, mid, i);
                RETURN;
            END IF;
        END IF;
        v_accepted := v_count;
    ELSE
        -- Classify every item before writing anything: refused (too large), a repeat of an earlier
        -- item or of a stored message (Duplicate or MessageIDConflict), a live deduplication key.
        WITH item AS (
            SELECT x.i::integer AS i, x.mid, x.hash, x.dkey, x.bytes,
                   min(x.i) OVER (PARTITION BY x.mid) AS first_by_id,
                   first_value(x.hash) OVER (PARTITION BY x.mid ORDER BY x.i) AS first_hash
            FROM unnest(p_message_ids, p_content_hashes, p_deduplication_keys, p_envelope_bytes)
                 WITH ORDINALITY AS x(mid, hash, dkey, bytes, i)
        ), stored AS (
            SELECT m.id, m.topic, m.content_hash FROM workqueue.message m WHERE m.id = ANY (p_message_ids)
        ), live_key AS (
            SELECT dd.deduplication_key, dd.message_id FROM workqueue.deduplication dd
            WHERE v_has_dedup AND dd.topic = p_topic AND dd.deduplication_key = ANY (p_deduplication_keys)
              AND dd.expires_at > now()
        ), first_pass AS (
            SELECT it.i, it.mid, it.dkey,
                CASE
                    WHEN v_cap IS NOT NULL AND it.bytes > v_cap THEN 'Rejected'
                    WHEN it.first_by_id < it.i AND it.first_hash = it.hash THEN 'Duplicate'
                    WHEN it.first_by_id < it.i THEN 'MessageIDConflict'
                    WHEN s.id IS NOT NULL AND s.content_hash = it.hash AND s.topic = p_topic THEN 'Duplicate'
                    WHEN s.id IS NOT NULL THEN 'MessageIDConflict'
                    WHEN lk.message_id IS NOT NULL THEN 'Duplicate'
                    ELSE 'Accepted'
                END AS st,
                CASE
                    WHEN v_cap IS NOT NULL AND it.bytes > v_cap THEN it.mid
                    WHEN it.first_by_id < it.i OR s.id IS NOT NULL THEN it.mid
                    WHEN lk.message_id IS NOT NULL THEN lk.message_id
                    ELSE it.mid
                END AS result_id
            FROM item it
            LEFT JOIN stored s ON s.id = it.mid
            LEFT JOIN live_key lk ON lk.deduplication_key = it.dkey
        ), key_taken AS (
            -- A key of the call is taken by its first item that is written; an item refused or a
            -- Duplicate by its MessageID takes none (the rule of core/lifecycle.py classify_batch).
            SELECT f.dkey, min(f.i) AS first_i, (array_agg(f.mid ORDER BY f.i))[1] AS first_mid
            FROM first_pass f
            WHERE f.st = 'Accepted' AND f.dkey IS NOT NULL
            GROUP BY f.dkey
        ), classified AS (
            SELECT f.i,
                   CASE WHEN k.first_i < f.i THEN 'Duplicate' ELSE f.st END AS st,
                   CASE WHEN k.first_i < f.i THEN k.first_mid ELSE f.result_id END AS result_id
            FROM first_pass f
            LEFT JOIN key_taken k ON k.dkey = f.dkey AND f.st = 'Accepted'
        )
        SELECT array_agg(c.st ORDER BY c.i), array_agg(c.result_id ORDER BY c.i),
               array_agg(c.st = 'Accepted' ORDER BY c.i),
               min(c.i) FILTER (WHERE c.st IN ('Rejected', 'MessageIDConflict')),
               count(*) FILTER (WHERE c.st = 'Accepted')
        INTO v_status, v_ids, v_accept, v_failed, v_accepted
        FROM classified c;

        IF v_failed IS NOT NULL THEN
            v_failed_code := CASE v_status[v_failed] WHEN 'Rejected' THEN 'EnvelopeTooLarge' ELSE 'MessageIDConflict' END;
            RETURN QUERY
            SELECT x.i::integer,
                CASE WHEN x.st IN ('Rejected', 'MessageIDConflict') THEN x.st ELSE 'Rejected' END,
                x.mid,
                CASE x.st WHEN 'Rejected' THEN 'EnvelopeTooLarge' WHEN 'MessageIDConflict' THEN 'MessageIDConflict'
                          ELSE 'BatchAborted' END,
                CASE x.st
                    WHEN 'Rejected' THEN format('the envelope is %s bytes; topic %L accepts at most %s bytes (max_payload_bytes); send a PayloadRef to the data instead',
                                                x.bytes, p_topic, v_cap)
                    WHEN 'MessageIDConflict' THEN 'a message with this MessageID and different content, or on another topic, was already published; use a new MessageID for new content'
                    ELSE format('not published: item %s of this call was refused (%s) and a publish call is all-or-nothing',
                                v_failed - 1, v_failed_code) END
            FROM unnest(v_status, v_ids, p_envelope_bytes) WITH ORDINALITY AS x(st, mid, bytes, i);
            RETURN;
        END IF;

        IF v_accepted > 0 THEN
            INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                                correlation_id, deduplication_key, content_hash)
            SELECT x.mid, p_topic, x.pkey, coalesce(x.attrs, '{}'::jsonb), x.payload, x.ref, x.corr, x.dkey, x.hash
            FROM unnest(v_accept, p_message_ids, p_partition_keys, p_attributes, p_payloads, p_payload_refs,
                        p_correlation_ids, p_deduplication_keys, p_content_hashes)
                 WITH ORDINALITY AS x(ok, mid, pkey, attrs, payload, ref, corr, dkey, hash, i)
            WHERE x.ok
            ORDER BY x.i
            ON CONFLICT (id) DO NOTHING;
            GET DIAGNOSTICS v_count = ROW_COUNT;
            IF v_count <> v_accepted THEN
                RAISE EXCEPTION 'a message with the same MessageID was published concurrently; retry the publish'
                    USING ERRCODE = 'serialization_failure';
            END IF;

            INSERT INTO workqueue.deduplication AS dd (topic, deduplication_key, message_id, expires_at)
            SELECT p_topic, x.dkey, x.mid, now() + make_interval(secs => coalesce(x.ttl, 300))
            FROM unnest(v_accept, p_deduplication_keys, p_message_ids, p_deduplication_ttls) AS x(ok, dkey, mid, ttl)
            WHERE x.ok AND x.dkey IS NOT NULL
            ORDER BY x.dkey
            ON CONFLICT (topic, deduplication_key) DO UPDATE
            SET message_id = EXCLUDED.message_id, expires_at = EXCLUDED.expires_at
            WHERE dd.expires_at <= now();
            GET DIAGNOSTICS v_count = ROW_COUNT;
            IF v_count <> (SELECT count(*) FROM unnest(v_accept, p_deduplication_keys) AS x(ok, dkey)
                           WHERE x.ok AND x.dkey IS NOT NULL) THEN
                RAISE EXCEPTION 'a message with the same DeduplicationKey was published concurrently; retry the publish'
                    USING ERRCODE = 'serialization_failure';
            END IF;
        END IF;
    END IF;

    IF v_accepted > 0 THEN
        -- One statement reads the subscriptions once and does all of it: it computes each
        -- delivery's key mode from its subscription's partition mode as that statement sees it,
        -- locks (creating where needed) the key of every keyed delivery, in key order, and inserts
        -- the deliveries; a keyed delivery is only formed from its key's locked row, so its id is
        -- taken after the lock: ids follow commit order within a key. Nothing is decided by an
        -- earlier statement, which saw the subscriptions as they were before this call waited.
        FOR v_key IN
            WITH target AS MATERIALIZED (
                SELECT x.i, s.id AS sid, x.mid, x.pkey,
                       (CASE WHEN x.pkey IS NULL OR s.partition_mode = 'None' THEN 0
                             WHEN s.partition_mode = 'Exclusive' THEN 1 ELSE 2 END)::smallint AS key_mode,
                       coalesce(x.max_attempts, s.max_attempts) AS max_attempts,
                       s.backoff_base_seconds, s.backoff_max_seconds,
                       CASE WHEN x.backoff IS NULL THEN NULL
                            ELSE ARRAY(SELECT b::double precision FROM jsonb_array_elements_text(x.backoff::jsonb) AS b) END
                           AS backoff_schedule,
                       greatest(now(), coalesce(x.not_before, now() + make_interval(secs => coalesce(x.delay, 0))))
                           AS visible_at,
                       coalesce(x.priority, 0)::smallint AS priority
                FROM unnest(v_accept, p_message_ids, p_partition_keys, p_attributes, p_max_attempts,
                            p_backoff_schedules, p_not_befores, p_delays, p_priorities)
                     WITH ORDINALITY AS x(ok, mid, pkey, attrs, max_attempts, backoff, not_before, delay, priority, i)
                JOIN workqueue.subscription s ON s.topic = p_topic AND s.retired_at IS NULL
                WHERE x.ok AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, x.attrs))
            ), locked AS (
                INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
                SELECT DISTINCT t.sid, t.pkey FROM target t WHERE t.key_mode > 0
                ORDER BY 1, 2
                ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id
                RETURNING p.subscription_id, p.partition_key
            ), new_delivery AS (
                INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
                    max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at, priority)
                SELECT t.sid, t.mid, t.pkey, t.key_mode, t.max_attempts, t.backoff_base_seconds,
                       t.backoff_max_seconds, t.backoff_schedule, t.visible_at, t.priority
                FROM target t
                LEFT JOIN locked l ON l.subscription_id = t.sid AND l.partition_key = t.pkey
                WHERE t.key_mode = 0 OR l.subscription_id IS NOT NULL
                ORDER BY t.i, t.sid
                RETURNING id, subscription_id, partition_key, key_mode, visible_at, priority
            )
            -- One row per subscription with immediately visible unkeyed work (to notify), and one
            -- per key that got work: its first new delivery (Ordered) or its earliest (Exclusive).
            SELECT DISTINCT ON (nd.subscription_id, nd.partition_key)
                   nd.subscription_id, nd.partition_key, nd.key_mode, nd.id, nd.visible_at, nd.priority
            FROM new_delivery nd
            WHERE nd.key_mode > 0 OR nd.visible_at <= now()
            ORDER BY nd.subscription_id, nd.partition_key, nd.key_mode DESC,
                     CASE WHEN nd.key_mode = 1 THEN nd.visible_at END, nd.id
        LOOP
            IF v_key.key_mode = 0 THEN
                v_notify := array_append(v_notify, v_key.subscription_id);
                CONTINUE;
            END IF;
            -- The key's row is this transaction's since the statement above.
            UPDATE workqueue.partition p
            SET next_id = v_key.id, next_visible_at = v_key.visible_at, next_priority = v_key.priority
            WHERE p.subscription_id = v_key.subscription_id AND p.partition_key = v_key.partition_key
              AND p.holder_id IS NULL
              AND ((v_key.key_mode = 2 AND p.next_id IS NULL AND p.blocked_id IS NULL)
                   OR (v_key.key_mode = 1 AND (p.next_id IS NULL OR v_key.visible_at < p.next_visible_at)));
            IF FOUND AND v_key.visible_at <= now() THEN
                v_notify := array_append(v_notify, v_key.subscription_id);
            END IF;
        END LOOP;

        IF v_notify IS NOT NULL THEN
            PERFORM pg_notify('workqueue', sid::text) FROM (SELECT DISTINCT unnest(v_notify) AS sid) x;
        END IF;
    END IF;

    RETURN QUERY SELECT x.i::integer, x.st, x.mid, NULL::text, NULL::text
    FROM unnest(v_status, v_ids) WITH ORDINALITY AS x(st, mid, i);
END
$$;

-- publish for one message without a deduplication key, with a value per parameter: the same rows
-- and answers as publish. It writes the message and its deliveries to every kind of subscription
-- itself, keys locked and pointed at as publish does; an unknown topic, a message over the cap or a
-- stored MessageID it hands to publish, which tells which.
--
-- p_quiet false: the subscriptions with work to claim now are notified in this transaction, and an
-- Accepted message answers no rows. What the transport calls inside a transaction whose commit it
-- cannot wait for (a settle's follow-ups, a caller's AsyncConnection), and for a publish in a
-- transaction of its own while no other such publish of the process is under way.
-- p_quiet true: no NOTIFY (one in the publishing transaction makes concurrent commits wait for each
-- other's flush; docs/design/publish-paths.md): an Accepted message with work to claim now answers
-- one row (status Accepted) whose wake_subscriptions the caller notifies once the transaction has
-- committed; no rows when Accepted with nobody to wake.
--
-- The functions of an order's path (publish, publish_one, claim, claim_many, heartbeat, settle and
-- the key handling below) run with plan_cache_mode = force_generic_plan and enable_seqscan = off:
-- each statement is planned once per session, on the indexes it was written for, instead of again
-- on every call with the call's values.
CREATE OR REPLACE FUNCTION workqueue.publish_one(
    p_topic text,
    p_message_id uuid,
    p_partition_key text,
    p_attributes jsonb,
    p_payload text,
    p_payload_ref text,
    p_correlation_id text,
    p_content_hash text,
    p_delay double precision,
    p_not_before timestamptz,
    p_max_attempts integer,
    p_backoff_schedule text,
    p_envelope_bytes integer,
    p_priority smallint DEFAULT NULL,  -- NULL: 0
    p_quiet boolean DEFAULT false
) RETURNS TABLE (idx integer, status text, message_id uuid, error_code text, error_message text,
                wake_subscriptions integer[])
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_visible timestamptz;
    v_backoff double precision[];
    v_sids integer[];
    v_ids bigint[];
    v_modes smallint[];
    v_notify integer[];
    v_wake integer[];
BEGIN
    -- The message INSERT carries the guard: the topic exists and the message is within its cap.
    INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                        correlation_id, deduplication_key, content_hash)
    SELECT p_message_id, p_topic, p_partition_key, coalesce(p_attributes, '{}'::jsonb),
           p_payload, p_payload_ref, p_correlation_id, NULL, p_content_hash
    FROM workqueue.topic t
    WHERE t.name = p_topic AND t.retired_at IS NULL
      AND (t.max_payload_bytes IS NULL OR p_envelope_bytes <= t.max_payload_bytes)
    ON CONFLICT (id) DO NOTHING;
    IF NOT FOUND THEN
        -- Not written: the guard failed or the MessageID is stored already. publish tells which. Its
        -- deduplication keys go as an array of one NULL, not as NULL: publish then takes its general
        -- path at once (an array of NULLs takes the longer way to the same answers).
        RETURN QUERY
        SELECT r.*, NULL::integer[] FROM workqueue.publish(
            p_topic, ARRAY[p_message_id], ARRAY[p_partition_key], ARRAY[p_attributes], ARRAY[p_payload],
            ARRAY[p_payload_ref], ARRAY[p_correlation_id], ARRAY[p_content_hash], ARRAY[NULL::text], NULL,
            ARRAY[p_delay], ARRAY[p_not_before], ARRAY[p_max_attempts], ARRAY[p_backoff_schedule],
            ARRAY[p_envelope_bytes], ARRAY[p_priority]) AS r;
        RETURN;
    END IF;
    v_visible := CASE WHEN p_not_before IS NULL AND p_delay IS NULL THEN now()
                      ELSE greatest(now(), coalesce(p_not_before, now() + make_interval(secs => coalesce(p_delay, 0)))) END;
    IF p_backoff_schedule IS NOT NULL THEN
        v_backoff := ARRAY(SELECT b::double precision FROM jsonb_array_elements_text(p_backoff_schedule::jsonb) AS b);
    END IF;

    IF p_partition_key IS NULL THEN
        -- Without a key (the common call) every delivery is claimed on its own and there is no
        -- key to lock: one plain INSERT, without the keyed path's statement and its key upserts
        -- (some 10-20 us of the server's ~210 us for the call, bench/README.md).
        INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
            max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at, priority)
        SELECT s.id, p_message_id, NULL, 0, coalesce(p_max_attempts, s.max_attempts), s.backoff_base_seconds,
               s.backoff_max_seconds, v_backoff, v_visible, coalesce(p_priority, 0)
        FROM workqueue.subscription s
        WHERE s.topic = p_topic AND s.retired_at IS NULL
          AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes))
        ORDER BY s.id;
        -- Whom to wake comes from a second read of the subscriptions, one statement either way:
        -- cheaper than the deliveries' RETURNING (about 15 us a call notifying; the same quiet). A
        -- subscription changed in between is woken for nothing, or finds its work at its next poll.
        IF v_visible <= now() AND NOT p_quiet THEN
            PERFORM pg_notify('workqueue', s.id::text)
            FROM workqueue.subscription s
            WHERE s.topic = p_topic AND s.retired_at IS NULL
              AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes));
        ELSIF v_visible <= now() THEN  -- the caller wakes them once the transaction has committed
            RETURN QUERY
            SELECT 1, 'Accepted'::text, p_message_id, NULL::text, NULL::text, array_agg(s.id ORDER BY s.id)
            FROM workqueue.subscription s
            WHERE s.topic = p_topic AND s.retired_at IS NULL
              AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes))
            HAVING count(*) > 0;
        END IF;
        RETURN;  -- no rows: Accepted (quiet: with nobody to wake now)
    END IF;

    -- With a key, one statement reads the subscriptions once, locks the key of every keyed delivery
    -- (in subscription order, as publish does) and inserts the deliveries, each keyed one formed
    -- from its key's locked row: its id is taken after the lock.
    WITH target AS MATERIALIZED (
        SELECT s.id AS sid,
               (CASE s.partition_mode WHEN 'None' THEN 0 WHEN 'Exclusive' THEN 1 ELSE 2 END)::smallint AS key_mode,
               coalesce(p_max_attempts, s.max_attempts) AS max_attempts,
               s.backoff_base_seconds, s.backoff_max_seconds
        FROM workqueue.subscription s
        WHERE s.topic = p_topic AND s.retired_at IS NULL
          AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes))
    ), locked AS (
        INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
        SELECT t.sid, p_partition_key FROM target t WHERE t.key_mode > 0
        ORDER BY 1
        ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id
        RETURNING p.subscription_id
    ), new_delivery AS (
        INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
            max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at, priority)
        SELECT t.sid, p_message_id, p_partition_key, t.key_mode, t.max_attempts, t.backoff_base_seconds,
               t.backoff_max_seconds, v_backoff, v_visible, coalesce(p_priority, 0)
        FROM target t
        LEFT JOIN locked l ON l.subscription_id = t.sid
        WHERE t.key_mode = 0 OR l.subscription_id IS NOT NULL
        ORDER BY t.sid
        RETURNING id, subscription_id, key_mode
    )
    SELECT array_agg(nd.subscription_id), array_agg(nd.id), array_agg(nd.key_mode)
    INTO v_sids, v_ids, v_modes
    FROM new_delivery nd;

    IF 0 < ANY (v_modes) THEN
        -- A key with nothing to run (no holder; Ordered: nothing ahead and no dead-lettered head;
        -- Exclusive: nothing due sooner) gets the new delivery as its next one. Its row is this
        -- transaction's since the statement above.
        WITH pointed AS (
            UPDATE workqueue.partition p
            SET next_id = x.id, next_visible_at = v_visible, next_priority = coalesce(p_priority, 0)
            FROM unnest(v_sids, v_ids, v_modes) AS x(sid, id, mode)
            WHERE x.mode > 0 AND p.subscription_id = x.sid AND p.partition_key = p_partition_key
              AND p.holder_id IS NULL
              AND ((x.mode = 2 AND p.next_id IS NULL AND p.blocked_id IS NULL)
                   OR (x.mode = 1 AND (p.next_id IS NULL OR v_visible < p.next_visible_at)))
            RETURNING p.subscription_id
        )
        SELECT array_agg(pointed.subscription_id) INTO v_notify FROM pointed;
    END IF;
    IF v_visible <= now() THEN
        -- The subscriptions with work to claim now: its unkeyed delivery, or a key it can claim.
        SELECT array_agg(x.sid ORDER BY x.sid) INTO v_wake
        FROM unnest(v_sids, v_modes) AS x(sid, mode)
        WHERE x.mode = 0 OR x.sid = ANY (v_notify);
        IF v_wake IS NOT NULL AND NOT p_quiet THEN
            PERFORM pg_notify('workqueue', sid::text) FROM unnest(v_wake) AS sid;
        ELSIF v_wake IS NOT NULL THEN  -- the caller wakes them once the transaction has committed
            RETURN QUERY SELECT 1, 'Accepted'::text, p_message_id, NULL::text, NULL::text, v_wake;
        END IF;
    END IF;
    RETURN;  -- no rows: Accepted (quiet: with nobody to wake)
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Claim, heartbeat, settle
-- ---------------------------------------------------------------------------------------------

-- Each of these reads the time once: p_now when the caller gives it (a test's clock), else now(),
-- the start of its transaction (docs/design/time.md).

-- Claims up to p_limit visible deliveries of an Active subscription: attempt + 1, a fresh lease
-- token, the lease from the subscription's lease_seconds. The highest priority first, then the
-- earliest due. Keys of Exclusive and Ordered subscriptions are claimed through their partition
-- row (SKIP LOCKED), one delivery per key, by the priority of the key's next delivery, after the
-- keys left stale are re-derived; deliveries without a key share the claim with them.
CREATE OR REPLACE FUNCTION workqueue.claim(p_subscription text, p_limit integer, p_holder uuid DEFAULT NULL,
                                          p_now timestamptz DEFAULT NULL, p_lease_seconds double precision DEFAULT NULL)
RETURNS TABLE (
    delivery_id bigint, lease_token uuid, attempt integer, max_attempts integer,
    lease_expires_at timestamptz, message_id uuid, topic text, partition_key text,
    attributes jsonb, payload text, payload_ref text, correlation_id text,
    published_at timestamptz, held_back text, retry_after double precision
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());  -- p_now: a test's clock
    v_sub record;
    v_limit integer := p_limit;  -- what this claim may take: less than p_limit under a flow limit
    v_keyed bigint[];
    v_keys text[];
    v_more bigint[];
    v_more_keys text[];
    v_unkeyed bigint[];
    v_share integer;
    v_ids bigint[];
    v_got integer := 0;
    v_key text;
    -- flow limits (docs/design/flow-control.md)
    v_held text;            -- the limit that kept claimable work back
    v_retry double precision;
    v_busy integer;
    v_rate double precision;
    v_tokens double precision;
    v_key_rate double precision;
    v_key_limited boolean := false;
    v_default_room integer;
    v_room_keys text[];     -- keys whose room is below v_default_room, and their room
    v_rooms integer[];
    v_blocked text[];       -- keys with no room at all
    v_key_spent boolean;    -- a key's bucket holds no whole token
    v_fullest double precision;
BEGIN
    SELECT s.id, s.partition_mode, s.lease_seconds, s.max_in_flight, s.rate_limit, s.key_rate_limit,
           CASE WHEN s.partition_mode = 'None' THEN s.key_concurrency END AS key_concurrency,
           (s.max_in_flight IS NOT NULL OR s.rate_limit IS NOT NULL OR s.key_rate_limit IS NOT NULL
            OR (s.key_concurrency IS NOT NULL AND s.partition_mode = 'None')) AS limited,
           -- Deliveries without a key that have a priority (one probe of an index that is empty
           -- while nobody publishes with a priority), read with the subscription: no statement more.
           EXISTS (SELECT 1 FROM workqueue.delivery d
                   WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0 AND d.priority > 0
                  ) AS prioritized
    INTO v_sub
    FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic
    WHERE s.name = p_subscription AND s.status = 'Active' AND t.status = 'Active';
    IF NOT FOUND OR p_limit < 1 THEN
        RETURN;
    END IF;

    IF v_sub.limited THEN
        -- One claim of a limited subscription at a time, across every process: the lock is the
        -- transaction's, gone at its commit, when what it claimed is InFlight for the next one to
        -- count. Subscriptions without limits never take it.
        PERFORM pg_advisory_xact_lock(hashtext('workqueue.claim'), v_sub.id);
        -- The time as of the lock, not of the call: a claim that waited for it must not set a
        -- bucket's time back behind the claim before it, or the next one refills that time twice.
        IF p_now IS NULL THEN
            v_now := clock_timestamp();
        END IF;
        IF v_sub.max_in_flight IS NOT NULL THEN
            -- A holder that died holds its slot until its lease runs out.
            SELECT count(*) INTO v_busy FROM workqueue.delivery d
            WHERE d.subscription_id = v_sub.id AND d.status = 'InFlight' AND d.lease_expires_at > v_now;
            IF v_sub.max_in_flight - v_busy < v_limit THEN
                v_limit := greatest(v_sub.max_in_flight - v_busy, 0);
                v_held := 'MaxInFlight';
            END IF;
        END IF;
        IF v_sub.rate_limit IS NOT NULL THEN
            v_rate := workqueue.rate_per_second(v_sub.rate_limit);
            SELECT least(greatest(1, v_rate), b.tokens + greatest(0, extract(epoch FROM v_now - b.updated_at)) * v_rate)
            INTO v_tokens
            FROM workqueue.rate_bucket b
            WHERE b.subscription_id = v_sub.id AND NOT b.per_key AND b.partition_key = '';
            v_tokens := coalesce(v_tokens, greatest(1, v_rate));
            IF floor(v_tokens) < v_limit THEN
                v_limit := floor(v_tokens)::integer;
                v_held := 'RateLimit';
            END IF;
        END IF;
        IF v_sub.key_concurrency IS NOT NULL OR v_sub.key_rate_limit IS NOT NULL THEN
            -- Each key's room: key_concurrency less its InFlight deliveries, and the whole tokens of
            -- its bucket. Only keys below the default room are listed; a key without a bucket has
            -- a full one.
            v_key_limited := true;
            v_key_rate := workqueue.rate_per_second(v_sub.key_rate_limit);
            v_default_room := least(coalesce(v_sub.key_concurrency, 2147483647),
                                    CASE WHEN v_key_rate IS NULL THEN 2147483647
                                         ELSE floor(greatest(1, v_key_rate))::integer END);
            WITH busy AS (
                SELECT d.partition_key AS k, count(*)::integer AS n FROM workqueue.delivery d
                WHERE v_sub.key_concurrency IS NOT NULL AND d.subscription_id = v_sub.id
                  AND d.status = 'InFlight' AND d.lease_expires_at > v_now AND d.partition_key IS NOT NULL
                GROUP BY d.partition_key
            ), bucket AS (
                SELECT b.partition_key AS k,
                       least(greatest(1, v_key_rate),
                             b.tokens + greatest(0, extract(epoch FROM v_now - b.updated_at)) * v_key_rate) AS t
                FROM workqueue.rate_bucket b
                WHERE v_key_rate IS NOT NULL AND b.subscription_id = v_sub.id AND b.per_key
            ), room AS (
                SELECT coalesce(busy.k, bucket.k) AS k, bucket.t,
                       least(coalesce(v_sub.key_concurrency - busy.n, 2147483647),
                             coalesce(floor(bucket.t)::integer, 2147483647)) AS n
                FROM busy FULL JOIN bucket ON bucket.k = busy.k
            )
            SELECT array_agg(r.k) FILTER (WHERE r.n < v_default_room),
                   array_agg(greatest(r.n, 0)) FILTER (WHERE r.n < v_default_room),
                   array_agg(r.k) FILTER (WHERE r.n <= 0),
                   bool_or(r.n <= 0 AND floor(r.t) < 1)
            INTO v_room_keys, v_rooms, v_blocked, v_key_spent
            FROM room r;
        END IF;
    END IF;

    IF v_limit > 0 AND v_sub.partition_mode <> 'None' THEN
        -- Keys a settle or the sweeper could not hand over (their producer held them) are
        -- re-derived first, where nobody holds them now; the table is empty but under contention.
        IF EXISTS (SELECT 1 FROM workqueue.partition_stale ps WHERE ps.subscription_id = v_sub.id) THEN
            PERFORM workqueue.rederive_stale(ARRAY[v_sub.id], v_limit);
        END IF;
        -- Keys that can run now: their partition row is the lock. Those whose next delivery has a
        -- priority come first, level by level (one probe of an index that is empty without them).
        -- A key a rate limit holds back (v_blocked) is passed over.
        IF EXISTS (SELECT 1 FROM workqueue.partition pt
                   WHERE pt.subscription_id = v_sub.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
                     AND pt.next_priority > 0) THEN
            SELECT array_agg(k.next_id), array_agg(k.partition_key) INTO v_keyed, v_keys
            FROM (
                SELECT pt.next_id, pt.partition_key
                FROM unnest('{9,8,7,6,5,4,3,2,1}'::smallint[]) AS lv(priority)
                CROSS JOIN LATERAL (
                    SELECT pt.next_id, pt.partition_key
                    FROM workqueue.partition pt
                    WHERE pt.subscription_id = v_sub.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
                      AND pt.next_priority = lv.priority AND pt.next_visible_at <= v_now
                      AND (v_blocked IS NULL OR pt.partition_key <> ALL (v_blocked))
                    ORDER BY pt.next_visible_at, pt.next_id
                    LIMIT v_limit
                    FOR UPDATE SKIP LOCKED
                ) pt
                LIMIT v_limit
            ) k;
        END IF;
        IF coalesce(cardinality(v_keyed), 0) < v_limit THEN
            SELECT array_agg(k.next_id), array_agg(k.partition_key) INTO v_more, v_more_keys
            FROM (
                SELECT pt.next_id, pt.partition_key
                FROM workqueue.partition pt
                WHERE pt.subscription_id = v_sub.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
                  AND pt.next_visible_at <= v_now AND pt.next_priority = 0
                  AND (v_blocked IS NULL OR pt.partition_key <> ALL (v_blocked))
                ORDER BY pt.next_visible_at, pt.next_id
                LIMIT v_limit - coalesce(cardinality(v_keyed), 0)
                FOR UPDATE SKIP LOCKED
            ) k;
            IF v_more IS NOT NULL THEN
                v_keyed := coalesce(v_keyed, '{}'::bigint[]) || v_more;
                v_keys := coalesce(v_keys, '{}'::text[]) || v_more_keys;
            END IF;
        END IF;
    END IF;

    -- Deliveries without a key lock (None mode, or no partition key). On a keyed subscription
    -- they share the claim with the keys: neither side can take every slot. A claim of one looks
    -- for one of each and keeps the first in claim order (below). Those with a priority come
    -- first, level by level.
    v_share := CASE WHEN v_keyed IS NULL THEN v_limit
                    ELSE greatest(v_limit - cardinality(v_keyed), v_limit / 2, CASE WHEN v_limit = 1 THEN 1 ELSE 0 END) END;
    IF v_share > 0 AND v_key_limited AND v_sub.partition_mode = 'None' THEN
        -- Under key limits (None mode): the first candidates in claim order past the keys without
        -- room, each key's beyond its room left out. The advisory lock keeps other claimers of
        -- the subscription out, so nothing is locked until the UPDATE below.
        SELECT array_agg(c.id ORDER BY c.priority DESC, c.visible_at, c.id) INTO v_unkeyed
        FROM (
            SELECT x.id, x.priority, x.visible_at
            FROM (
                SELECT y.*, row_number() OVER (PARTITION BY y.partition_key
                                               ORDER BY y.priority DESC, y.visible_at, y.id) AS rn
                FROM (
                    SELECT d.id, d.priority, d.visible_at, d.partition_key
                    FROM unnest('{9,8,7,6,5,4,3,2,1}'::smallint[]) AS lv(priority)
                    CROSS JOIN LATERAL (
                        SELECT d.id, d.priority, d.visible_at, d.partition_key
                        FROM workqueue.delivery d
                        WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0
                          AND d.priority = lv.priority AND d.visible_at <= v_now
                          AND (v_blocked IS NULL OR d.partition_key IS NULL OR d.partition_key <> ALL (v_blocked))
                        ORDER BY d.visible_at, d.id
                        LIMIT v_share * 4
                    ) d
                    WHERE v_sub.prioritized
                    UNION ALL
                    SELECT * FROM (
                        SELECT d.id, d.priority, d.visible_at, d.partition_key
                        FROM workqueue.delivery d
                        WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0
                          AND d.visible_at <= v_now AND d.priority = 0
                          AND (v_blocked IS NULL OR d.partition_key IS NULL OR d.partition_key <> ALL (v_blocked))
                        ORDER BY d.visible_at, d.id
                        LIMIT v_share * 4
                    ) z
                ) y
            ) x
            LEFT JOIN unnest(v_room_keys, v_rooms) AS r(k, n) ON r.k = x.partition_key
            WHERE x.partition_key IS NULL OR x.rn <= coalesce(r.n, v_default_room)
            ORDER BY x.priority DESC, x.visible_at, x.id
            LIMIT v_share
        ) c;
        IF coalesce(cardinality(v_unkeyed), 0) < v_share AND EXISTS (
            SELECT 1 FROM workqueue.delivery d
            WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0
              AND d.visible_at <= v_now AND NOT (d.id = ANY (coalesce(v_unkeyed, '{}'::bigint[])))
        ) THEN
            v_held := coalesce(v_held, CASE WHEN v_key_rate IS NOT NULL AND (v_key_spent OR v_sub.key_concurrency IS NULL)
                                            THEN 'KeyRateLimit' ELSE 'KeyConcurrency' END);
        END IF;
    ELSIF v_share > 0 THEN
        IF v_sub.prioritized THEN
            SELECT array_agg(u.id) INTO v_unkeyed
            FROM (
                SELECT d.id
                FROM unnest('{9,8,7,6,5,4,3,2,1}'::smallint[]) AS lv(priority)
                CROSS JOIN LATERAL (
                    SELECT d.id
                    FROM workqueue.delivery d
                    WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0
                      AND d.priority = lv.priority AND d.visible_at <= v_now
                    ORDER BY d.visible_at, d.id
                    LIMIT v_share
                    FOR UPDATE SKIP LOCKED
                ) d
                LIMIT v_share
            ) u;
        END IF;
        IF coalesce(cardinality(v_unkeyed), 0) < v_share THEN
            SELECT array_agg(u.id) INTO v_more
            FROM (
                SELECT d.id
                FROM workqueue.delivery d
                WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0
                  AND d.visible_at <= v_now AND d.priority = 0
                ORDER BY d.visible_at, d.id
                LIMIT v_share - coalesce(cardinality(v_unkeyed), 0)
                FOR UPDATE SKIP LOCKED
            ) u;
            IF v_more IS NOT NULL THEN
                v_unkeyed := coalesce(v_unkeyed, '{}'::bigint[]) || v_more;
            END IF;
        END IF;
    END IF;
    IF v_keyed IS NOT NULL AND v_unkeyed IS NOT NULL AND cardinality(v_keyed) + cardinality(v_unkeyed) > v_limit THEN
        IF v_limit = 1 THEN  -- one of each: the first in claim order is taken
            IF (SELECT (-k.priority, k.visible_at, k.id) > (-u.priority, u.visible_at, u.id)
                FROM workqueue.delivery k, workqueue.delivery u WHERE k.id = v_keyed[1] AND u.id = v_unkeyed[1]) THEN
                v_keyed := NULL;
                v_keys := NULL;
            ELSE
                v_unkeyed := NULL;
            END IF;
        ELSE
            v_keyed := v_keyed[1:v_limit - cardinality(v_unkeyed)];
            v_keys := v_keys[1:v_limit - cardinality(v_unkeyed)];
        END IF;
    END IF;
    v_ids := coalesce(v_keyed, '{}'::bigint[]) || coalesce(v_unkeyed, '{}'::bigint[]);

    IF cardinality(v_ids) > 0 THEN
        IF v_sub.partition_mode = 'None' THEN
            -- This transaction commits without waiting for its WAL to reach disk: a claim lost in a
            -- crash of the server leaves its deliveries Pending (docs/design/claims-and-keys.md).
            PERFORM set_config('synchronous_commit', 'off', true);
        END IF;

        RETURN QUERY
        WITH d AS (
            UPDATE workqueue.delivery d
            SET status = 'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
                lease_token = gen_random_uuid(),
                -- p_lease_seconds: the lease the claiming process counts (the subscription's as it last read
                -- it), so that a newer deploy's shorter lease cannot run out under it unseen.
                lease_expires_at = v_now + make_interval(secs => CASE
                    WHEN p_lease_seconds > 0 AND p_lease_seconds < 1e9 THEN p_lease_seconds
                    ELSE v_sub.lease_seconds END),
                claimed_at = v_now, held_by = p_holder, progress_percent = NULL, progress_message = NULL
            WHERE d.id = ANY (v_ids) AND d.status = 'Pending'
            RETURNING d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, d.message_id,
                      d.partition_key, d.key_mode, d.priority, d.visible_at
        ), held AS (
            UPDATE workqueue.partition pt
            SET holder_id = d.id, next_id = NULL, next_visible_at = NULL, next_priority = 0
            FROM d
            WHERE pt.subscription_id = v_sub.id AND pt.partition_key = d.partition_key AND d.key_mode > 0
        )
        SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, m.id, m.topic,
               m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id, m.published_at,
               NULL::text, NULL::double precision
        FROM d JOIN workqueue.message m ON m.id = d.message_id
        ORDER BY d.priority DESC, d.visible_at, d.id;   -- the highest priority first, then the earliest due
        GET DIAGNOSTICS v_got = ROW_COUNT;

        IF v_got < cardinality(v_ids) AND v_keys IS NOT NULL THEN
            -- A key pointed at a delivery that was no longer Pending: re-derive those keys.
            FOREACH v_key IN ARRAY v_keys LOOP
                IF EXISTS (SELECT 1 FROM workqueue.partition pt
                           WHERE pt.subscription_id = v_sub.id AND pt.partition_key = v_key AND pt.holder_id IS NULL) THEN
                    PERFORM workqueue.refresh_partition(v_sub.id, v_key,
                        CASE v_sub.partition_mode WHEN 'Exclusive' THEN 1 ELSE 2 END::smallint);
                END IF;
            END LOOP;
        END IF;
    END IF;
    IF NOT v_sub.limited THEN
        RETURN;
    END IF;

    -- Under flow limits: what was claimed is spent from the buckets, and when a limit kept
    -- claimable work back, one more row says which limit and when a token is due (no delivery).
    IF v_got > 0 AND v_rate IS NOT NULL THEN
        INSERT INTO workqueue.rate_bucket AS b (subscription_id, per_key, partition_key, tokens, updated_at)
        VALUES (v_sub.id, false, '', v_tokens - v_got, v_now)
        ON CONFLICT (subscription_id, per_key, partition_key)
        DO UPDATE SET tokens = EXCLUDED.tokens, updated_at = EXCLUDED.updated_at;
    END IF;
    IF v_got > 0 AND v_key_rate IS NOT NULL THEN
        INSERT INTO workqueue.rate_bucket AS b (subscription_id, per_key, partition_key, tokens, updated_at)
        SELECT v_sub.id, true, d.partition_key, greatest(1, v_key_rate) - count(*), v_now
        FROM workqueue.delivery d
        WHERE d.id = ANY (v_ids) AND d.status = 'InFlight' AND d.claimed_at = v_now AND d.partition_key IS NOT NULL
        GROUP BY d.partition_key
        ORDER BY d.partition_key
        ON CONFLICT (subscription_id, per_key, partition_key)
        DO UPDATE SET tokens = least(greatest(1, v_key_rate),
                                     b.tokens + greatest(0, extract(epoch FROM v_now - b.updated_at)) * v_key_rate)
                               - (greatest(1, v_key_rate) - EXCLUDED.tokens),
                      updated_at = EXCLUDED.updated_at;
    END IF;
    IF v_held IS NULL AND v_blocked IS NOT NULL AND v_got < p_limit THEN
        v_held := CASE WHEN v_key_rate IS NOT NULL AND (v_key_spent OR v_sub.key_concurrency IS NULL)
                       THEN 'KeyRateLimit' ELSE 'KeyConcurrency' END;
    END IF;
    IF v_held = 'RateLimit' THEN
        v_retry := (1 - (v_tokens - v_got)) / v_rate;
    ELSIF v_held = 'KeyRateLimit' THEN
        -- When the fullest spent bucket of a key gets its next token.
        SELECT max(least(greatest(1, v_key_rate),
                         b.tokens + greatest(0, extract(epoch FROM v_now - b.updated_at)) * v_key_rate))
        INTO v_fullest
        FROM workqueue.rate_bucket b
        WHERE b.subscription_id = v_sub.id AND b.per_key
          AND b.tokens + greatest(0, extract(epoch FROM v_now - b.updated_at)) * v_key_rate < 1;
        v_retry := (1 - v_fullest) / v_key_rate;
    END IF;
    IF v_held IS NOT NULL AND v_got < p_limit AND (
        EXISTS (SELECT 1 FROM workqueue.delivery d
                WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0
                  AND d.visible_at <= v_now)
        OR EXISTS (SELECT 1 FROM workqueue.partition pt
                   WHERE pt.subscription_id = v_sub.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
                     AND pt.next_visible_at <= v_now)
    ) THEN
        RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL::integer, NULL::integer, NULL::timestamptz,
            NULL::uuid, NULL::text, NULL::text, NULL::jsonb, NULL::text, NULL::text, NULL::text,
            NULL::timestamptz, v_held, CASE WHEN v_retry IS NOT NULL THEN greatest(v_retry, 0) END;
    END IF;
END
$$;

-- Claims up to p_limit visible deliveries across several None-mode subscriptions, the highest
-- priority first, then the oldest due (visible_at, then id) whatever their subscription, each leased for its own
-- subscription's lease_seconds and answered with that subscription's name. Paused subscriptions
-- (or topics) and unknown names give nothing; an Exclusive or Ordered one is refused (claim takes
-- those). One read of the named subscriptions finds both. Each active subscription's claim index
-- is probed once for a delivery due now; when one subscription has one, its oldest due are locked
-- as its index gives them, SKIP LOCKED. With several, each one's claim index gives at most
-- p_limit candidates; the first p_limit of them all are locked by id SKIP LOCKED.
-- Those another claimer holds (or took meanwhile) are made up from their subscriptions' indexes:
-- each such subscription's share, locked past the rows other claimers hold as claim locks, so
-- concurrent claimers take different deliveries and none comes back short while work waits.
-- Commits as a claim without keys does (synchronous_commit off).
CREATE OR REPLACE FUNCTION workqueue.claim_many(p_subscriptions text[], p_limit integer, p_holder uuid DEFAULT NULL,
                                               p_now timestamptz DEFAULT NULL,
                                               p_lease_seconds double precision[] DEFAULT NULL)
RETURNS TABLE (
    subscription text, delivery_id bigint, lease_token uuid, attempt integer, max_attempts integer,
    lease_expires_at timestamptz, message_id uuid, topic text, partition_key text,
    attributes jsonb, payload text, payload_ref text, correlation_id text,
    published_at timestamptz
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());  -- p_now: a test's clock
    v_has_keyed boolean;
    v_keyed text;
    v_active integer[];
    v_candidates bigint[];
    v_candidate_sids integer[];
    v_sids integer[];
    v_shares integer[];
    v_ids bigint[];
    v_more bigint[];
    v_due integer[];
    v_urgent bigint[];
    v_limit integer := p_limit;
BEGIN
    IF p_limit < 1 OR coalesce(cardinality(p_subscriptions), 0) = 0 THEN
        RETURN;
    END IF;
    SELECT bool_or(s.partition_mode <> 'None' OR s.max_in_flight IS NOT NULL OR s.key_concurrency IS NOT NULL
                   OR s.rate_limit IS NOT NULL OR s.key_rate_limit IS NOT NULL),
           array_agg(s.id) FILTER (WHERE s.status = 'Active' AND t.status = 'Active')
    INTO v_has_keyed, v_active
    FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic
    WHERE s.name = ANY (p_subscriptions);
    IF v_has_keyed THEN
        SELECT CASE WHEN s.partition_mode <> 'None' THEN format('%s is %s', s.name, s.partition_mode)
                    ELSE format('%s has flow limits', s.name) END INTO v_keyed
        FROM workqueue.subscription s
        WHERE s.name = ANY (p_subscriptions)
          AND (s.partition_mode <> 'None' OR s.max_in_flight IS NOT NULL OR s.key_concurrency IS NOT NULL
               OR s.rate_limit IS NOT NULL OR s.key_rate_limit IS NOT NULL)
        ORDER BY s.name
        LIMIT 1;
        RAISE EXCEPTION 'claim_many takes None-mode subscriptions only (%); claim an Exclusive or Ordered subscription, or one with flow limits, with claim',
            v_keyed USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_active IS NULL THEN
        RETURN;
    END IF;

    -- The subscriptions with a delivery due now: one probe of each claim index.
    SELECT array_agg(a.sid) INTO v_due
    FROM unnest(v_active) AS a(sid)
    WHERE EXISTS (
        SELECT 1 FROM workqueue.delivery d
        WHERE d.subscription_id = a.sid AND d.status = 'Pending' AND d.key_mode = 0
          AND d.visible_at <= v_now
    );
    IF v_due IS NULL THEN
        RETURN;
    END IF;

    -- Deliveries with a priority first, level by level, the oldest due of each level whatever
    -- their subscription (one probe of an index that is empty without them).
    IF EXISTS (SELECT 1 FROM workqueue.delivery d
               WHERE d.subscription_id = ANY (v_due) AND d.status = 'Pending' AND d.key_mode = 0 AND d.priority > 0) THEN
        SELECT array_agg(l.id) INTO v_urgent
        FROM (
            SELECT c.id
            FROM unnest('{9,8,7,6,5,4,3,2,1}'::smallint[]) AS lv(priority)
            CROSS JOIN LATERAL (
                SELECT d.id
                FROM unnest(v_due) AS a(sid)
                CROSS JOIN LATERAL (
                    SELECT d.id, d.visible_at FROM workqueue.delivery d
                    WHERE d.subscription_id = a.sid AND d.status = 'Pending' AND d.key_mode = 0
                      AND d.priority = lv.priority AND d.visible_at <= v_now
                    ORDER BY d.visible_at, d.id
                    LIMIT p_limit
                    FOR UPDATE SKIP LOCKED
                ) d
                ORDER BY d.visible_at, d.id
                LIMIT p_limit
            ) c
            LIMIT p_limit
        ) l;
        v_limit := p_limit - coalesce(cardinality(v_urgent), 0);
    END IF;

    IF v_limit <= 0 THEN
        v_ids := v_urgent;
    ELSIF cardinality(v_due) = 1 THEN
        -- One of them has work (a worker's usual case): its oldest due deliveries, locked as the
        -- index gives them, past the rows other claimers hold, as claim does.
        SELECT array_agg(l.id) INTO v_ids
        FROM (
            SELECT d.id FROM workqueue.delivery d
            WHERE d.subscription_id = v_due[1] AND d.status = 'Pending' AND d.key_mode = 0
              AND d.visible_at <= v_now AND d.priority = 0
            ORDER BY d.visible_at, d.id
            LIMIT v_limit
            FOR UPDATE SKIP LOCKED
        ) l;
        v_ids := coalesce(v_ids, '{}'::bigint[]);
    ELSE
        -- The p_limit oldest due deliveries of them all.
        SELECT array_agg(c.id), array_agg(c.sid) INTO v_candidates, v_candidate_sids
        FROM (
            SELECT d.id, a.sid
            FROM unnest(v_due) AS a(sid)
            CROSS JOIN LATERAL (
                SELECT d.id, d.visible_at FROM workqueue.delivery d
                WHERE d.subscription_id = a.sid AND d.status = 'Pending' AND d.key_mode = 0
                  AND d.visible_at <= v_now AND d.priority = 0
                ORDER BY d.visible_at, d.id
                LIMIT v_limit
            ) d
            ORDER BY d.visible_at, d.id
            LIMIT v_limit
        ) c;

        -- Locked by id; what another claimer holds is skipped (and rechecked once locked).
        SELECT array_agg(l.id) INTO v_ids
        FROM (
            SELECT d.id FROM workqueue.delivery d
            WHERE d.id = ANY (v_candidates) AND d.status = 'Pending' AND d.key_mode = 0
              AND d.visible_at <= v_now AND d.priority = 0
            FOR UPDATE SKIP LOCKED
        ) l;
        v_ids := coalesce(v_ids, '{}'::bigint[]);

        IF cardinality(v_ids) < coalesce(cardinality(v_candidates), 0) THEN
            -- The skipped ones' shares, locked from their subscriptions' indexes past the rows other
            -- claimers hold (and those this claim holds already).
            SELECT array_agg(x.sid), array_agg(x.n) INTO v_sids, v_shares
            FROM (
                SELECT c.sid, count(*)::integer AS n
                FROM unnest(v_candidates, v_candidate_sids) AS c(id, sid)
                WHERE c.id <> ALL (v_ids)
                GROUP BY c.sid
            ) x;
            SELECT array_agg(l.id) INTO v_more
            FROM unnest(v_sids, v_shares) AS k(sid, n)
            CROSS JOIN LATERAL (
                SELECT d.id FROM workqueue.delivery d
                WHERE d.subscription_id = k.sid AND d.status = 'Pending' AND d.key_mode = 0
                  AND d.visible_at <= v_now AND d.priority = 0 AND d.id <> ALL (v_ids)
                ORDER BY d.visible_at, d.id
                LIMIT k.n
                FOR UPDATE SKIP LOCKED
            ) l;
            v_ids := v_ids || coalesce(v_more, '{}'::bigint[]);
        END IF;
    END IF;
    IF v_urgent IS NOT NULL AND v_limit > 0 THEN
        v_ids := v_urgent || coalesce(v_ids, '{}'::bigint[]);
    END IF;
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
    -- As claim on a subscription without keys: a claim lost in a crash leaves its deliveries Pending.
    PERFORM set_config('synchronous_commit', 'off', true);

    RETURN QUERY
    WITH d AS (
        UPDATE workqueue.delivery d
        SET status = 'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
            lease_token = gen_random_uuid(),
            -- (each for the lease the claiming process counts, p_lease_seconds in the order of
            -- p_subscriptions, as claim leases)
            lease_expires_at = v_now + make_interval(secs => coalesce(
                (SELECT l.secs FROM unnest(p_subscriptions, p_lease_seconds) AS l(name, secs)
                 WHERE l.name = s.name AND l.secs > 0 AND l.secs < 1e9 LIMIT 1), s.lease_seconds)),
            claimed_at = v_now, held_by = p_holder, progress_percent = NULL, progress_message = NULL
        FROM workqueue.subscription s
        WHERE d.id = ANY (v_ids) AND d.status = 'Pending' AND s.id = d.subscription_id
        RETURNING s.name, d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at,
                  d.message_id, d.visible_at, d.priority
    )
    SELECT d.name, d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, m.id, m.topic,
           m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id, m.published_at
    FROM d JOIN workqueue.message m ON m.id = d.message_id
    ORDER BY d.priority DESC, d.visible_at, d.id;
END
$$;

-- Renews the leases of InFlight deliveries that still carry the given tokens and stores their
-- progress; alive is false once the token is stale or an operator asked to cancel. It writes no
-- indexed column (no index names lease_expires_at or the progress): a HOT update.
CREATE OR REPLACE FUNCTION workqueue.heartbeat(
    p_ids bigint[], p_tokens uuid[], p_percents smallint[], p_messages text[],
    p_now timestamptz DEFAULT NULL, p_lease_seconds double precision[] DEFAULT NULL
) RETURNS TABLE (delivery_id bigint, alive boolean, cancel_requested boolean, lease_expires_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());  -- p_now: a test's clock
    v_found jsonb;  -- delivery id -> [cancel_requested, lease_expires_at]
BEGIN
    WITH locked AS (
        SELECT d.id, d.subscription_id, i.pct, i.msg, i.lease
        FROM (SELECT * FROM unnest(p_ids, p_tokens, p_percents, p_messages, p_lease_seconds)
                                AS t(id, token, pct, msg, lease)
              ORDER BY t.id OFFSET 0) i
        CROSS JOIN LATERAL (
            SELECT x.id, x.status, x.subscription_id
            FROM workqueue.delivery x
            WHERE x.id = i.id AND x.lease_token = i.token
            OFFSET 0
            FOR UPDATE
        ) d
        WHERE d.status = 'InFlight'
    ), u AS (
        UPDATE workqueue.delivery d
        -- A cancel-requested delivery is renewed too: its holder is alive and its handler is
        -- winding down, and its key stays busy until the handler returns (a dead holder stops
        -- renewing, and lease expiry discards it).
        SET lease_expires_at = v_now + make_interval(secs => CASE  -- the process's lease, as claim
                                   WHEN l.lease > 0 AND l.lease < 1e9 THEN l.lease ELSE s.lease_seconds END),
            progress_percent = coalesce(l.pct, d.progress_percent),
            progress_message = coalesce(l.msg, d.progress_message)
        FROM locked l
        JOIN workqueue.subscription s ON s.id = l.subscription_id
        WHERE d.id = l.id
        RETURNING d.id, d.cancel_requested, d.lease_expires_at
    )
    SELECT jsonb_object_agg(u.id::text, jsonb_build_array(u.cancel_requested, u.lease_expires_at))
    INTO v_found
    FROM u;

    RETURN QUERY
    SELECT i.id,
           coalesce(NOT (v_found -> i.id::text ->> 0)::boolean, false),
           coalesce((v_found -> i.id::text ->> 0)::boolean, false),
           (v_found -> i.id::text ->> 1)::timestamptz
    FROM unnest(p_ids) AS i(id);
END
$$;

-- Settles InFlight deliveries that still carry the given tokens: Complete, Retry or Fail (Pending
-- after backoff, DeadLettered on the last attempt), DeadLetter, Discard (Discarded with the
-- reason, never retried), Release (Pending, the attempt not spent). A cancel-requested delivery
-- becomes Discarded whatever the outcome; a stale token changes nothing (LeaseLost). p_draws are
-- the caller's jitter draws. The batch's terminal settles are counted in settled_count and its
-- keys handed over by release_keys.
CREATE OR REPLACE FUNCTION workqueue.settle(
    p_ids bigint[], p_tokens uuid[], p_outcomes text[], p_delays double precision[],
    p_reasons text[], p_errors text[], p_draws double precision[] DEFAULT NULL,
    p_now timestamptz DEFAULT NULL
) RETURNS TABLE (delivery_id bigint, result text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());  -- p_now: a test's clock
    v_ids bigint[];
    v_results jsonb;  -- delivery id -> its new status
    v_keyed boolean;
    v_tried jsonb;  -- the attempts to keep, off the happy path
BEGIN
    WITH locked AS (
        -- Item by item, in id order (the order rows are locked in), each finds and locks its row
        -- through the primary key. The lateral subquery (OFFSET 0: not merged into a join, and no
        -- condition pushed into it) names no status, so no partial index on status can serve it
        -- (statistics taken while nothing was InFlight would make the InFlight one look cheaper);
        -- a row with the item's lease token is InFlight, and the status is checked after the lock.
        SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds,
               d.backoff_max_seconds, d.backoff_schedule, i.outcome, i.delay, i.reason, i.error, i.draw
        FROM (SELECT * FROM unnest(p_ids, p_tokens, p_outcomes, p_delays, p_reasons, p_errors, p_draws)
                                AS t(id, token, outcome, delay, reason, error, draw)
              ORDER BY t.id OFFSET 0) i
        CROSS JOIN LATERAL (
            SELECT x.id, x.status, x.lease_token, x.attempt, x.max_attempts, x.cancel_requested,
                   x.backoff_base_seconds, x.backoff_max_seconds, x.backoff_schedule
            FROM workqueue.delivery x
            WHERE x.id = i.id AND x.lease_token = i.token
            OFFSET 0
            FOR UPDATE
        ) d
        WHERE d.status = 'InFlight'
    ), plan AS (
        SELECT l.*,
            CASE WHEN l.cancel_requested THEN 'Discarded'
                 WHEN l.outcome = 'Complete' THEN 'Completed'
                 WHEN l.outcome = 'Discard' THEN 'Discarded'
                 WHEN l.outcome = 'Release' THEN 'Pending'
                 WHEN l.outcome = 'DeadLetter' THEN 'DeadLettered'
                 WHEN l.attempt >= l.max_attempts THEN 'DeadLettered'
                 ELSE 'Pending' END AS new_status
        FROM locked l
    ), u AS (
        UPDATE workqueue.delivery d
        SET status = pl.new_status,
            attempt = CASE WHEN pl.outcome = 'Release' AND pl.new_status = 'Pending'
                           THEN greatest(d.attempt - 1, 0) ELSE d.attempt END,
            visible_at = CASE
                WHEN pl.new_status <> 'Pending' THEN d.visible_at
                WHEN pl.outcome = 'Release' THEN v_now + make_interval(secs => coalesce(pl.delay, 0))
                ELSE v_now + make_interval(secs => coalesce(pl.delay,
                        workqueue.backoff_seconds(d.attempt, pl.backoff_base_seconds,
                                                  pl.backoff_max_seconds, pl.backoff_schedule, pl.draw))) END,
            lease_token = NULL,
            lease_expires_at = NULL,
            reason = CASE WHEN pl.cancel_requested THEN d.reason
                          WHEN pl.outcome = 'Complete' THEN NULL
                          WHEN pl.new_status = 'DeadLettered' AND pl.outcome <> 'DeadLetter'
                              THEN coalesce('max attempts reached: ' || coalesce(pl.reason, pl.error), 'max attempts reached')
                          ELSE coalesce(pl.reason, d.reason) END,
            last_error = coalesce(pl.error, d.last_error),
            settled_at = CASE WHEN pl.new_status IN ('Completed', 'Discarded', 'DeadLettered') THEN v_now END
        FROM plan pl
        WHERE d.id = pl.id
        RETURNING d.id, d.status, d.key_mode, d.subscription_id, d.attempt, d.claimed_at, d.held_by, d.reason,
                  pl.outcome, pl.error
    ), counted AS (
        -- The batch's terminal settles, one row per subscription (settled_count).
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, count(*) FILTER (WHERE u.status = 'Completed'),
               count(*) FILTER (WHERE u.status = 'Discarded')
        FROM u
        WHERE u.status IN ('Completed', 'Discarded')
        GROUP BY u.subscription_id
    )
    SELECT array_agg(u.id), jsonb_object_agg(u.id::text, u.status), bool_or(u.key_mode > 0),
           -- An attempt off the happy path is kept (delivery_attempt); a completion or a release
           -- writes nothing there. Gathered here and written below only when there is one, so that
           -- a batch of completions runs no INSERT at all.
           jsonb_agg(jsonb_build_object(
               'delivery_id', u.id, 'attempt', u.attempt, 'started_at', u.claimed_at, 'held_by', u.held_by,
               'outcome', CASE WHEN u.status = 'Pending' THEN 'Failed' ELSE u.status END,
               'reason', u.reason, 'error', u.error))
               FILTER (WHERE u.status <> 'Completed' AND NOT (u.outcome = 'Release' AND u.status = 'Pending'))
    INTO v_ids, v_results, v_keyed, v_tried
    FROM u;

    IF v_tried IS NOT NULL THEN
        INSERT INTO workqueue.delivery_attempt (delivery_id, attempt, started_at, ended_at, held_by, outcome,
                                                reason, error)
        SELECT t.delivery_id, t.attempt, t.started_at, v_now, t.held_by, t.outcome, t.reason, t.error
        FROM jsonb_to_recordset(v_tried) AS t(delivery_id bigint, attempt integer, started_at timestamptz,
                                              held_by uuid, outcome text, reason text, error text);
        -- Keep the newest 50 attempts of each delivery.
        DELETE FROM workqueue.delivery_attempt a
        WHERE a.delivery_id IN (SELECT (t ->> 'delivery_id')::bigint FROM jsonb_array_elements(v_tried) AS t)
          AND a.id <= (SELECT b.id FROM workqueue.delivery_attempt b WHERE b.delivery_id = a.delivery_id
                       ORDER BY b.id DESC OFFSET 50 LIMIT 1);
    END IF;

    IF v_keyed THEN
        PERFORM pg_notify('workqueue', r.subscription_id::text) FROM workqueue.release_keys(v_ids) r;
    END IF;

    RETURN QUERY
    SELECT i.id, coalesce(v_results ->> i.id::text, 'LeaseLost')
    FROM unnest(p_ids) AS i(id);
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Keys of Exclusive and Ordered subscriptions
-- ---------------------------------------------------------------------------------------------

-- Re-derives the state of one key from its deliveries: the holder, the next delivery to claim
-- and (Ordered) the dead-lettered head that blocks it. Deletes the row of a key with no live work.
-- The caller must already hold the locks of the deliveries it changed.
CREATE OR REPLACE FUNCTION workqueue.refresh_partition(p_subscription_id integer, p_key text, p_mode smallint)
RETURNS boolean   -- true when the key can be claimed right now
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_holder bigint;
    v_next bigint;
    v_next_visible timestamptz;
    v_next_priority smallint;
    v_blocked bigint;
    v_head record;
BEGIN
    INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
    VALUES (p_subscription_id, p_key)
    ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id
    RETURNING p.holder_id INTO v_holder;

    IF v_holder IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM workqueue.delivery d WHERE d.id = v_holder AND d.status = 'InFlight'
    ) THEN
        v_holder := NULL;
    END IF;

    IF p_mode = 2 THEN
        IF v_holder IS NULL THEN
            -- A holder the row does not name (the row was lost): the key's InFlight delivery, from
            -- the subscription's InFlight set (delivery_ordered_head leaves InFlight out).
            SELECT d.id INTO v_holder
            FROM workqueue.delivery d
            WHERE d.subscription_id = p_subscription_id AND d.status = 'InFlight'
              AND d.partition_key = p_key AND d.key_mode = 2
            ORDER BY d.id
            LIMIT 1;
        END IF;
        SELECT d.id, d.status, d.visible_at, d.priority INTO v_head
        FROM workqueue.delivery d
        WHERE d.subscription_id = p_subscription_id AND d.partition_key = p_key AND d.key_mode = 2
          AND d.status IN ('Pending', 'DeadLettered')
        ORDER BY d.id
        LIMIT 1;
        IF FOUND AND (v_holder IS NULL OR v_head.id < v_holder) THEN
            IF v_head.status = 'DeadLettered' THEN
                v_blocked := v_head.id;
            ELSIF v_holder IS NULL THEN
                v_next := v_head.id;
                v_next_visible := v_head.visible_at;
                v_next_priority := v_head.priority;
            END IF;
        END IF;
    ELSIF v_holder IS NULL THEN
        SELECT d.id, d.visible_at, d.priority INTO v_next, v_next_visible, v_next_priority
        FROM workqueue.delivery d
        WHERE d.subscription_id = p_subscription_id AND d.partition_key = p_key AND d.key_mode = 1
          AND d.status = 'Pending'
        ORDER BY d.visible_at, d.id
        LIMIT 1;
    END IF;

    IF v_holder IS NULL AND v_next IS NULL AND v_blocked IS NULL THEN
        DELETE FROM workqueue.partition p
        WHERE p.subscription_id = p_subscription_id AND p.partition_key = p_key;
        RETURN false;
    END IF;
    UPDATE workqueue.partition p
    SET holder_id = v_holder, next_id = v_next, next_visible_at = v_next_visible, blocked_id = v_blocked,
        next_priority = coalesce(v_next_priority, 0)
    WHERE p.subscription_id = p_subscription_id AND p.partition_key = p_key;
    RETURN v_holder IS NULL AND v_next IS NOT NULL AND v_next_visible <= now();
END
$$;

-- Hands the keys of just-settled (or expired) deliveries over to their next delivery, in one
-- statement for the batch. Keys another transaction holds (a producer) are not waited for: they
-- are marked stale (partition_stale) and re-derived later. Returns the subscriptions with a key
-- claimable now.
CREATE OR REPLACE FUNCTION workqueue.release_keys(p_ids bigint[])
RETURNS TABLE (subscription_id integer)   -- subscriptions with a key that can be claimed now
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_sids integer[];
    v_keys text[];
    v_modes smallint[];
    v_held_sids integer[];
    v_held_keys text[];
    v_held_modes smallint[];
    v_held_holders bigint[];
    v_ready integer[];
    v_emptied boolean;
BEGIN
    SELECT array_agg(k.subscription_id ORDER BY k.subscription_id, k.partition_key),
           array_agg(k.partition_key ORDER BY k.subscription_id, k.partition_key),
           array_agg(k.key_mode ORDER BY k.subscription_id, k.partition_key)
    INTO v_sids, v_keys, v_modes
    FROM (SELECT DISTINCT d.subscription_id, d.partition_key, d.key_mode FROM workqueue.delivery d
          WHERE d.id = ANY (p_ids) AND d.key_mode > 0) k;
    IF v_sids IS NULL THEN
        RETURN;
    END IF;

    -- Lock the keys nobody else holds, in key order; the next statements then read their
    -- deliveries with a snapshot taken after every publish that touched them committed (a
    -- publish locks a key before its deliveries of that key get their ids).
    SELECT array_agg(h.subscription_id), array_agg(h.partition_key), array_agg(h.mode), array_agg(h.holder_id)
    INTO v_held_sids, v_held_keys, v_held_modes, v_held_holders
    FROM (
        SELECT p.subscription_id, p.partition_key, k.mode, p.holder_id
        FROM workqueue.partition p
        JOIN unnest(v_sids, v_keys, v_modes) AS k(sid, key, mode)
          ON p.subscription_id = k.sid AND p.partition_key = k.key
        ORDER BY p.subscription_id, p.partition_key
        FOR UPDATE OF p SKIP LOCKED
    ) h;

    IF coalesce(cardinality(v_held_keys), 0) < cardinality(v_keys) THEN
        -- The others are held (by a producer, most likely): re-derived later, by whoever locks
        -- them first. WHERE false: an existing marker is locked, not changed.
        INSERT INTO workqueue.partition_stale AS ps (subscription_id, partition_key, key_mode)
        SELECT k.sid, k.key, k.mode
        FROM unnest(v_sids, v_keys, v_modes) AS k(sid, key, mode)
        WHERE (k.sid, k.key) NOT IN (SELECT h.sid, h.key FROM unnest(v_held_sids, v_held_keys) AS h(sid, key)
                                     WHERE h.sid IS NOT NULL)
        ORDER BY k.sid, k.key
        ON CONFLICT (subscription_id, partition_key) DO UPDATE SET key_mode = EXCLUDED.key_mode WHERE false;
    END IF;

    IF v_held_keys IS NOT NULL THEN
        -- Each locked key's state from its deliveries; its holder is the one the lock query read
        -- (the row is locked since), unless that one is among the deliveries just settled.
        WITH k AS (
            SELECT k.sid AS subscription_id, k.key AS partition_key, k.mode AS key_mode,
                   CASE WHEN k.holder = ANY (p_ids) THEN NULL ELSE k.holder END AS holder_id
            FROM unnest(v_held_sids, v_held_keys, v_held_modes, v_held_holders) AS k(sid, key, mode, holder)
        ), state AS (
            SELECT k.subscription_id, k.partition_key, k.key_mode, k.holder_id,
                   o.id AS head_id, o.status AS head_status, o.visible_at AS head_visible_at,
                   o.priority AS head_priority,
                   e.id AS next_pending_id, e.visible_at AS next_pending_visible_at,
                   e.priority AS next_pending_priority
            FROM k
            LEFT JOIN LATERAL (
                SELECT d.id, d.status, d.visible_at, d.priority FROM workqueue.delivery d
                WHERE k.key_mode = 2 AND d.subscription_id = k.subscription_id AND d.partition_key = k.partition_key
                  AND d.key_mode = 2 AND d.status IN ('Pending', 'DeadLettered')
                ORDER BY d.id
                LIMIT 1
            ) o ON true
            LEFT JOIN LATERAL (
                SELECT d.id, d.visible_at, d.priority FROM workqueue.delivery d
                WHERE k.key_mode = 1 AND d.subscription_id = k.subscription_id AND d.partition_key = k.partition_key
                  AND d.key_mode = 1 AND d.status = 'Pending'
                ORDER BY d.visible_at, d.id
                LIMIT 1
            ) e ON true
        ), updated AS (
            UPDATE workqueue.partition p
            SET holder_id = n.holder_id, next_id = n.next_id, next_visible_at = n.next_visible_at,
                blocked_id = n.blocked_id, next_priority = coalesce(n.next_priority, 0)
            FROM (
                SELECT s.subscription_id, s.partition_key, s.holder_id,
                       CASE WHEN s.holder_id IS NOT NULL THEN NULL
                            WHEN s.key_mode = 1 THEN s.next_pending_id
                            WHEN s.head_status = 'Pending' THEN s.head_id END AS next_id,
                       CASE WHEN s.holder_id IS NOT NULL THEN NULL
                            WHEN s.key_mode = 1 THEN s.next_pending_visible_at
                            WHEN s.head_status = 'Pending' THEN s.head_visible_at END AS next_visible_at,
                       CASE WHEN s.holder_id IS NOT NULL THEN NULL
                            WHEN s.key_mode = 1 THEN s.next_pending_priority
                            WHEN s.head_status = 'Pending' THEN s.head_priority END AS next_priority,
                       CASE WHEN s.key_mode = 2 AND s.head_status = 'DeadLettered' THEN s.head_id END AS blocked_id
                FROM state s
            ) n
            WHERE p.subscription_id = n.subscription_id AND p.partition_key = n.partition_key
            RETURNING p.subscription_id, p.holder_id, p.next_id, p.next_visible_at, p.blocked_id
        )
        SELECT array_agg(DISTINCT u.subscription_id)
                   FILTER (WHERE u.holder_id IS NULL AND u.next_id IS NOT NULL AND u.next_visible_at <= now()),
               bool_or(u.holder_id IS NULL AND u.next_id IS NULL AND u.blocked_id IS NULL)
        INTO v_ready, v_emptied
        FROM updated u;

        -- Keys left with nothing lose their row, in a statement of its own (a sibling of the
        -- UPDATE in one WITH would not see the rows the UPDATE changes), when there is one.
        IF v_emptied THEN
            DELETE FROM workqueue.partition p
            USING unnest(v_held_sids, v_held_keys) AS k(sid, key)
            WHERE p.subscription_id = k.sid AND p.partition_key = k.key
              AND p.holder_id IS NULL AND p.next_id IS NULL AND p.blocked_id IS NULL;
        END IF;
        RETURN QUERY SELECT unnest(v_ready);
    END IF;

    -- The next settle of a subscription also re-derives its keys that earlier ones left stale.
    IF EXISTS (SELECT 1 FROM workqueue.partition_stale ps WHERE ps.subscription_id = ANY (v_sids)) THEN
        RETURN QUERY SELECT r.subscription_id
        FROM workqueue.rederive_stale(ARRAY(SELECT DISTINCT unnest(v_sids)), 100) r;
    END IF;
END
$$;

-- Re-derives (refresh_partition) up to p_limit keys marked stale, of the given subscriptions (all
-- when NULL), whose marker and partition row nobody else holds; returns the subscriptions that
-- got a key claimable now. A marker whose key has no row any more is dropped.
CREATE OR REPLACE FUNCTION workqueue.rederive_stale(p_subscription_ids integer[], p_limit integer)
RETURNS TABLE (subscription_id integer)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_sids integer[];
    v_keys text[];
    v_modes smallint[];
    v_free_sids integer[];
    v_free_keys text[];
    v_key record;
BEGIN
    SELECT array_agg(m.subscription_id), array_agg(m.partition_key), array_agg(m.key_mode)
    INTO v_sids, v_keys, v_modes
    FROM (
        SELECT ps.subscription_id, ps.partition_key, ps.key_mode
        FROM workqueue.partition_stale ps
        WHERE p_subscription_ids IS NULL OR ps.subscription_id = ANY (p_subscription_ids)
        ORDER BY ps.subscription_id, ps.partition_key
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ) m;
    IF v_sids IS NULL THEN
        RETURN;
    END IF;

    SELECT array_agg(f.subscription_id), array_agg(f.partition_key) INTO v_free_sids, v_free_keys
    FROM (
        SELECT p.subscription_id, p.partition_key
        FROM workqueue.partition p
        JOIN unnest(v_sids, v_keys) AS k(sid, key) ON p.subscription_id = k.sid AND p.partition_key = k.key
        ORDER BY p.subscription_id, p.partition_key
        FOR UPDATE OF p SKIP LOCKED
    ) f;

    DELETE FROM workqueue.partition_stale ps
    USING unnest(v_sids, v_keys) AS k(sid, key)
    WHERE ps.subscription_id = k.sid AND ps.partition_key = k.key
      AND ((k.sid, k.key) IN (SELECT * FROM unnest(v_free_sids, v_free_keys))
           OR NOT EXISTS (SELECT 1 FROM workqueue.partition p
                          WHERE p.subscription_id = k.sid AND p.partition_key = k.key));

    FOR v_key IN
        SELECT k.sid, k.key, k.mode
        FROM unnest(v_sids, v_keys, v_modes) AS k(sid, key, mode)
        WHERE (k.sid, k.key) IN (SELECT * FROM unnest(v_free_sids, v_free_keys))
        ORDER BY k.sid, k.key
    LOOP
        IF workqueue.refresh_partition(v_key.sid, v_key.key, v_key.mode) THEN
            subscription_id := v_key.sid;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Sweeper and retention
-- ---------------------------------------------------------------------------------------------

-- Each of these reads the time once: p_now when the caller gives it (a test's clock), else now(),
-- the start of its transaction (docs/design/time.md).

-- InFlight deliveries whose lease ran out: Discarded when a cancel was requested, DeadLettered
-- on the final attempt, otherwise Pending again after backoff (the attempt counts).
CREATE OR REPLACE FUNCTION workqueue.expire_leases(p_limit integer, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (delivery_id bigint, result text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());  -- p_now: a test's clock
    v_expired bigint[];
    v_ids bigint[];
    v_results text[];
    v_keyed boolean;
BEGIN
    SELECT array_agg(e.id) INTO v_expired
    FROM (
        SELECT d.id FROM workqueue.delivery d
        WHERE d.status = 'InFlight' AND d.lease_expires_at < v_now
        ORDER BY d.lease_expires_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ) e;
    IF v_expired IS NULL THEN
        RETURN;
    END IF;

    WITH u AS (
        UPDATE workqueue.delivery d
        SET status = CASE WHEN d.cancel_requested THEN 'Discarded'
                          WHEN d.attempt >= d.max_attempts THEN 'DeadLettered'
                          ELSE 'Pending' END,
            visible_at = CASE WHEN d.cancel_requested OR d.attempt >= d.max_attempts THEN d.visible_at
                              ELSE v_now + make_interval(secs => workqueue.backoff_seconds(
                                    d.attempt, d.backoff_base_seconds, d.backoff_max_seconds, d.backoff_schedule)) END,
            reason = CASE WHEN d.cancel_requested THEN d.reason
                          WHEN d.attempt >= d.max_attempts THEN 'lease expired on the final attempt'
                          ELSE 'lease expired' END,
            last_error = CASE WHEN d.cancel_requested THEN d.last_error
                              ELSE 'lease expired: the holder stopped renewing it' END,
            lease_token = NULL,
            lease_expires_at = NULL,
            settled_at = CASE WHEN d.cancel_requested OR d.attempt >= d.max_attempts THEN v_now END
        WHERE d.id = ANY (v_expired)
        RETURNING d.id, d.status, d.key_mode, d.subscription_id, d.attempt, d.claimed_at, d.held_by, d.reason
    ), tried AS (
        INSERT INTO workqueue.delivery_attempt (delivery_id, attempt, started_at, ended_at, held_by, outcome,
                                                reason, error)
        SELECT u.id, u.attempt, u.claimed_at, v_now, u.held_by, 'LeaseExpired', u.reason,
               'lease expired: the holder stopped renewing it'
        FROM u
    ), counted AS (
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, 0, count(*)
        FROM u
        WHERE u.status = 'Discarded'
        GROUP BY u.subscription_id
    )
    SELECT array_agg(u.id), array_agg(u.status), bool_or(u.key_mode > 0)
    INTO v_ids, v_results, v_keyed
    FROM u;

    DELETE FROM workqueue.delivery_attempt a
    WHERE a.delivery_id = ANY (v_ids)
      AND a.id <= (SELECT b.id FROM workqueue.delivery_attempt b WHERE b.delivery_id = a.delivery_id
                   ORDER BY b.id DESC OFFSET 50 LIMIT 1);

    IF v_keyed THEN
        PERFORM pg_notify('workqueue', r.subscription_id::text) FROM workqueue.release_keys(v_ids) r;
    END IF;

    RETURN QUERY SELECT x.id, x.result FROM unnest(v_ids, v_results) AS x(id, result);
END
$$;

-- Terminal deliveries past their subscription's retention (counted out of settled_count), then
-- messages no delivery refers to past their topic's retention, then expired deduplication keys;
-- each scan bounded by the shortest retention that applies.
CREATE OR REPLACE FUNCTION workqueue.purge(p_limit integer, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (purged_deliveries integer, purged_messages integer, purged_deduplication integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());  -- p_now: a test's clock
    v_deliveries integer := 0;
    v_messages integer;
    v_dedup integer;
    v_settled_before timestamptz;
    v_published_before timestamptz;
BEGIN
    -- A settled delivery may go once its subscription's retention has passed: none settled after
    -- v_now minus the shortest retention of any subscription can.
    SELECT v_now - make_interval(secs => min(s.retention_seconds)) INTO v_settled_before
    FROM workqueue.subscription s;
    IF v_settled_before IS NOT NULL THEN
        WITH gone AS (
            DELETE FROM workqueue.delivery d
            WHERE d.id IN (
                SELECT x.id FROM workqueue.delivery x
                JOIN workqueue.subscription s ON s.id = x.subscription_id
                WHERE x.status IN ('Completed', 'Discarded')
                  AND x.settled_at < v_settled_before
                  AND x.settled_at < v_now - make_interval(secs => s.retention_seconds)
                ORDER BY x.settled_at
                LIMIT p_limit
            )
            RETURNING d.subscription_id, d.status
        ), counted AS (
            INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
            SELECT g.subscription_id, -count(*) FILTER (WHERE g.status = 'Completed'),
                   -count(*) FILTER (WHERE g.status = 'Discarded')
            FROM gone g
            GROUP BY g.subscription_id
        )
        SELECT count(*) INTO v_deliveries FROM gone;
    END IF;

    -- A message may go once no delivery refers to it and its topic's retention has passed (the
    -- longest of the topic's subscriptions, a week for a topic without any): none published
    -- after v_now minus the shortest of those can.
    SELECT v_now - make_interval(secs => least(604800::double precision, min(r.seconds)))
    INTO v_published_before
    FROM (SELECT max(s.retention_seconds) AS seconds FROM workqueue.subscription s GROUP BY s.topic) r;
    DELETE FROM workqueue.message m
    WHERE m.id IN (
        SELECT x.id FROM workqueue.message x
        WHERE x.published_at < v_published_before
          AND x.published_at < v_now - make_interval(secs => coalesce(
                  (SELECT max(s.retention_seconds) FROM workqueue.subscription s WHERE s.topic = x.topic),
                  604800))
          AND NOT EXISTS (SELECT 1 FROM workqueue.delivery d WHERE d.message_id = x.id)
        ORDER BY x.published_at
        LIMIT p_limit
    );
    GET DIAGNOSTICS v_messages = ROW_COUNT;

    DELETE FROM workqueue.deduplication dd
    WHERE (dd.topic, dd.deduplication_key) IN (
        SELECT x.topic, x.deduplication_key FROM workqueue.deduplication x
        WHERE x.expires_at <= v_now
        ORDER BY x.expires_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED  -- a producer taking the expired key over holds it until it commits
    );
    GET DIAGNOSTICS v_dedup = ROW_COUNT;

    -- Token buckets that are full again (idle for as long as an empty one takes to fill), or
    -- whose subscription has no such rate limit any more.
    DELETE FROM workqueue.rate_bucket b
    WHERE (b.subscription_id, b.per_key, b.partition_key) IN (
        SELECT x.subscription_id, x.per_key, x.partition_key
        FROM workqueue.rate_bucket x
        LEFT JOIN workqueue.subscription s ON s.id = x.subscription_id
        CROSS JOIN LATERAL (SELECT workqueue.rate_per_second(
                                CASE WHEN x.per_key THEN s.key_rate_limit ELSE s.rate_limit END) AS rate) r
        WHERE r.rate IS NULL
           OR x.updated_at + make_interval(secs => greatest(1, r.rate) / r.rate) <= v_now
        LIMIT p_limit
        FOR UPDATE OF x SKIP LOCKED
    );

    RETURN QUERY SELECT v_deliveries, v_messages, v_dedup;
END
$$;

-- Replaces the settled_count rows of each subscription that has more than one by their sum
-- (dropping sums of zero). Rows other transactions are appending are not seen and stay.
CREATE OR REPLACE FUNCTION workqueue.fold_settled_counts()
RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH folded AS (
        DELETE FROM workqueue.settled_count c
        WHERE c.subscription_id IN (SELECT x.subscription_id FROM workqueue.settled_count x
                                    GROUP BY x.subscription_id HAVING count(*) > 1
                                        OR (sum(x.completed) = 0 AND sum(x.discarded) = 0))
        RETURNING c.subscription_id, c.completed, c.discarded
    )
    INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
    SELECT f.subscription_id, sum(f.completed), sum(f.discarded)
    FROM folded f
    GROUP BY f.subscription_id
    HAVING sum(f.completed) <> 0 OR sum(f.discarded) <> 0
$$;

-- One sweeper pass: expired leases, stale keys, retention, the counts folded, expired once
-- markers. A transaction-scoped advisory lock lets one pass run at a time across every process;
-- a pass that finds it taken returns ran = false and does nothing.
CREATE OR REPLACE FUNCTION workqueue.sweep(p_limit integer DEFAULT 1000, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (
    ran boolean, retried integer, dead_lettered integer, discarded integer,
    purged_deliveries integer, purged_messages integer, purged_deduplication integer, taken_back jsonb
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());  -- p_now: a test's clock, the owner's only
    v_retried integer;
    v_dead integer;
    v_discarded integer;
    v_purge record;
    v_taken_back jsonb;
BEGIN
    -- p_now, a test's clock, is given only by a member of the schema's owner (or a superuser): the
    -- runtime and operator roles run sweeps, and with a clock of their choosing they could take back
    -- leases that have time left and purge what retention keeps.
    IF p_now IS NOT NULL AND NOT pg_has_role(
            session_user, (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'workqueue'), 'MEMBER') THEN
        RAISE EXCEPTION 'p_now (a test''s clock) is given only by the owner of schema workqueue; call sweep without it'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtext('workqueue.sweep')::bigint) THEN
        RETURN QUERY SELECT false, 0, 0, 0, 0, 0, 0, '[]'::jsonb;
        RETURN;
    END IF;
    -- Each lease taken back, with its subscription and the process that held it (for the log).
    WITH e AS (SELECT * FROM workqueue.expire_leases(p_limit, p_now))
    SELECT count(*) FILTER (WHERE e.result = 'Pending'),
           count(*) FILTER (WHERE e.result = 'DeadLettered'),
           count(*) FILTER (WHERE e.result = 'Discarded'),
           coalesce(jsonb_agg(jsonb_build_object(
               'delivery_id', e.delivery_id, 'subscription', s.name, 'result', e.result, 'attempt', d.attempt,
               'holder_id', d.held_by, 'holder_host', p.hostname, 'holder_pid', p.pid) ORDER BY e.delivery_id),
               '[]'::jsonb)
    INTO v_retried, v_dead, v_discarded, v_taken_back
    FROM e
    JOIN workqueue.delivery d ON d.id = e.delivery_id
    JOIN workqueue.subscription s ON s.id = d.subscription_id
    LEFT JOIN workqueue.process p ON p.id = d.held_by;
    PERFORM pg_notify('workqueue', r.sid::text)
    FROM (SELECT DISTINCT r.subscription_id AS sid FROM workqueue.rederive_stale(NULL, p_limit) r) r;
    SELECT * INTO v_purge FROM workqueue.purge(p_limit, p_now);
    PERFORM workqueue.fold_settled_counts();
    DELETE FROM workqueue.once_marker o
    WHERE o.key IN (SELECT x.key FROM workqueue.once_marker x WHERE x.expires_at <= v_now
                    ORDER BY x.expires_at LIMIT p_limit FOR UPDATE SKIP LOCKED);
    RETURN QUERY SELECT true, v_retried, v_dead, v_discarded, v_purge.purged_deliveries,
                        v_purge.purged_messages, v_purge.purged_deduplication, v_taken_back;
END
$$;

-- Removes terminal deliveries (Completed, Discarded) settled more than p_older_than_seconds ago,
-- whatever their subscription's retention, in batches; returns how many it removed (`workqueue
-- prune`). Ago by p_now when given (a test's clock, which settles stamped), else by now().
CREATE OR REPLACE FUNCTION workqueue.prune(
    p_older_than_seconds double precision, p_limit integer, p_now timestamptz DEFAULT NULL
)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());  -- p_now: a test's clock
    v_count integer;
BEGIN
    WITH gone AS (
        DELETE FROM workqueue.delivery d
        WHERE d.id IN (
            SELECT x.id FROM workqueue.delivery x
            WHERE x.status IN ('Completed', 'Discarded')
              AND x.settled_at < v_now - make_interval(secs => p_older_than_seconds)
            ORDER BY x.settled_at
            LIMIT p_limit
        )
        RETURNING d.subscription_id, d.status
    ), counted AS (
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT g.subscription_id, -count(*) FILTER (WHERE g.status = 'Completed'),
               -count(*) FILTER (WHERE g.status = 'Discarded')
        FROM gone g
        GROUP BY g.subscription_id
    )
    SELECT count(*) INTO v_count FROM gone;
    PERFORM workqueue.fold_settled_counts();
    RETURN v_count;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Once markers: context.once(key, fn) runs fn unless it already succeeded for the key
-- ---------------------------------------------------------------------------------------------

-- Once markers behind context.once(key, fn). Run: the caller holds the key for
-- p_running_seconds and must finish or abort it. Done: it ran already (within its TTL). Busy:
-- another attempt is running it now.
CREATE OR REPLACE FUNCTION workqueue.once_begin(p_key text, p_running_seconds double precision)
RETURNS TABLE (state text, token uuid)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_token uuid := gen_random_uuid();
    v_state text;
BEGIN
    INSERT INTO workqueue.once_marker AS o (key, state, token, expires_at)
    VALUES (p_key, 'Running', v_token, now() + make_interval(secs => p_running_seconds))
    ON CONFLICT (key) DO UPDATE
    SET state = 'Running', token = v_token, expires_at = EXCLUDED.expires_at
    WHERE o.expires_at <= now();
    IF FOUND THEN
        RETURN QUERY SELECT 'Run'::text, v_token;
        RETURN;
    END IF;
    SELECT o.state INTO v_state FROM workqueue.once_marker o WHERE o.key = p_key;
    RETURN QUERY SELECT CASE WHEN v_state = 'Done' THEN 'Done' ELSE 'Busy' END, NULL::uuid;
END
$$;

-- Marks a key done for p_ttl_seconds (the token must be the caller's).
CREATE OR REPLACE FUNCTION workqueue.once_finish(p_key text, p_token uuid, p_ttl_seconds double precision)
RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH u AS (
        UPDATE workqueue.once_marker o
        SET state = 'Done', token = NULL, expires_at = now() + make_interval(secs => p_ttl_seconds)
        WHERE o.key = p_key AND o.token = p_token
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM u)
$$;

-- Lets a key go without marking it done (the token must be the caller's).
CREATE OR REPLACE FUNCTION workqueue.once_abort(p_key text, p_token uuid)
RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH d AS (
        DELETE FROM workqueue.once_marker o WHERE o.key = p_key AND o.token = p_token RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM d)
$$;

-- Keeps a Running key held for p_running_seconds more while the caller's token holds it (an
-- overlap lock renewed while its attempt runs); false once the token no longer holds it.
CREATE OR REPLACE FUNCTION workqueue.once_renew(p_key text, p_token uuid, p_running_seconds double precision)
RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH u AS (
        UPDATE workqueue.once_marker o
        SET expires_at = now() + make_interval(secs => p_running_seconds)
        WHERE o.key = p_key AND o.token = p_token AND o.state = 'Running'
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM u)
$$;

-- ---------------------------------------------------------------------------------------------
-- Deduplication keys and step results: a unique job frees its key, a job's durable steps
-- ---------------------------------------------------------------------------------------------

-- Frees a topic's deduplication key if the given message holds it; true when it held it live (a
-- key of that message that had expired already goes too, and answers false).
CREATE OR REPLACE FUNCTION workqueue.release_deduplication_key(p_topic text, p_key text, p_message_id uuid)
RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH d AS (
        DELETE FROM workqueue.deduplication dd
        WHERE dd.topic = p_topic AND dd.deduplication_key = p_key AND dd.message_id = p_message_id
        RETURNING dd.expires_at
    )
    SELECT coalesce(bool_or(d.expires_at > now()), false) FROM d
$$;

-- The stored result of one step (no row when none is stored).
CREATE OR REPLACE FUNCTION workqueue.step_get(p_message_id uuid, p_name text)
RETURNS TABLE (value text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT r.value FROM workqueue.step_result r WHERE r.message_id = p_message_id AND r.name = p_name
$$;

-- Stores the result of one step; the first write wins (a second put keeps the first value). The
-- message must be stored.
CREATE OR REPLACE FUNCTION workqueue.step_put(p_message_id uuid, p_name text, p_value text)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO workqueue.step_result (message_id, name, value)
    VALUES (p_message_id, p_name, p_value)
    ON CONFLICT (message_id, name) DO NOTHING;
EXCEPTION WHEN foreign_key_violation THEN
    RAISE EXCEPTION 'message % is not stored (never published, or purged): a step result belongs to a stored message',
        p_message_id USING ERRCODE = 'foreign_key_violation';
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Results: what a completed message's work returned (a job's stored result)
-- ---------------------------------------------------------------------------------------------

-- Keeps the result of the delivery's message. The transport calls it in the transaction of a settle
-- that completed the delivery (settle_with_follow_ups), so a result exists if and only if that
-- completion was written; a later completion's result (a job retried by an operator) replaces it.
CREATE OR REPLACE FUNCTION workqueue.result_put(p_delivery_id bigint, p_value text)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO workqueue.message_result AS r (message_id, value)
    SELECT d.message_id, p_value FROM workqueue.delivery d WHERE d.id = p_delivery_id
    ON CONFLICT (message_id) DO UPDATE SET value = EXCLUDED.value, stored_at = now()
$$;

-- The stored result of a message (no row when none is stored).
CREATE OR REPLACE FUNCTION workqueue.result_get(p_message_id uuid)
RETURNS TABLE (value text, stored_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT r.value, r.stored_at FROM workqueue.message_result r WHERE r.message_id = p_message_id
$$;

-- ---------------------------------------------------------------------------------------------
-- Debounce: one pending message per key, its payload and due time replaced by each publish
-- ---------------------------------------------------------------------------------------------

-- The message that holds the topic's deduplication key p_key takes the payload p_payload and comes
-- due p_seconds from now, and the key lives as long; answered with its MessageID. Only a message
-- still waiting out its window is replaced: every delivery Pending, unkeyed, never claimed and not
-- yet due. Otherwise (no key, or its message is due, running or ended) the key is freed and no row
-- is answered: the caller publishes a new message with the key (a concurrent caller that published
-- it first makes that publish a Duplicate, and the caller asks again).
CREATE OR REPLACE FUNCTION workqueue.debounce(
    p_topic text, p_key text, p_payload text, p_content_hash text, p_envelope_bytes integer,
    p_seconds double precision, p_now timestamptz DEFAULT NULL
) RETURNS TABLE (message_id uuid)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());  -- p_now: a test's clock
    v_due timestamptz := coalesce(p_now, now()) + make_interval(secs => p_seconds);
    v_message uuid;
    v_cap integer;
    v_waiting boolean;
BEGIN
    SELECT dd.message_id INTO v_message FROM workqueue.deduplication dd
    WHERE dd.topic = p_topic AND dd.deduplication_key = p_key
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT coalesce(bool_and(x.status = 'Pending' AND x.key_mode = 0 AND x.claimed_at IS NULL
                             AND x.visible_at > v_now), false)
    INTO v_waiting
    FROM (SELECT d.status, d.key_mode, d.claimed_at, d.visible_at FROM workqueue.delivery d
          WHERE d.message_id = v_message ORDER BY d.id FOR UPDATE) x;
    IF NOT v_waiting THEN
        DELETE FROM workqueue.deduplication dd WHERE dd.topic = p_topic AND dd.deduplication_key = p_key;
        RETURN;
    END IF;
    SELECT t.max_payload_bytes INTO v_cap FROM workqueue.topic t WHERE t.name = p_topic;
    IF v_cap IS NOT NULL AND p_envelope_bytes > v_cap THEN
        RAISE EXCEPTION 'the debounced envelope is % bytes; topic % accepts at most % bytes (max_payload_bytes)',
            p_envelope_bytes, quote_literal(p_topic), v_cap USING ERRCODE = 'program_limit_exceeded';
    END IF;
    UPDATE workqueue.message m SET payload = p_payload, content_hash = p_content_hash WHERE m.id = v_message;
    UPDATE workqueue.delivery d SET visible_at = v_due WHERE d.message_id = v_message;
    UPDATE workqueue.deduplication dd SET expires_at = v_due
    WHERE dd.topic = p_topic AND dd.deduplication_key = p_key;
    RETURN QUERY SELECT v_message;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Ends of watched deliveries (a job's wait)
-- ---------------------------------------------------------------------------------------------

-- Asks for the end of the message's live deliveries to be announced (NOTIFY workqueue_ended with
-- the MessageID, sent by the delivery_ended trigger in the transaction that ends one). A delivery
-- that has ended already is left as it is: the waiter reads its status after this call.
CREATE OR REPLACE FUNCTION workqueue.watch_message(p_message_id uuid)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE workqueue.delivery d SET watched = true
    WHERE d.message_id = p_message_id AND d.status IN ('Pending', 'InFlight') AND d.watched IS NOT TRUE
$$;

-- What happens when a delivery ends (Completed, DeadLettered or Discarded), whichever routine
-- ends it: a settle, a lease that ran out, a discard. The trigger fires only for a delivery that
-- asks for it (its WHEN reads columns of the row alone). It is on settled_at, which every routine
-- that ends a delivery writes and a claim or heartbeat never names: their statements skip the
-- trigger before its WHEN is even prepared (a few microseconds a statement).
-- A watched delivery notifies its waiters; a group member's first end counts its group down, and
-- the end that counts it to 0 makes the group's held message due now (and wakes its consumers).
CREATE OR REPLACE FUNCTION workqueue.delivery_ended()
RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_at timestamptz := coalesce(NEW.settled_at, now());
    v_remaining integer;
    v_then uuid;
BEGIN
    IF NEW.watched THEN
        PERFORM pg_notify('workqueue_ended', NEW.message_id::text);
    END IF;
    IF NEW.group_id IS NOT NULL THEN
        UPDATE workqueue.message_group_member mm SET ended_at = v_at
        WHERE mm.group_id = NEW.group_id AND mm.message_id = NEW.message_id AND mm.ended_at IS NULL;
        IF FOUND THEN
            UPDATE workqueue.message_group g SET remaining = g.remaining - 1,
                   released_at = CASE WHEN g.remaining = 1 THEN v_at END
            WHERE g.id = NEW.group_id
            RETURNING g.remaining, g.then_message_id INTO v_remaining, v_then;
            IF v_remaining = 0 THEN
                PERFORM workqueue.release_group_message(v_then, v_at);
            END IF;
        END IF;
    END IF;
    RETURN NULL;
END
$$;

-- Makes a group's held message due at p_at (its Pending deliveries) and wakes their consumers.
CREATE OR REPLACE FUNCTION workqueue.release_group_message(p_message_id uuid, p_at timestamptz)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_subscription integer;
BEGIN
    FOR v_subscription IN
        UPDATE workqueue.delivery d SET visible_at = p_at
        WHERE d.message_id = p_message_id AND d.status = 'Pending' AND d.key_mode = 0
        RETURNING d.subscription_id
    LOOP
        PERFORM pg_notify('workqueue', v_subscription::text);
    END LOOP;
END
$$;

CREATE TRIGGER delivery_ended AFTER UPDATE OF settled_at ON workqueue.delivery
FOR EACH ROW
WHEN (NEW.status IN ('Completed', 'DeadLettered', 'Discarded') AND OLD.status IS DISTINCT FROM NEW.status
      AND (NEW.watched OR NEW.group_id IS NOT NULL))
EXECUTE FUNCTION workqueue.delivery_ended();

-- ---------------------------------------------------------------------------------------------
-- Groups (fan-in): a message held until its members end
-- ---------------------------------------------------------------------------------------------

-- Makes p_members (MessageIDs, in order) a group whose end releases p_then, all published in the
-- caller's transaction (p_then with its deliveries held: visible at 9999-12-31). A member that has
-- ended already, or has no delivery, counts as ended; when every member has, p_then is due now.
CREATE OR REPLACE FUNCTION workqueue.group_create(p_group uuid, p_members uuid[], p_then uuid)
RETURNS TABLE (remaining integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_remaining integer;
BEGIN
    INSERT INTO workqueue.message_group (id, then_message_id, members, remaining)
    VALUES (p_group, p_then, cardinality(p_members), 0);
    INSERT INTO workqueue.message_group_member (group_id, message_id, ordinal)
    SELECT p_group, m.id, m.n::integer FROM unnest(p_members) WITH ORDINALITY AS m(id, n);
    UPDATE workqueue.delivery d SET group_id = p_group WHERE d.message_id = ANY (p_members);
    UPDATE workqueue.message_group_member mm SET ended_at = now()
    WHERE mm.group_id = p_group AND NOT EXISTS (
        SELECT 1 FROM workqueue.delivery d
        WHERE d.message_id = mm.message_id AND d.status IN ('Pending', 'InFlight'));
    SELECT count(*) INTO v_remaining FROM workqueue.message_group_member mm
    WHERE mm.group_id = p_group AND mm.ended_at IS NULL;
    UPDATE workqueue.message_group g SET remaining = v_remaining,
           released_at = CASE WHEN v_remaining = 0 THEN now() END
    WHERE g.id = p_group;
    IF v_remaining = 0 THEN
        PERFORM workqueue.release_group_message(p_then, now());
    END IF;
    RETURN QUERY SELECT v_remaining;
END
$$;

-- The members of a group, in order, each with its first delivery as message_deliveries answers it
-- (no row for a member the store no longer has: purged) and its stored result.
CREATE OR REPLACE FUNCTION workqueue.group_members(p_group uuid)
RETURNS TABLE (
    ordinal integer, message_id uuid, ended_at timestamptz, delivery_id bigint, subscription text,
    status text, attempt integer, max_attempts integer, visible_at timestamptz, reason text, last_error text,
    created_at timestamptz, claimed_at timestamptz, settled_at timestamptz, attributes jsonb, result text
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT mm.ordinal, mm.message_id, mm.ended_at, d.id, s.name, d.status, d.attempt, d.max_attempts,
           d.visible_at, d.reason, d.last_error, d.created_at, d.claimed_at, d.settled_at, m.attributes, r.value
    FROM workqueue.message_group_member mm
    LEFT JOIN LATERAL (
        SELECT x.* FROM workqueue.delivery x WHERE x.message_id = mm.message_id ORDER BY x.id LIMIT 1
    ) d ON true
    LEFT JOIN workqueue.subscription s ON s.id = d.subscription_id
    LEFT JOIN workqueue.message m ON m.id = mm.message_id
    LEFT JOIN workqueue.message_result r ON r.message_id = mm.message_id
    WHERE mm.group_id = p_group
    ORDER BY mm.ordinal
$$;

-- ---------------------------------------------------------------------------------------------
-- Operator actions
-- ---------------------------------------------------------------------------------------------

-- DeadLettered -> Pending with the same MessageID and the same place in its Ordered key,
-- attempts reset, the operator's note kept.
CREATE OR REPLACE FUNCTION workqueue.replay(p_subscription text, p_delivery_id bigint, p_note text)
RETURNS TABLE (result text, delivery_status text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_d record;
BEGIN
    SELECT d.id, d.status, d.key_mode, d.subscription_id, d.partition_key, d.attempt INTO v_d
    FROM workqueue.delivery d JOIN workqueue.subscription s ON s.id = d.subscription_id
    WHERE d.id = p_delivery_id AND s.name = p_subscription;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'NotFound'::text, NULL::text;
        RETURN;
    END IF;
    IF v_d.key_mode > 0 THEN
        INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
        VALUES (v_d.subscription_id, v_d.partition_key)
        ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id;
    END IF;
    UPDATE workqueue.delivery d
    SET status = 'Pending', attempt = 0, visible_at = now(), note = p_note, reason = NULL,
        settled_at = NULL, cancel_requested = false
    WHERE d.id = p_delivery_id AND d.status = 'DeadLettered';
    IF NOT FOUND THEN
        IF v_d.key_mode > 0 THEN
            PERFORM workqueue.refresh_partition(v_d.subscription_id, v_d.partition_key, v_d.key_mode);
        END IF;
        RETURN QUERY SELECT 'NotDeadLettered'::text, d.status FROM workqueue.delivery d WHERE d.id = p_delivery_id;
        RETURN;
    END IF;
    IF v_d.key_mode = 0 OR workqueue.refresh_partition(v_d.subscription_id, v_d.partition_key, v_d.key_mode) THEN
        PERFORM pg_notify('workqueue', v_d.subscription_id::text);
    END IF;
    -- The replay is kept as an attempt of its own, so the error before it reads as a past attempt.
    INSERT INTO workqueue.delivery_attempt (delivery_id, attempt, ended_at, outcome, reason)
    VALUES (p_delivery_id, v_d.attempt, now(), 'Replayed', p_note);
    DELETE FROM workqueue.delivery_attempt a
    WHERE a.delivery_id = p_delivery_id
      AND a.id <= (SELECT b.id FROM workqueue.delivery_attempt b WHERE b.delivery_id = p_delivery_id
                   ORDER BY b.id DESC OFFSET 50 LIMIT 1);
    RETURN QUERY SELECT 'Replayed'::text, 'Pending'::text;
END
$$;

-- Pending or DeadLettered -> Discarded with the reason. InFlight -> cancel requested: the
-- holder's next heartbeat reports it and the delivery becomes Discarded when the holder settles
-- (or at lease expiry if the holder died). It is never retried.
CREATE OR REPLACE FUNCTION workqueue.discard(p_subscription text, p_delivery_id bigint, p_reason text)
RETURNS TABLE (result text, cancel_requested boolean, delivery_status text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_d record;
    v_status text;
BEGIN
    SELECT d.id, d.status, d.key_mode, d.subscription_id, d.partition_key INTO v_d
    FROM workqueue.delivery d JOIN workqueue.subscription s ON s.id = d.subscription_id
    WHERE d.id = p_delivery_id AND s.name = p_subscription;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'NotFound'::text, false, NULL::text;
        RETURN;
    END IF;
    FOR v_try IN 1..3 LOOP
        -- An InFlight delivery is only flagged: that needs no key lock.
        -- (a second cancel keeps the first one's reason: the operator's word is not overwritten)
        UPDATE workqueue.delivery d
        SET reason = CASE WHEN d.cancel_requested THEN d.reason ELSE p_reason END, cancel_requested = true
        WHERE d.id = p_delivery_id AND d.status = 'InFlight';
        IF FOUND THEN
            RETURN QUERY SELECT 'CancelRequested'::text, true, 'InFlight'::text;
            RETURN;
        END IF;
        IF v_d.key_mode > 0 THEN
            INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
            VALUES (v_d.subscription_id, v_d.partition_key)
            ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id;
        END IF;
        UPDATE workqueue.delivery d
        SET status = 'Discarded', reason = p_reason, settled_at = now(), lease_token = NULL,
            lease_expires_at = NULL
        WHERE d.id = p_delivery_id AND d.status IN ('Pending', 'DeadLettered')
        RETURNING d.status INTO v_status;
        IF v_status IS NOT NULL THEN
            INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
            VALUES (v_d.subscription_id, 0, 1);
            IF v_d.key_mode > 0 AND workqueue.refresh_partition(v_d.subscription_id, v_d.partition_key, v_d.key_mode) THEN
                PERFORM pg_notify('workqueue', v_d.subscription_id::text);
            END IF;
            RETURN QUERY SELECT 'Discarded'::text, false, 'Discarded'::text;
            RETURN;
        END IF;
        SELECT d.status INTO v_status FROM workqueue.delivery d WHERE d.id = p_delivery_id;
        IF v_status IN ('Completed', 'Discarded') THEN
            IF v_d.key_mode > 0 THEN
                PERFORM workqueue.refresh_partition(v_d.subscription_id, v_d.partition_key, v_d.key_mode);
            END IF;
            RETURN QUERY SELECT 'AlreadyTerminal'::text, false, v_status;
            RETURN;
        END IF;
        -- It was claimed between the two updates: go round again.
    END LOOP;
    RAISE EXCEPTION 'delivery % changed state while being discarded; retry', p_delivery_id
        USING ERRCODE = 'serialization_failure';
END
$$;

-- Discards up to p_limit DeadLettered deliveries of a subscription settled before
-- p_settled_before (reason 'pruned'), oldest id first, counted in settled_count, their keys
-- handed over as a settle hands them; returns how many it discarded. A dead letter another
-- transaction holds (a replay) is skipped.
CREATE OR REPLACE FUNCTION workqueue.discard_dead_letters(
    p_subscription text, p_settled_before timestamptz, p_limit integer
) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    v_count integer;
    v_keyed boolean;
BEGIN
    WITH u AS (
        UPDATE workqueue.delivery d
        SET status = 'Discarded', reason = 'pruned', settled_at = now(), lease_token = NULL,
            lease_expires_at = NULL
        WHERE d.id IN (
            SELECT x.id FROM workqueue.delivery x
            JOIN workqueue.subscription s ON s.id = x.subscription_id
            WHERE s.name = p_subscription AND x.status = 'DeadLettered' AND x.settled_at < p_settled_before
            ORDER BY x.id
            LIMIT p_limit
            FOR UPDATE OF x SKIP LOCKED
        )
        RETURNING d.id, d.subscription_id, d.key_mode
    ), counted AS (
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, 0, count(*)
        FROM u
        GROUP BY u.subscription_id
    )
    SELECT array_agg(u.id), count(*), bool_or(u.key_mode > 0) INTO v_ids, v_count, v_keyed
    FROM u;
    IF v_keyed THEN
        PERFORM pg_notify('workqueue', r.subscription_id::text) FROM workqueue.release_keys(v_ids) r;
    END IF;
    RETURN v_count;
END
$$;

-- Replaces a stored message's payload and content hash (re-encryption with a new key) while none
-- of its deliveries is InFlight or ended Completed or Discarded; true when it rewrote, false when
-- the message is not stored or a delivery forbids it. Its deliveries are locked first, so none is
-- claimed meanwhile. An envelope over the topic's cap is refused.
CREATE OR REPLACE FUNCTION workqueue.rewrite_payload(
    p_message_id uuid, p_payload text, p_content_hash text, p_envelope_bytes integer
) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_topic text;
    v_cap integer;
    v_settled boolean;
BEGIN
    SELECT m.topic, t.max_payload_bytes INTO v_topic, v_cap
    FROM workqueue.message m LEFT JOIN workqueue.topic t ON t.name = m.topic
    WHERE m.id = p_message_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_cap IS NOT NULL AND p_envelope_bytes > v_cap THEN
        RAISE EXCEPTION 'the rewritten envelope is % bytes; topic % accepts at most % bytes (max_payload_bytes)',
            p_envelope_bytes, quote_literal(v_topic), v_cap USING ERRCODE = 'program_limit_exceeded';
    END IF;
    SELECT coalesce(bool_or(x.status IN ('InFlight', 'Completed', 'Discarded')), false) INTO v_settled
    FROM (SELECT d.status FROM workqueue.delivery d WHERE d.message_id = p_message_id ORDER BY d.id FOR UPDATE) x;
    IF v_settled THEN
        RETURN false;
    END IF;
    UPDATE workqueue.message m SET payload = p_payload, content_hash = p_content_hash
    WHERE m.id = p_message_id;
    RETURN FOUND;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Operator reads
-- ---------------------------------------------------------------------------------------------

-- Counts by state per subscription. The live states are read through partial indexes; Completed
-- and Discarded come from settled_count, never from the history.
CREATE OR REPLACE FUNCTION workqueue.stats(p_subscription text DEFAULT NULL)
RETURNS TABLE (
    subscription text, topic text, subscription_status text, partition_mode text,
    pending bigint, claimable bigint, in_flight bigint, dead_lettered bigint, completed bigint,
    discarded bigint, oldest_pending_at timestamptz
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- Each count reads the rows of its state through a partial index: Pending in three parts (by
    -- key mode, the indexes claims use), InFlight, DeadLettered. Completed and Discarded, the
    -- states history accumulates in, are the sums of settled_count.
    SELECT s.name, s.topic, CASE WHEN s.status = 'Active' AND s.retired_at IS NOT NULL THEN 'Retired' ELSE s.status END, s.partition_mode,
           p.pending, coalesce(cl.claimable, 0), f.in_flight, dl.dead_lettered,
           coalesce(t.completed, 0)::bigint, coalesce(t.discarded, 0)::bigint, p.oldest_pending_at
    FROM workqueue.subscription s
    LEFT JOIN (
        SELECT c.subscription_id, sum(c.completed) AS completed, sum(c.discarded) AS discarded
        FROM workqueue.settled_count c
        GROUP BY c.subscription_id
    ) t ON t.subscription_id = s.id
    CROSS JOIN LATERAL (
        -- oldest_pending_at: since when the longest-waiting due delivery waits (one still
        -- delayed or backing off is not waiting yet)
        SELECT count(*) AS pending, min(w.visible_at) FILTER (WHERE w.visible_at <= now()) AS oldest_pending_at
        FROM (
            SELECT d.visible_at FROM workqueue.delivery d
            WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
            UNION ALL
            SELECT d.visible_at FROM workqueue.delivery d
            WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 1
            UNION ALL
            SELECT d.visible_at FROM workqueue.delivery d
            WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 2
        ) w
    ) p
    CROSS JOIN LATERAL (
        SELECT count(*) AS in_flight FROM workqueue.delivery d
        WHERE d.subscription_id = s.id AND d.status = 'InFlight'
    ) f
    CROSS JOIN LATERAL (
        SELECT count(*) AS dead_lettered FROM workqueue.delivery d
        WHERE d.subscription_id = s.id AND d.status = 'DeadLettered'
    ) dl
    JOIN workqueue.topic tp ON tp.name = s.topic
    LEFT JOIN LATERAL (
        -- (nothing is claimable while the subscription or its topic is paused, as backlog says)
        SELECT (SELECT count(*) FROM workqueue.delivery d
                WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
                  AND d.visible_at <= now())
             + (SELECT count(*) FROM workqueue.partition p
                WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                  AND p.next_visible_at <= now()) AS claimable
        WHERE s.status = 'Active' AND tp.status = 'Active'
    ) cl ON true
    WHERE p_subscription IS NULL OR s.name = p_subscription
    ORDER BY s.name
$$;

-- Backlog for autoscalers: claimable Pending (single flight per key applied) plus InFlight. A
-- paused subscription has nothing claimable.
CREATE OR REPLACE FUNCTION workqueue.backlog(p_subscription text)
RETURNS TABLE (subscription text, claimable bigint, in_flight bigint, backlog bigint)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH s AS (
        SELECT s.id, s.name, s.status = 'Active' AND t.status = 'Active' AS active
        FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic
        WHERE s.name = p_subscription
    ), n AS (
        SELECT s.name,
               CASE WHEN s.active THEN
                   (SELECT count(*) FROM workqueue.delivery d
                    WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
                      AND d.visible_at <= now())
                 + (SELECT count(*) FROM workqueue.partition p
                    WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                      AND p.next_visible_at <= now())
               ELSE 0 END AS claimable,
               (SELECT count(*) FROM workqueue.delivery d
                WHERE d.subscription_id = s.id AND d.status = 'InFlight') AS in_flight
        FROM s
    )
    SELECT n.name, n.claimable, n.in_flight, n.claimable + n.in_flight FROM n
$$;

-- One delivery with its message.
CREATE OR REPLACE FUNCTION workqueue.get_delivery(p_delivery_id bigint)
RETURNS TABLE (
    delivery_id bigint, subscription text, message_id uuid, topic text, partition_key text,
    status text, attempt integer, max_attempts integer, visible_at timestamptz,
    lease_expires_at timestamptz, cancel_requested boolean, progress_percent smallint,
    progress_message text, reason text, last_error text, note text, created_at timestamptz,
    claimed_at timestamptz, settled_at timestamptz, attributes jsonb, payload text,
    correlation_id text,
    holder_id uuid, holder_host text, holder_pid integer, holder_started_at timestamptz
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.id, s.name, d.message_id, m.topic, d.partition_key, d.status, d.attempt,
           d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id,
           d.held_by, p.hostname, p.pid, p.started_at
    FROM workqueue.delivery d
    JOIN workqueue.subscription s ON s.id = d.subscription_id
    JOIN workqueue.message m ON m.id = d.message_id
    LEFT JOIN workqueue.process p ON p.id = d.held_by
    WHERE d.id = p_delivery_id
$$;

-- The kept attempts of one delivery (off the happy path: see delivery_attempt), oldest first,
-- each with the process that held it as the registry knows it.
CREATE OR REPLACE FUNCTION workqueue.delivery_attempts(p_delivery_id bigint)
RETURNS TABLE (
    attempt integer, started_at timestamptz, ended_at timestamptz, outcome text, reason text, error text,
    holder_id uuid, holder_host text, holder_pid integer, holder_started_at timestamptz
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT a.attempt, a.started_at, a.ended_at, a.outcome, a.reason, a.error,
           a.held_by, p.hostname, p.pid, p.started_at
    FROM workqueue.delivery_attempt a
    LEFT JOIN workqueue.process p ON p.id = a.held_by
    WHERE a.delivery_id = p_delivery_id
    ORDER BY a.id
    LIMIT 50
$$;

-- Every delivery of one message, each with its subscription, as get_delivery answers, by id.
CREATE OR REPLACE FUNCTION workqueue.message_deliveries(p_message_id uuid)
RETURNS TABLE (
    delivery_id bigint, subscription text, message_id uuid, topic text, partition_key text,
    status text, attempt integer, max_attempts integer, visible_at timestamptz,
    lease_expires_at timestamptz, cancel_requested boolean, progress_percent smallint,
    progress_message text, reason text, last_error text, note text, created_at timestamptz,
    claimed_at timestamptz, settled_at timestamptz, attributes jsonb, payload text,
    correlation_id text,
    holder_id uuid, holder_host text, holder_pid integer, holder_started_at timestamptz
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.id, s.name, d.message_id, m.topic, d.partition_key, d.status, d.attempt,
           d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id,
           d.held_by, p.hostname, p.pid, p.started_at
    FROM workqueue.delivery d
    JOIN workqueue.subscription s ON s.id = d.subscription_id
    JOIN workqueue.message m ON m.id = d.message_id
    LEFT JOIN workqueue.process p ON p.id = d.held_by
    WHERE d.message_id = p_message_id
    ORDER BY d.id
$$;

-- Deliveries found by what an operator has at hand: a delivery id, a MessageID, a partition key,
-- a correlation ID or a job name (matched says which), newest first, at most p_limit (at most
-- 100). Every branch reads an index and at most p_limit messages: the primary keys,
-- delivery_message, and the partial search indexes of message.
CREATE OR REPLACE FUNCTION workqueue.search_deliveries(p_query text, p_limit integer)
RETURNS TABLE (
    delivery_id bigint, subscription text, message_id uuid, topic text, partition_key text,
    status text, attempt integer, max_attempts integer, visible_at timestamptz,
    lease_expires_at timestamptz, cancel_requested boolean, progress_percent smallint,
    progress_message text, reason text, last_error text, note text, created_at timestamptz,
    claimed_at timestamptz, settled_at timestamptz, attributes jsonb, payload text,
    correlation_id text,
    holder_id uuid, holder_host text, holder_pid integer, holder_started_at timestamptz,
    matched text
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_limit integer := least(greatest(coalesce(p_limit, 25), 1), 100);
    v_query text := btrim(p_query);
    v_messages uuid[] := '{}';
    v_matched text[] := '{}';
    v_id bigint;
BEGIN
    IF v_query IS NULL OR v_query = '' THEN
        RETURN;
    END IF;
    IF v_query ~ '^[0-9]{1,18}$' THEN
        v_id := v_query::bigint;
    END IF;
    IF v_query ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
        v_messages := ARRAY[v_query::uuid];
        v_matched := ARRAY['MessageID'];
    END IF;
    SELECT v_messages || coalesce(array_agg(x.id), '{}'), v_matched || coalesce(array_agg(x.what), '{}')
    INTO v_messages, v_matched
    FROM (
        (SELECT m.id, 'partition key' AS what FROM workqueue.message m
         WHERE m.partition_key = v_query AND m.partition_key IS NOT NULL
         ORDER BY m.published_at DESC LIMIT v_limit)
        UNION ALL
        (SELECT m.id, 'correlation ID' FROM workqueue.message m
         WHERE m.correlation_id = v_query AND m.correlation_id IS NOT NULL
         ORDER BY m.published_at DESC LIMIT v_limit)
        UNION ALL
        (SELECT m.id, 'job' FROM workqueue.message m
         WHERE (m.attributes ->> 'job') = v_query AND m.attributes ? 'job'
         ORDER BY m.published_at DESC LIMIT v_limit)
    ) x;
    -- Each delivery once, with the first way it matched (in the order above).
    RETURN QUERY
    SELECT DISTINCT ON (d.id)
           d.id, s.name, d.message_id, m.topic, d.partition_key, d.status, d.attempt,
           d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id,
           d.held_by, p.hostname, p.pid, p.started_at, f.what
    FROM (
        SELECT v_id AS delivery_id, NULL::uuid AS message_id, 'delivery id'::text AS what, 0::bigint AS ord
        WHERE v_id IS NOT NULL
        UNION ALL
        SELECT NULL, u.message_id, u.what, u.ord
        FROM unnest(v_messages, v_matched) WITH ORDINALITY AS u(message_id, what, ord)
    ) f
    CROSS JOIN LATERAL (
        SELECT x.* FROM workqueue.delivery x
        WHERE (f.delivery_id IS NOT NULL AND x.id = f.delivery_id)
           OR (f.message_id IS NOT NULL AND x.message_id = f.message_id)
        LIMIT v_limit
    ) d
    JOIN workqueue.subscription s ON s.id = d.subscription_id
    JOIN workqueue.message m ON m.id = d.message_id
    LEFT JOIN workqueue.process p ON p.id = d.held_by
    ORDER BY d.id DESC, f.ord
    LIMIT v_limit;
END
$$;

-- Which of the given MessageIDs the store has.
CREATE OR REPLACE FUNCTION workqueue.known_messages(p_ids uuid[])
RETURNS TABLE (message_id uuid)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m.id FROM workqueue.message m WHERE m.id = ANY (p_ids)
$$;

-- Deliveries of one subscription in one state, oldest first, paged by id, with every field of
-- get_delivery. DeadLettered and InFlight are named literally, so their pages read their partial
-- indexes; a state given as a parameter can use none.
CREATE OR REPLACE FUNCTION workqueue.list_deliveries(
    p_subscription text, p_status text, p_limit integer, p_after_id bigint DEFAULT 0
) RETURNS TABLE (
    delivery_id bigint, message_id uuid, topic text, partition_key text, status text, attempt integer,
    max_attempts integer, visible_at timestamptz, lease_expires_at timestamptz, cancel_requested boolean,
    progress_percent smallint, progress_message text, reason text, last_error text, note text,
    created_at timestamptz, claimed_at timestamptz, settled_at timestamptz, attributes jsonb, payload text,
    correlation_id text,
    holder_id uuid, holder_host text, holder_pid integer, holder_started_at timestamptz
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_subscription integer;
BEGIN
    SELECT s.id INTO v_subscription FROM workqueue.subscription s WHERE s.name = p_subscription;
    IF v_subscription IS NULL THEN
        RETURN;
    END IF;
    IF p_status = 'DeadLettered' THEN
        RETURN QUERY
        SELECT d.id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts, d.visible_at,
               d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message, d.reason,
               d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload,
               m.correlation_id,
               d.held_by, p.hostname, p.pid, p.started_at
        FROM workqueue.delivery d
        JOIN workqueue.message m ON m.id = d.message_id
        LEFT JOIN workqueue.process p ON p.id = d.held_by
        WHERE d.subscription_id = v_subscription AND d.status = 'DeadLettered' AND d.id > coalesce(p_after_id, 0)
        ORDER BY d.id
        LIMIT p_limit;
    ELSIF p_status = 'InFlight' THEN
        RETURN QUERY
        SELECT d.id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts, d.visible_at,
               d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message, d.reason,
               d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload,
               m.correlation_id,
               d.held_by, p.hostname, p.pid, p.started_at
        FROM workqueue.delivery d
        JOIN workqueue.message m ON m.id = d.message_id
        LEFT JOIN workqueue.process p ON p.id = d.held_by
        WHERE d.subscription_id = v_subscription AND d.status = 'InFlight' AND d.id > coalesce(p_after_id, 0)
        ORDER BY d.id
        LIMIT p_limit;
    ELSE
        RETURN QUERY
        SELECT d.id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts, d.visible_at,
               d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message, d.reason,
               d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload,
               m.correlation_id,
               d.held_by, p.hostname, p.pid, p.started_at
        FROM workqueue.delivery d
        JOIN workqueue.message m ON m.id = d.message_id
        LEFT JOIN workqueue.process p ON p.id = d.held_by
        WHERE d.subscription_id = v_subscription AND d.status = p_status AND d.id > coalesce(p_after_id, 0)
        ORDER BY d.id
        LIMIT p_limit;
    END IF;
END
$$;

-- A process's beat: its row written (or renewed) with what it serves now; rows unseen for a
-- week are deleted.
CREATE OR REPLACE FUNCTION workqueue.process_beat(
    p_id uuid, p_hostname text, p_pid integer, p_started_at timestamptz, p_version text,
    p_subscriptions jsonb, p_slots integer, p_busy integer, p_beat_interval_seconds double precision
) RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO workqueue.process AS p (
        id, hostname, pid, started_at, version, subscriptions, slots, busy, beat_interval_seconds,
        last_seen_at, stopped_at
    ) VALUES (
        p_id, p_hostname, p_pid, p_started_at, p_version, p_subscriptions, p_slots, p_busy,
        p_beat_interval_seconds, now(), NULL
    )
    ON CONFLICT (id) DO UPDATE
    SET version = excluded.version, subscriptions = excluded.subscriptions, slots = excluded.slots,
        busy = excluded.busy, beat_interval_seconds = excluded.beat_interval_seconds,
        last_seen_at = now(), stopped_at = NULL;
    DELETE FROM workqueue.process p WHERE p.last_seen_at < now() - interval '7 days';
$$;

-- A process's host stopped: its row stays (the deliveries it held name it) with stopped_at set.
CREATE OR REPLACE FUNCTION workqueue.process_stop(p_id uuid)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE workqueue.process p SET stopped_at = now(), busy = 0, last_seen_at = now() WHERE p.id = p_id;
$$;

-- The processes known, live ones first, each with its state (Running, Stopped, Gone: not seen
-- within three beat intervals) and the deliveries it holds InFlight now.
CREATE OR REPLACE FUNCTION workqueue.list_processes()
RETURNS TABLE (
    process_id uuid, hostname text, pid integer, started_at timestamptz, version text,
    subscriptions jsonb, slots integer, busy integer, last_seen_at timestamptz,
    stopped_at timestamptz, state text, in_flight bigint
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p.id, p.hostname, p.pid, p.started_at, p.version, p.subscriptions, p.slots, p.busy,
           p.last_seen_at, p.stopped_at,
           CASE WHEN p.stopped_at IS NOT NULL THEN 'Stopped'
                WHEN p.last_seen_at < now() - make_interval(secs => 3 * p.beat_interval_seconds) THEN 'Gone'
                ELSE 'Running' END,
           (SELECT count(*) FROM workqueue.delivery d WHERE d.status = 'InFlight' AND d.held_by = p.id)
    FROM workqueue.process p
    ORDER BY p.stopped_at IS NOT NULL, p.last_seen_at DESC, p.id
$$;

-- Keys of an Exclusive or Ordered subscription with live work. condition: InFlight (a delivery
-- of the key is running), Blocked (Ordered: the head is dead-lettered, or waiting to be retried),
-- Idle (waiting work, nothing running, not blocked).
CREATE OR REPLACE FUNCTION workqueue.partitions(p_subscription text, p_condition text, p_limit integer)
RETURNS TABLE (
    partition_key text, condition text, head_delivery_id bigint, head_status text,
    head_attempt integer, head_visible_at timestamptz, waiting_items bigint
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH s AS (
        SELECT s.id, s.partition_mode FROM workqueue.subscription s WHERE s.name = p_subscription
    ), k AS (
        SELECT p.partition_key,
               CASE WHEN p.holder_id IS NOT NULL THEN 'InFlight'
                    WHEN p.blocked_id IS NOT NULL THEN 'Blocked'
                    WHEN s.partition_mode = 'Ordered' AND h.attempt > 0 AND p.next_visible_at > now() THEN 'Blocked'
                    ELSE 'Idle' END AS condition,
               coalesce(p.holder_id, p.blocked_id, p.next_id) AS head_id
        FROM workqueue.partition p
        JOIN s ON s.id = p.subscription_id
        LEFT JOIN workqueue.delivery h ON h.id = coalesce(p.holder_id, p.blocked_id, p.next_id)
    )
    SELECT k.partition_key, k.condition, k.head_id, h.status, h.attempt, h.visible_at,
           (SELECT count(*) FROM workqueue.delivery w, s
            WHERE w.subscription_id = s.id AND w.partition_key = k.partition_key
              AND w.status = 'Pending' AND w.id <> k.head_id)
    FROM k
    LEFT JOIN workqueue.delivery h ON h.id = k.head_id
    WHERE p_condition IS NULL OR k.condition = p_condition
    ORDER BY k.partition_key
    LIMIT p_limit
$$;

-- The sweeper's history, at most one row per subscription a minute: this minute's live
-- counts and the completions since the previous row, counted over delivery_settled up to 30 s ago
-- (a settle still running then has not committed); rows past p_keep_seconds are deleted. Writes
-- nothing when this minute is recorded or another transaction is recording it; p_now stands in for
-- the clock (tests).
CREATE OR REPLACE FUNCTION workqueue.record_stats_history(
    p_keep_seconds double precision DEFAULT 86400, p_now timestamptz DEFAULT NULL
) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_last timestamptz;
    v_to timestamptz := coalesce(p_now, now()) - interval '30 seconds';
    v_from timestamptz;
    v_rows integer;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('workqueue.stats_history')::bigint) THEN
        RETURN 0;
    END IF;
    SELECT max(h.recorded_at) INTO v_last FROM workqueue.stats_history h;
    IF v_last >= date_trunc('minute', v_now) THEN
        RETURN 0;
    END IF;
    v_from := CASE WHEN v_last > v_now - interval '1 hour' THEN v_last - interval '30 seconds'
                   ELSE v_to - interval '1 minute' END;
    INSERT INTO workqueue.stats_history
        (subscription_id, recorded_at, pending, in_flight, dead_lettered, completed, window_seconds)
    SELECT s.id, v_now, st.pending, st.in_flight, st.dead_lettered, coalesce(c.completed, 0),
           extract(epoch FROM v_to - v_from)::double precision
    FROM workqueue.stats(NULL) st
    JOIN workqueue.subscription s ON s.name = st.subscription
    LEFT JOIN (
        SELECT d.subscription_id, count(*) AS completed
        FROM workqueue.delivery d
        WHERE d.status = 'Completed' AND d.settled_at >= v_from AND d.settled_at < v_to
        GROUP BY d.subscription_id
    ) c ON c.subscription_id = s.id;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    DELETE FROM workqueue.stats_history h
    WHERE h.recorded_at < v_now - make_interval(secs => p_keep_seconds);
    RETURN v_rows;
END
$$;

-- The history recorded since p_since (at most a day back), of one subscription or of all.
CREATE OR REPLACE FUNCTION workqueue.stats_history(p_since timestamptz, p_subscription text DEFAULT NULL)
RETURNS TABLE (
    subscription text, recorded_at timestamptz, pending bigint, in_flight bigint, dead_lettered bigint,
    completed bigint, window_seconds double precision
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT s.name, h.recorded_at, h.pending, h.in_flight, h.dead_lettered, h.completed, h.window_seconds
    FROM workqueue.stats_history h
    JOIN workqueue.subscription s ON s.id = h.subscription_id
    WHERE h.recorded_at >= greatest(p_since, now() - interval '1 day')
      AND (p_subscription IS NULL OR s.name = p_subscription)
    ORDER BY h.recorded_at, s.name
$$;

-- The dashboard's counts: each subscription's live counts, each stopping at p_cap (a page shows "p_cap or more").
CREATE OR REPLACE FUNCTION workqueue.live_counts(
    p_subscription text DEFAULT NULL, p_cap integer DEFAULT 1000, p_stuck_before timestamptz DEFAULT NULL
) RETURNS TABLE (
    subscription text, pending bigint, in_flight bigint, dead_lettered bigint, oldest_pending_at timestamptz,
    stuck bigint
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT s.name,
           least(
               (SELECT count(*) FROM (SELECT 1 FROM workqueue.delivery d WHERE d.subscription_id = s.id
                                        AND d.status = 'Pending' AND d.key_mode = 0
                                      ORDER BY d.visible_at, d.id LIMIT p_cap) x)
             + (SELECT count(*) FROM (SELECT 1 FROM workqueue.delivery d WHERE d.subscription_id = s.id
                                        AND d.status = 'Pending' AND d.key_mode = 1
                                      ORDER BY d.partition_key, d.visible_at, d.id LIMIT p_cap) x)
             + (SELECT count(*) FROM (SELECT 1 FROM workqueue.delivery d WHERE d.subscription_id = s.id
                                        AND d.status = 'Pending' AND d.key_mode = 2
                                      ORDER BY d.partition_key, d.id LIMIT p_cap) x),
               p_cap),
           (SELECT count(*) FROM (SELECT 1 FROM workqueue.delivery d WHERE d.subscription_id = s.id
                                    AND d.status = 'InFlight' LIMIT p_cap) x),
           (SELECT count(*) FROM (SELECT 1 FROM workqueue.delivery d WHERE d.subscription_id = s.id
                                    AND d.status = 'DeadLettered' ORDER BY d.id LIMIT p_cap) x),
           -- Since when the longest-waiting claimable work waits: the head of delivery_claim and of
           -- partition_ready (a time still to come: nothing waits yet).
           least(
               (SELECT d.visible_at FROM workqueue.delivery d WHERE d.subscription_id = s.id
                  AND d.status = 'Pending' AND d.key_mode = 0 ORDER BY d.visible_at, d.id LIMIT 1),
               (SELECT p.next_visible_at FROM workqueue.partition p WHERE p.subscription_id = s.id
                  AND p.holder_id IS NULL AND p.next_id IS NOT NULL ORDER BY p.next_visible_at LIMIT 1)),
           -- InFlight deliveries claimed before p_stuck_before, among the first p_cap InFlight.
           CASE WHEN p_stuck_before IS NULL THEN 0::bigint ELSE
               (SELECT count(*) FILTER (WHERE x.claimed_at < p_stuck_before)
                FROM (SELECT d.claimed_at FROM workqueue.delivery d WHERE d.subscription_id = s.id
                        AND d.status = 'InFlight' LIMIT p_cap) x) END
    FROM workqueue.subscription s
    WHERE p_subscription IS NULL OR s.name = p_subscription
    ORDER BY s.name
$$;

-- How full a subscription's flow limits are (docs/design/flow-control.md), each count stopping at
-- p_cap: its InFlight deliveries whose lease runs (what max_in_flight counts), the whole tokens of
-- its rate_limit bucket now (NULL without one), its keys at their limit (key_concurrency reached or
-- key bucket empty), and the claimable deliveries a limit holds back now (all of them while the
-- subscription is full, else those of the keys at their limit). No row for an unknown name.
CREATE OR REPLACE FUNCTION workqueue.flow_state(p_subscription text, p_cap integer DEFAULT 1000,
                                               p_now timestamptz DEFAULT NULL)
RETURNS TABLE (in_flight bigint, tokens double precision, keys_at_limit bigint, waiting bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_sub record;
    v_in_flight bigint;
    v_tokens double precision;
    v_keys text[];
    v_full boolean;
    v_waiting bigint;
BEGIN
    SELECT s.id, s.max_in_flight, CASE WHEN s.partition_mode = 'None' THEN s.key_concurrency END AS key_concurrency,
           workqueue.rate_per_second(s.rate_limit) AS rate, workqueue.rate_per_second(s.key_rate_limit) AS key_rate,
           (s.status = 'Paused' OR t.status = 'Paused') AS paused
    INTO v_sub
    FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic WHERE s.name = p_subscription;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT count(*) INTO v_in_flight FROM (
        SELECT 1 FROM workqueue.delivery d
        WHERE d.subscription_id = v_sub.id AND d.status = 'InFlight' AND d.lease_expires_at > v_now
        LIMIT p_cap) x;
    IF v_sub.rate IS NOT NULL THEN
        SELECT least(greatest(1, v_sub.rate), b.tokens + greatest(0, extract(epoch FROM v_now - b.updated_at)) * v_sub.rate)
        INTO v_tokens
        FROM workqueue.rate_bucket b WHERE b.subscription_id = v_sub.id AND NOT b.per_key AND b.partition_key = '';
        v_tokens := coalesce(v_tokens, greatest(1, v_sub.rate));
    END IF;
    SELECT array_agg(k.k) INTO v_keys FROM (
        SELECT d.partition_key AS k FROM workqueue.delivery d
        WHERE v_sub.key_concurrency IS NOT NULL AND d.subscription_id = v_sub.id AND d.status = 'InFlight'
          AND d.lease_expires_at > v_now AND d.partition_key IS NOT NULL
        GROUP BY d.partition_key HAVING count(*) >= v_sub.key_concurrency
        UNION
        SELECT b.partition_key FROM workqueue.rate_bucket b
        WHERE v_sub.key_rate IS NOT NULL AND b.subscription_id = v_sub.id AND b.per_key
          AND b.tokens + greatest(0, extract(epoch FROM v_now - b.updated_at)) * v_sub.key_rate < 1
        LIMIT p_cap) k;
    v_full := (v_sub.max_in_flight IS NOT NULL AND v_in_flight >= v_sub.max_in_flight) OR v_tokens < 1;
    SELECT count(*) INTO v_waiting FROM (
        SELECT 1 FROM workqueue.delivery d
        WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0 AND d.visible_at <= v_now
          AND (v_full OR d.partition_key = ANY (v_keys)) AND NOT v_sub.paused  -- (paused: nothing is claimable)
        UNION ALL
        SELECT 1 FROM workqueue.partition p
        WHERE p.subscription_id = v_sub.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
          AND p.next_visible_at <= v_now AND (v_full OR p.partition_key = ANY (v_keys)) AND NOT v_sub.paused
        LIMIT p_cap) x;
    RETURN QUERY SELECT v_in_flight, v_tokens, coalesce(cardinality(v_keys), 0)::bigint, v_waiting;
END
$$;

-- The heads that block keys of an Ordered subscription, oldest first, at most p_limit: a
-- dead-lettered head (found through delivery_dead_letters), or a head waiting to be retried (through
-- partition_ready); waiting_items counts the key's deliveries behind it, up to p_cap.
CREATE OR REPLACE FUNCTION workqueue.blocked_keys(p_subscription text, p_limit integer, p_cap integer DEFAULT 1000)
RETURNS TABLE (
    partition_key text, head_delivery_id bigint, head_status text, head_attempt integer,
    head_visible_at timestamptz, head_reason text, waiting_items bigint
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_subscription integer;
BEGIN
    SELECT s.id INTO v_subscription FROM workqueue.subscription s
    WHERE s.name = p_subscription AND s.partition_mode = 'Ordered';
    IF v_subscription IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH heads AS (
        (SELECT d.id FROM workqueue.delivery d
         WHERE d.subscription_id = v_subscription AND d.status = 'DeadLettered' AND d.key_mode = 2
         ORDER BY d.id LIMIT p_limit)
        UNION
        (SELECT p.next_id FROM workqueue.partition p
         WHERE p.subscription_id = v_subscription AND p.holder_id IS NULL AND p.next_id IS NOT NULL
           AND p.next_visible_at > now()
         ORDER BY p.next_visible_at LIMIT p_limit)
    )
    SELECT d.partition_key, d.id, d.status, d.attempt, d.visible_at, d.reason,
           (SELECT count(*) FROM (SELECT 1 FROM workqueue.delivery w
                                  WHERE w.subscription_id = v_subscription AND w.partition_key = d.partition_key
                                    AND w.key_mode = 2 AND w.status = 'Pending' AND w.id > d.id
                                  ORDER BY w.id LIMIT p_cap) x)
    FROM heads h
    JOIN workqueue.delivery d ON d.id = h.id
    WHERE d.status = 'DeadLettered' OR d.attempt > 0
    ORDER BY d.id
    LIMIT p_limit;
END
$$;

-- Which migrations this database has (for validate-bindings).
CREATE OR REPLACE FUNCTION workqueue.schema_versions()
RETURNS TABLE (version integer, name text, checksum text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m.version, m.name, m.checksum FROM workqueue.schema_migration m ORDER BY m.version
$$;

-- ---------------------------------------------------------------------------------------------
-- API keys of the REST API (a key is shown once; only its SHA-256 is stored)
-- ---------------------------------------------------------------------------------------------

-- Stores a new key (only its SHA-256); a name an unrevoked key has is refused.
CREATE OR REPLACE FUNCTION workqueue.api_key_create(
    p_id uuid, p_name text, p_prefix text, p_key_hash text, p_scopes text[], p_expires_at timestamptz,
    p_topics text[] DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_constraint text;
BEGIN
    INSERT INTO workqueue.api_key (id, name, prefix, key_hash, scopes, expires_at, topics)
    VALUES (p_id, p_name, p_prefix, p_key_hash, p_scopes, p_expires_at, p_topics);
EXCEPTION WHEN unique_violation THEN
    GET STACKED DIAGNOSTICS v_constraint = CONSTRAINT_NAME;
    IF v_constraint = 'api_key_name_live' THEN
        RAISE EXCEPTION 'an API key named % exists already; revoke it first (workqueue api-keys revoke %) or pick another name',
            quote_literal(p_name), quote_literal(p_name) USING ERRCODE = 'unique_violation';
    END IF;
    RAISE;
END
$$;

-- The key behind a prefix whose SHA-256 is p_key_hash, if it is usable now; never its hash.
CREATE OR REPLACE FUNCTION workqueue.api_key_verify(p_prefix text, p_key_hash text)
RETURNS TABLE (id uuid, name text, scopes text[], topics text[], session_generation integer)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT k.id, k.name, k.scopes, k.topics, k.session_generation FROM workqueue.api_key k
    WHERE k.prefix = p_prefix AND k.key_hash = p_key_hash AND k.revoked_at IS NULL
      AND (k.expires_at IS NULL OR k.expires_at > now())
$$;

-- The key behind a prefix, if it is usable now, for a session the application signed; never its hash.
CREATE OR REPLACE FUNCTION workqueue.api_key_session(p_prefix text)
RETURNS TABLE (id uuid, name text, scopes text[], topics text[], session_generation integer)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT k.id, k.name, k.scopes, k.topics, k.session_generation FROM workqueue.api_key k
    WHERE k.prefix = p_prefix AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())
$$;

-- Ends the dashboard sessions of a key issued at p_session_generation (a sign-out).
CREATE OR REPLACE FUNCTION workqueue.api_key_end_sessions(p_id uuid, p_session_generation integer)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE workqueue.api_key k SET session_generation = k.session_generation + 1
    WHERE k.id = p_id AND k.session_generation = p_session_generation
$$;

-- Marks a key used (at most once a minute); called once the key's hash matched.
CREATE OR REPLACE FUNCTION workqueue.api_key_touch(p_id uuid)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE workqueue.api_key k SET last_used_at = now()
    WHERE k.id = p_id AND k.revoked_at IS NULL
      AND (k.last_used_at IS NULL OR k.last_used_at < now() - interval '1 minute')
$$;

-- Every key, without its hash.
CREATE OR REPLACE FUNCTION workqueue.api_key_list()
RETURNS TABLE (
    id uuid, name text, prefix text, scopes text[], created_at timestamptz, expires_at timestamptz,
    revoked_at timestamptz, last_used_at timestamptz, topics text[]
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT k.id, k.name, k.prefix, k.scopes, k.created_at, k.expires_at, k.revoked_at, k.last_used_at, k.topics
    FROM workqueue.api_key k ORDER BY k.created_at, k.name
$$;

-- Revokes by id, prefix or name; returns how many keys it revoked now.
CREATE OR REPLACE FUNCTION workqueue.api_key_revoke(p_key text)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count integer;
BEGIN
    UPDATE workqueue.api_key k SET revoked_at = now()
    WHERE k.revoked_at IS NULL
      AND (k.id::text = lower(p_key) OR k.prefix = p_key OR k.name = p_key);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Privileges
-- ---------------------------------------------------------------------------------------------

-- PostgreSQL grants EXECUTE on every new function to PUBLIC: taken away (the migration runner
-- repeats it after every run that applied something). The role scripts of roles/ grant what each
-- login needs; run them after `workqueue migrate` (and again after every upgrade).
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA workqueue FROM PUBLIC;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA workqueue FROM PUBLIC;

-- == AWS transport: bindings and the transactional outbox ===================================
-- aws_binding: the ARNs and queue URLs import-bindings stored. aws_outbox: publishes to aws topics
-- made in a caller's transaction, forwarded to SNS by the relay (aws_outbox_take locks due rows with
-- SKIP LOCKED and answers only each key's earliest ones, so one relay forwards a key at a time, in order).
-- The AWS layer reaches both through the SECURITY DEFINER functions below (fastapi_workqueue/aws/
-- outbox_store.py); roles/aws_role.sql grants EXECUTE on them, and aws_binding_replace (an import of
-- bindings, a deployment step) is left to the schema owner.

CREATE TABLE workqueue.aws_binding (
    kind         text NOT NULL CHECK (kind IN ('topic', 'subscription')),
    name         text NOT NULL,
    region       text NOT NULL,
    binding      jsonb NOT NULL,
    imported_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, name)
);

CREATE TABLE workqueue.aws_outbox (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic            text NOT NULL,
    message_id       uuid NOT NULL,
    partition_key    text,
    body             text NOT NULL,
    attributes       jsonb NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    attempts         integer NOT NULL DEFAULT 0,
    last_error       text,
    sent_at          timestamptz
);
-- The unsent rows in order, and each key's earliest unsent row.
CREATE INDEX aws_outbox_unsent ON workqueue.aws_outbox (id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_unsent_key ON workqueue.aws_outbox (topic, partition_key, id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_sent ON workqueue.aws_outbox (sent_at) WHERE sent_at IS NOT NULL;

-- Writes one outbox row per message (the arrays are parallel), in the caller's transaction and in
-- the order given.
CREATE OR REPLACE FUNCTION workqueue.aws_outbox_write(
    p_topic text, p_message_ids uuid[], p_partition_keys text[], p_bodies text[], p_attributes jsonb[],
    p_now timestamptz DEFAULT NULL)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO workqueue.aws_outbox (topic, message_id, partition_key, body, attributes, created_at, next_attempt_at)
    SELECT p_topic, r.message_id, r.partition_key, r.body, r.attributes,
           coalesce(p_now, now()), coalesce(p_now, now())  -- p_now: a test's clock
    FROM unnest(p_message_ids, p_partition_keys, p_bodies, p_attributes)
         WITH ORDINALITY AS r(message_id, partition_key, body, attributes, ord)
    ORDER BY r.ord
$$;
REVOKE ALL ON FUNCTION workqueue.aws_outbox_write(text, uuid[], text[], text[], jsonb[], timestamptz) FROM PUBLIC;

-- The relay's take: locks up to p_limit due unsent rows, oldest first, skipping the rows another
-- relay holds, and answers those with no earlier unsent row of their topic and key outside the
-- set it locked (a key another relay holds, or whose head waits out a deferral, is left alone).
-- The locks last until the caller's transaction ends: the relay sends, marks and commits in it.
CREATE OR REPLACE FUNCTION workqueue.aws_outbox_take(p_limit integer, p_now timestamptz DEFAULT NULL)
RETURNS TABLE (id bigint, topic text, message_id uuid, partition_key text, body text, attributes jsonb,
               attempts integer)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH locked AS (
        SELECT o.id, o.topic, o.partition_key
        FROM workqueue.aws_outbox o
        WHERE o.sent_at IS NULL AND o.next_attempt_at <= coalesce(p_now, now())  -- p_now: a test's clock
        ORDER BY o.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    SELECT o.id, o.topic, o.message_id, o.partition_key, o.body, o.attributes, o.attempts
    FROM locked l
    JOIN workqueue.aws_outbox o ON o.id = l.id
    WHERE l.partition_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM workqueue.aws_outbox e
        WHERE e.topic = l.topic AND e.partition_key = l.partition_key AND e.sent_at IS NULL AND e.id < l.id
          AND e.id NOT IN (SELECT x.id FROM locked x)
    )
    ORDER BY o.id
$$;
REVOKE ALL ON FUNCTION workqueue.aws_outbox_take(integer, timestamptz) FROM PUBLIC;

-- Marks rows the relay sent (SNS accepted them).
CREATE OR REPLACE FUNCTION workqueue.aws_outbox_mark_sent(p_ids bigint[], p_now timestamptz DEFAULT NULL)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE workqueue.aws_outbox o
    SET sent_at = coalesce(p_now, now()), attempts = o.attempts + 1, last_error = NULL  -- p_now: a test's clock
    WHERE o.id = ANY (p_ids)
$$;
REVOKE ALL ON FUNCTION workqueue.aws_outbox_mark_sent(bigint[], timestamptz) FROM PUBLIC;

-- Puts off a row SNS refused or throttled by p_delay_seconds, keeping the error.
CREATE OR REPLACE FUNCTION workqueue.aws_outbox_defer(
    p_id bigint, p_error text, p_delay_seconds double precision, p_now timestamptz DEFAULT NULL)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE workqueue.aws_outbox o
    SET attempts = o.attempts + 1, last_error = p_error,
        next_attempt_at = coalesce(p_now, now()) + make_interval(secs => p_delay_seconds)  -- p_now: a test's clock
    WHERE o.id = p_id
$$;
REVOKE ALL ON FUNCTION workqueue.aws_outbox_defer(bigint, text, double precision, timestamptz) FROM PUBLIC;

-- The stored bindings, by kind and name.
CREATE OR REPLACE FUNCTION workqueue.aws_binding_list()
RETURNS TABLE (kind text, name text, region text, binding jsonb)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT b.kind, b.name, b.region, b.binding FROM workqueue.aws_binding b ORDER BY b.kind, b.name
$$;
REVOKE ALL ON FUNCTION workqueue.aws_binding_list() FROM PUBLIC;

-- Replaces every stored binding with the given ones (the arrays are parallel), in one transaction.
CREATE OR REPLACE FUNCTION workqueue.aws_binding_replace(
    p_region text, p_kinds text[], p_names text[], p_bindings jsonb[], p_now timestamptz DEFAULT NULL)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    DELETE FROM workqueue.aws_binding;
    INSERT INTO workqueue.aws_binding (kind, name, region, binding, imported_at)
    SELECT b.kind, b.name, p_region, b.binding, coalesce(p_now, now())  -- p_now: a test's clock
    FROM unnest(p_kinds, p_names, p_bindings) AS b(kind, name, binding);
$$;
REVOKE ALL ON FUNCTION workqueue.aws_binding_replace(text, text[], text[], jsonb[], timestamptz) FROM PUBLIC;
