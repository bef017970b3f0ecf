-- fastapi-workqueue: PostgreSQL, version 33: which process holds a delivery.
--
-- A process that runs a host records itself in workqueue.process (host name, pid, start, version,
-- the subscriptions it serves, its slots) and renews the row while it runs (process_beat, every
-- reconcile interval; process_stop when its host stops). claim and claim_many take the claiming
-- process (p_holder) and keep it in delivery.held_by, which no index names (a claim stays a HOT
-- update). get_delivery, message_deliveries and list_deliveries answer the holder with its host,
-- pid and start; list_processes lists the processes with their state and what they hold.

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

ALTER TABLE workqueue.delivery ADD COLUMN held_by uuid;

DROP FUNCTION workqueue.claim(text, integer);
DROP FUNCTION workqueue.claim_many(text[], integer);
DROP FUNCTION workqueue.get_delivery(bigint);
DROP FUNCTION workqueue.message_deliveries(uuid);
DROP FUNCTION workqueue.list_deliveries(text, text, integer, bigint);

CREATE OR REPLACE FUNCTION workqueue.claim(p_subscription text, p_limit integer, p_holder uuid DEFAULT NULL)
RETURNS TABLE (
    delivery_id bigint, lease_token uuid, attempt integer, max_attempts integer,
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
    v_sub record;
    v_keyed bigint[];
    v_keys text[];
    v_unkeyed bigint[];
    v_ids bigint[];
    v_got integer;
    v_key text;
BEGIN
    SELECT s.id, s.partition_mode, s.lease_seconds INTO v_sub
    FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic
    WHERE s.name = p_subscription AND s.status = 'Active' AND t.status = 'Active';
    IF NOT FOUND OR p_limit < 1 THEN
        RETURN;
    END IF;

    IF v_sub.partition_mode <> 'None' THEN
        -- Keys a settle or the sweeper could not hand over (their producer held them) are
        -- re-derived first, where nobody holds them now; the table is empty but under contention.
        IF EXISTS (SELECT 1 FROM workqueue.partition_stale ps WHERE ps.subscription_id = v_sub.id) THEN
            PERFORM workqueue.rederive_stale(ARRAY[v_sub.id], p_limit);
        END IF;
        -- Keys that can run now: their partition row is the lock.
        SELECT array_agg(k.next_id), array_agg(k.partition_key) INTO v_keyed, v_keys
        FROM (
            SELECT pt.next_id, pt.partition_key
            FROM workqueue.partition pt
            WHERE pt.subscription_id = v_sub.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
              AND pt.next_visible_at <= now()
            ORDER BY pt.next_visible_at
            LIMIT p_limit
            FOR UPDATE SKIP LOCKED
        ) k;
    END IF;

    -- Deliveries without a key lock (None mode, or no partition key). On a keyed subscription
    -- they share the claim with the keys: neither side can take every slot.
    SELECT array_agg(u.id) INTO v_unkeyed
    FROM (
        SELECT d.id
        FROM workqueue.delivery d
        WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0
          AND d.visible_at <= now()
        ORDER BY d.visible_at, d.id
        LIMIT CASE WHEN v_keyed IS NULL THEN p_limit
                   ELSE greatest(p_limit - cardinality(v_keyed), p_limit / 2) END
        FOR UPDATE SKIP LOCKED
    ) u;
    IF v_keyed IS NOT NULL AND v_unkeyed IS NOT NULL AND cardinality(v_keyed) + cardinality(v_unkeyed) > p_limit THEN
        v_keyed := v_keyed[1:p_limit - cardinality(v_unkeyed)];
        v_keys := v_keys[1:p_limit - cardinality(v_unkeyed)];
    END IF;
    v_ids := coalesce(v_keyed, '{}'::bigint[]) || coalesce(v_unkeyed, '{}'::bigint[]);
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
    IF v_sub.partition_mode = 'None' THEN
        -- This transaction commits without waiting for its WAL to reach disk (see 0017): a claim
        -- lost in a crash of the server leaves its deliveries Pending.
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    RETURN QUERY
    WITH d AS (
        UPDATE workqueue.delivery d
        SET status = 'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
            lease_token = gen_random_uuid(),
            lease_expires_at = now() + make_interval(secs => v_sub.lease_seconds),
            claimed_at = now(), held_by = p_holder, progress_percent = NULL, progress_message = NULL
        WHERE d.id = ANY (v_ids) AND d.status = 'Pending'
        RETURNING d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, d.message_id,
                  d.partition_key, d.key_mode
    ), held AS (
        UPDATE workqueue.partition pt
        SET holder_id = d.id, next_id = NULL, next_visible_at = NULL
        FROM d
        WHERE pt.subscription_id = v_sub.id AND pt.partition_key = ANY (v_keys)
          AND d.key_mode > 0 AND pt.partition_key = d.partition_key
    )
    SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, m.id, m.topic,
           m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id, m.published_at
    FROM d JOIN workqueue.message m ON m.id = d.message_id
    ORDER BY d.id;
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
END
$$;

CREATE OR REPLACE FUNCTION workqueue.claim_many(p_subscriptions text[], p_limit integer, p_holder uuid DEFAULT NULL)
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
BEGIN
    IF p_limit < 1 OR coalesce(cardinality(p_subscriptions), 0) = 0 THEN
        RETURN;
    END IF;
    SELECT bool_or(s.partition_mode <> 'None'),
           array_agg(s.id) FILTER (WHERE s.status = 'Active' AND t.status = 'Active')
    INTO v_has_keyed, v_active
    FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic
    WHERE s.name = ANY (p_subscriptions);
    IF v_has_keyed THEN
        SELECT format('%s is %s', s.name, s.partition_mode) INTO v_keyed
        FROM workqueue.subscription s
        WHERE s.name = ANY (p_subscriptions) AND s.partition_mode <> 'None'
        ORDER BY s.name
        LIMIT 1;
        RAISE EXCEPTION 'claim_many takes None-mode subscriptions only (%); claim an Exclusive or Ordered subscription with claim',
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
          AND d.visible_at <= now()
    );
    IF v_due IS NULL THEN
        RETURN;
    END IF;

    IF cardinality(v_due) = 1 THEN
        -- One of them has work (a worker's usual case): its oldest due deliveries, locked as the
        -- index gives them, past the rows other claimers hold, as claim does.
        SELECT array_agg(l.id) INTO v_ids
        FROM (
            SELECT d.id FROM workqueue.delivery d
            WHERE d.subscription_id = v_due[1] AND d.status = 'Pending' AND d.key_mode = 0
              AND d.visible_at <= now()
            ORDER BY d.visible_at, d.id
            LIMIT p_limit
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
                  AND d.visible_at <= now()
                ORDER BY d.visible_at, d.id
                LIMIT p_limit
            ) d
            ORDER BY d.visible_at, d.id
            LIMIT p_limit
        ) c;
        IF v_candidates IS NULL THEN
            RETURN;
        END IF;

        -- Locked by id; what another claimer holds is skipped (and rechecked once locked).
        SELECT array_agg(l.id) INTO v_ids
        FROM (
            SELECT d.id FROM workqueue.delivery d
            WHERE d.id = ANY (v_candidates) AND d.status = 'Pending' AND d.key_mode = 0
              AND d.visible_at <= now()
            FOR UPDATE SKIP LOCKED
        ) l;
        v_ids := coalesce(v_ids, '{}'::bigint[]);

        IF cardinality(v_ids) < cardinality(v_candidates) THEN
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
                  AND d.visible_at <= now() AND d.id <> ALL (v_ids)
                ORDER BY d.visible_at, d.id
                LIMIT k.n
                FOR UPDATE SKIP LOCKED
            ) l;
            v_ids := v_ids || coalesce(v_more, '{}'::bigint[]);
        END IF;
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
            lease_expires_at = now() + make_interval(secs => s.lease_seconds),
            claimed_at = now(), held_by = p_holder, progress_percent = NULL, progress_message = NULL
        FROM workqueue.subscription s
        WHERE d.id = ANY (v_ids) AND d.status = 'Pending' AND s.id = d.subscription_id
        RETURNING s.name, d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at,
                  d.message_id, d.visible_at
    )
    SELECT d.name, d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, m.id, m.topic,
           m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id, m.published_at
    FROM d JOIN workqueue.message m ON m.id = d.message_id
    ORDER BY d.visible_at, d.id;
END
$$;

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

REVOKE ALL ON FUNCTION workqueue.claim(text, integer, uuid), workqueue.claim_many(text[], integer, uuid),
    workqueue.get_delivery(bigint), workqueue.message_deliveries(uuid),
    workqueue.list_deliveries(text, text, integer, bigint),
    workqueue.process_beat(uuid, text, integer, timestamptz, text, jsonb, integer, integer, double precision),
    workqueue.process_stop(uuid), workqueue.list_processes() FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.claim(text, integer, uuid), workqueue.claim_many(text[], integer, uuid),
            workqueue.get_delivery(bigint), workqueue.message_deliveries(uuid),
            workqueue.list_deliveries(text, text, integer, bigint),
            workqueue.process_beat(uuid, text, integer, timestamptz, text, jsonb, integer, integer, double precision),
            workqueue.process_stop(uuid), workqueue.list_processes() TO workqueue_runtime;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_operator') THEN
        GRANT EXECUTE ON FUNCTION workqueue.get_delivery(bigint), workqueue.message_deliveries(uuid),
            workqueue.list_deliveries(text, text, integer, bigint), workqueue.list_processes() TO workqueue_operator;
    END IF;
END
$$;
