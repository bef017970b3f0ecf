-- fastapi-workqueue: PostgreSQL, version 28: a minute-by-minute history of each subscription's
-- counts, which the dashboard charts (throughput and depth over the last hour).
--
-- The sweeper writes it: after a pass that ran, the transport calls record_stats_history, which
-- writes at most once a minute across all processes (a transaction lock, then a look at the last
-- row) one row per subscription: the Pending, InFlight and DeadLettered counts as stats reads them
-- (through the partial indexes, at the same cost with any amount of history), and the deliveries
-- Completed since the previous row. Those are counted from delivery_settled over the settle times
-- of that window, which ends 30 seconds before the pass (a settle's time is its transaction's
-- start, and a settle still running then has not committed); so the count costs what the window's
-- settles cost, whatever the table holds. stats' own Completed count cannot serve: retention purges
-- take it down, by as much as a day's completions a day on a queue in its steady state. A window
-- starts where the previous one ended, or a minute before its end when the previous row is more
-- than an hour old (or there is none), so a scan never reaches further back than an hour. Rows older
-- than p_keep_seconds (a day) are deleted in the same call. A subscription whose retention is
-- shorter than a minute and a half may be purged of completions before they are counted.
--
-- The dashboard's pages read the live work through two more functions, bounded whatever the tables
-- hold: live_counts (Pending, InFlight and DeadLettered, each counted up to p_cap through the index
-- of its state; stats counts every live row, which a backlog of a million makes a million index
-- entries per call, and a page polls) and blocked_keys (the heads that block an Ordered key, found
-- through delivery_dead_letters and partition_ready up to p_limit, each with the items waiting
-- behind it counted up to p_cap; partitions reads every partition row of the subscription).
--
-- list_deliveries (0023) named the state with a parameter, which no partial index can serve in a
-- plan made for any state: a page of dead letters was a scan of the whole table (a parallel one, with
-- a million deliveries). It now names DeadLettered and InFlight literally, so their pages read
-- delivery_dead_letters from the cursor in id order and delivery_in_flight; the other states keep
-- the statement they had. Same parameters and result columns, and the grants stay.
--
-- Adds the table and four functions: record_stats_history (the sweeper's, so the runtime and
-- operator roles get EXECUTE, as on sweep), and stats_history, live_counts and blocked_keys (read-only
-- views, like stats).

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
-- The last row, the last hour of every subscription, and the rows past keeping.
CREATE INDEX stats_history_recorded_at ON workqueue.stats_history (recorded_at);

-- Writes this minute's row of every subscription unless a row of this minute exists (or another
-- transaction is writing them); returns how many it wrote. p_now stands in for the clock (tests).
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

-- The rows recorded since p_since (at most a day ago: no more is kept), of one subscription or
-- of all, oldest first.
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

-- Each subscription's live counts, each stopping at p_cap (a page shows "p_cap or more").
CREATE OR REPLACE FUNCTION workqueue.live_counts(p_subscription text DEFAULT NULL, p_cap integer DEFAULT 1000)
RETURNS TABLE (subscription text, pending bigint, in_flight bigint, dead_lettered bigint)
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
                                    AND d.status = 'DeadLettered' ORDER BY d.id LIMIT p_cap) x)
    FROM workqueue.subscription s
    WHERE p_subscription IS NULL OR s.name = p_subscription
    ORDER BY s.name
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

-- Deliveries of one subscription in one state, oldest first, paged by id: dead letters and running
-- ones through their partial indexes.
CREATE OR REPLACE FUNCTION workqueue.list_deliveries(
    p_subscription text, p_status text, p_limit integer, p_after_id bigint DEFAULT 0
) RETURNS TABLE (
    delivery_id bigint, message_id uuid, topic text, partition_key text, status text, attempt integer,
    max_attempts integer, visible_at timestamptz, lease_expires_at timestamptz, cancel_requested boolean,
    progress_percent smallint, progress_message text, reason text, last_error text, note text,
    created_at timestamptz, claimed_at timestamptz, settled_at timestamptz, attributes jsonb, payload text,
    correlation_id text
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
               m.correlation_id
        FROM workqueue.delivery d
        JOIN workqueue.message m ON m.id = d.message_id
        WHERE d.subscription_id = v_subscription AND d.status = 'DeadLettered' AND d.id > coalesce(p_after_id, 0)
        ORDER BY d.id
        LIMIT p_limit;
    ELSIF p_status = 'InFlight' THEN
        RETURN QUERY
        SELECT d.id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts, d.visible_at,
               d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message, d.reason,
               d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload,
               m.correlation_id
        FROM workqueue.delivery d
        JOIN workqueue.message m ON m.id = d.message_id
        WHERE d.subscription_id = v_subscription AND d.status = 'InFlight' AND d.id > coalesce(p_after_id, 0)
        ORDER BY d.id
        LIMIT p_limit;
    ELSE
        RETURN QUERY
        SELECT d.id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts, d.visible_at,
               d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message, d.reason,
               d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload,
               m.correlation_id
        FROM workqueue.delivery d
        JOIN workqueue.message m ON m.id = d.message_id
        WHERE d.subscription_id = v_subscription AND d.status = p_status AND d.id > coalesce(p_after_id, 0)
        ORDER BY d.id
        LIMIT p_limit;
    END IF;
END
$$;

REVOKE ALL ON FUNCTION workqueue.record_stats_history(double precision, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION workqueue.stats_history(timestamptz, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION workqueue.live_counts(text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION workqueue.blocked_keys(text, integer, integer) FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.record_stats_history(double precision, timestamptz) TO workqueue_runtime;
        GRANT EXECUTE ON FUNCTION workqueue.stats_history(timestamptz, text) TO workqueue_runtime;
        GRANT EXECUTE ON FUNCTION workqueue.live_counts(text, integer) TO workqueue_runtime;
        GRANT EXECUTE ON FUNCTION workqueue.blocked_keys(text, integer, integer) TO workqueue_runtime;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_operator') THEN
        GRANT EXECUTE ON FUNCTION workqueue.record_stats_history(double precision, timestamptz) TO workqueue_operator;
        GRANT EXECUTE ON FUNCTION workqueue.stats_history(timestamptz, text) TO workqueue_operator;
        GRANT EXECUTE ON FUNCTION workqueue.live_counts(text, integer) TO workqueue_operator;
        GRANT EXECUTE ON FUNCTION workqueue.blocked_keys(text, integer, integer) TO workqueue_operator;
    END IF;
END
$$;
