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
-- Adds the table and two functions: record_stats_history (the sweeper's, so the runtime and
-- operator roles get EXECUTE, as on sweep) and stats_history (what the dashboard reads, a read-only
-- view like stats).

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

REVOKE ALL ON FUNCTION workqueue.record_stats_history(double precision, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION workqueue.stats_history(timestamptz, text) FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.record_stats_history(double precision, timestamptz) TO workqueue_runtime;
        GRANT EXECUTE ON FUNCTION workqueue.stats_history(timestamptz, text) TO workqueue_runtime;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_operator') THEN
        GRANT EXECUTE ON FUNCTION workqueue.record_stats_history(double precision, timestamptz) TO workqueue_operator;
        GRANT EXECUTE ON FUNCTION workqueue.stats_history(timestamptz, text) TO workqueue_operator;
    END IF;
END
$$;
