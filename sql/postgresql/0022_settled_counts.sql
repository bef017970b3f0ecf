-- fastapi-workqueue: PostgreSQL, version 22: stats read no history.
--
-- stats (0002) counted every delivery of a subscription by state, Completed and Discarded ones
-- included: with a week of retention that is every delivery settled that week, so one stats call
-- on a busy queue read a million rows. Now the terminal counts come from settled_count, which
-- holds deltas: each settle batch appends one row per subscription with the Completed and
-- Discarded deliveries it made, lease expiry and discard append theirs, purge and prune append
-- negative ones for what they delete, and the sweeper (and prune) folds the rows into one per
-- subscription. Nothing updates a row that another transaction appends beside, so settles of
-- one subscription in several processes never wait for each other here. The other counts read
-- their states through partial indexes (Pending through the three the claims use, InFlight through
-- delivery_in_flight of 0021, DeadLettered through delivery_dead_letters): the live work, never
-- the history.
--
-- Replaces settle (0020), expire_leases (0007), discard (0002), purge (0019), prune (0006), sweep
-- (0019) and stats (0002), same names, parameters and results, and adds fold_settled_counts.
--
-- The counts start from the deliveries that exist when this migration runs; delivery is locked
-- against writes meanwhile (SHARE). A settle already running under the old definition when the
-- migration commits is not counted: migrate while no worker settles if the terminal counts must be
-- exact from the first minute.

-- Deltas of each subscription's Completed and Discarded deliveries; their sums are the counts. No
-- key and no index: rows are only appended, summed all at once by stats, and folded by the
-- sweeper, so between two passes the table holds about one row per settle batch.
CREATE TABLE workqueue.settled_count (
    subscription_id  integer NOT NULL,
    completed        bigint NOT NULL,
    discarded        bigint NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);

LOCK TABLE workqueue.delivery IN SHARE MODE;
INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
SELECT d.subscription_id, count(*) FILTER (WHERE d.status = 'Completed'), count(*) FILTER (WHERE d.status = 'Discarded')
FROM workqueue.delivery d
WHERE d.status IN ('Completed', 'Discarded')
GROUP BY d.subscription_id;

-- Replaces the rows of each subscription that has more than one by their sum (dropping sums of
-- zero). The rows another transaction is appending are not seen and stay for the next fold; two
-- folds at once delete disjoint rows.
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
    SELECT s.name, s.topic, s.status, s.partition_mode,
           p.pending, coalesce(cl.claimable, 0), f.in_flight, dl.dead_lettered,
           coalesce(t.completed, 0)::bigint, coalesce(t.discarded, 0)::bigint, p.oldest_pending_at
    FROM workqueue.subscription s
    LEFT JOIN (
        SELECT c.subscription_id, sum(c.completed) AS completed, sum(c.discarded) AS discarded
        FROM workqueue.settled_count c
        GROUP BY c.subscription_id
    ) t ON t.subscription_id = s.id
    CROSS JOIN LATERAL (
        SELECT count(*) AS pending, min(w.created_at) AS oldest_pending_at
        FROM (
            SELECT d.created_at FROM workqueue.delivery d
            WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
            UNION ALL
            SELECT d.created_at FROM workqueue.delivery d
            WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 1
            UNION ALL
            SELECT d.created_at FROM workqueue.delivery d
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
    LEFT JOIN LATERAL (
        SELECT (SELECT count(*) FROM workqueue.delivery d
                WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
                  AND d.visible_at <= now())
             + (SELECT count(*) FROM workqueue.partition p
                WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                  AND p.next_visible_at <= now()) AS claimable
    ) cl ON true
    WHERE p_subscription IS NULL OR s.name = p_subscription
    ORDER BY s.name
$$;

CREATE OR REPLACE FUNCTION workqueue.settle(
    p_ids bigint[], p_tokens uuid[], p_outcomes text[], p_delays double precision[],
    p_reasons text[], p_errors text[], p_draws double precision[] DEFAULT NULL
) RETURNS TABLE (delivery_id bigint, result text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    v_results jsonb;  -- delivery id -> its new status
    v_keyed boolean;
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
                WHEN pl.outcome = 'Release' THEN now() + make_interval(secs => coalesce(pl.delay, 0))
                ELSE now() + make_interval(secs => coalesce(pl.delay,
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
            settled_at = CASE WHEN pl.new_status IN ('Completed', 'Discarded', 'DeadLettered') THEN now() END
        FROM plan pl
        WHERE d.id = pl.id
        RETURNING d.id, d.status, d.key_mode, d.subscription_id
    ), counted AS (
        -- The batch's terminal settles, one row per subscription (settled_count).
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, count(*) FILTER (WHERE u.status = 'Completed'),
               count(*) FILTER (WHERE u.status = 'Discarded')
        FROM u
        WHERE u.status IN ('Completed', 'Discarded')
        GROUP BY u.subscription_id
    )
    SELECT array_agg(u.id), jsonb_object_agg(u.id::text, u.status), bool_or(u.key_mode > 0)
    INTO v_ids, v_results, v_keyed
    FROM u;

    IF v_keyed THEN
        PERFORM pg_notify('workqueue', r.subscription_id::text) FROM workqueue.release_keys(v_ids) r;
    END IF;

    RETURN QUERY
    SELECT i.id, coalesce(v_results ->> i.id::text, 'LeaseLost')
    FROM unnest(p_ids) AS i(id);
END
$$;

CREATE OR REPLACE FUNCTION workqueue.expire_leases(p_limit integer)
RETURNS TABLE (delivery_id bigint, result text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_expired bigint[];
    v_ids bigint[];
    v_results text[];
    v_keyed boolean;
BEGIN
    SELECT array_agg(e.id) INTO v_expired
    FROM (
        SELECT d.id FROM workqueue.delivery d
        WHERE d.status = 'InFlight' AND d.lease_expires_at < now()
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
                              ELSE now() + make_interval(secs => workqueue.backoff_seconds(
                                    d.attempt, d.backoff_base_seconds, d.backoff_max_seconds, d.backoff_schedule)) END,
            reason = CASE WHEN d.cancel_requested THEN d.reason
                          WHEN d.attempt >= d.max_attempts THEN 'lease expired on the final attempt'
                          ELSE 'lease expired' END,
            last_error = CASE WHEN d.cancel_requested THEN d.last_error
                              ELSE 'lease expired: the holder stopped renewing it' END,
            lease_token = NULL,
            lease_expires_at = NULL,
            settled_at = CASE WHEN d.cancel_requested OR d.attempt >= d.max_attempts THEN now() END
        WHERE d.id = ANY (v_expired)
        RETURNING d.id, d.status, d.key_mode, d.subscription_id
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

    IF v_keyed THEN
        PERFORM pg_notify('workqueue', r.subscription_id::text) FROM workqueue.release_keys(v_ids) r;
    END IF;

    RETURN QUERY SELECT x.id, x.result FROM unnest(v_ids, v_results) AS x(id, result);
END
$$;

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
        UPDATE workqueue.delivery d SET cancel_requested = true, reason = p_reason
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

CREATE OR REPLACE FUNCTION workqueue.purge(p_limit integer)
RETURNS TABLE (purged_deliveries integer, purged_messages integer, purged_deduplication integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_deliveries integer := 0;
    v_messages integer;
    v_dedup integer;
    v_settled_before timestamptz;
    v_published_before timestamptz;
BEGIN
    -- A settled delivery may go once its subscription's retention has passed: none settled after
    -- now() minus the shortest retention of any subscription can.
    SELECT now() - make_interval(secs => min(s.retention_seconds)) INTO v_settled_before
    FROM workqueue.subscription s;
    IF v_settled_before IS NOT NULL THEN
        WITH gone AS (
            DELETE FROM workqueue.delivery d
            WHERE d.id IN (
                SELECT x.id FROM workqueue.delivery x
                JOIN workqueue.subscription s ON s.id = x.subscription_id
                WHERE x.status IN ('Completed', 'Discarded')
                  AND x.settled_at < v_settled_before
                  AND x.settled_at < now() - make_interval(secs => s.retention_seconds)
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
    -- after now() minus the shortest of those can.
    SELECT now() - make_interval(secs => least(604800::double precision, min(r.seconds)))
    INTO v_published_before
    FROM (SELECT max(s.retention_seconds) AS seconds FROM workqueue.subscription s GROUP BY s.topic) r;
    DELETE FROM workqueue.message m
    WHERE m.id IN (
        SELECT x.id FROM workqueue.message x
        WHERE x.published_at < v_published_before
          AND x.published_at < now() - make_interval(secs => coalesce(
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
        WHERE x.expires_at <= now()
        ORDER BY x.expires_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED  -- a producer taking the expired key over holds it until it commits
    );
    GET DIAGNOSTICS v_dedup = ROW_COUNT;

    RETURN QUERY SELECT v_deliveries, v_messages, v_dedup;
END
$$;

CREATE OR REPLACE FUNCTION workqueue.prune(p_older_than_seconds double precision, p_limit integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count integer;
BEGIN
    WITH gone AS (
        DELETE FROM workqueue.delivery d
        WHERE d.id IN (
            SELECT x.id FROM workqueue.delivery x
            WHERE x.status IN ('Completed', 'Discarded')
              AND x.settled_at < now() - make_interval(secs => p_older_than_seconds)
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

CREATE OR REPLACE FUNCTION workqueue.sweep(p_limit integer DEFAULT 1000)
RETURNS TABLE (
    ran boolean, retried integer, dead_lettered integer, discarded integer,
    purged_deliveries integer, purged_messages integer, purged_deduplication integer
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_retried integer;
    v_dead integer;
    v_discarded integer;
    v_purge record;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('workqueue.sweep')::bigint) THEN
        RETURN QUERY SELECT false, 0, 0, 0, 0, 0, 0;
        RETURN;
    END IF;
    SELECT count(*) FILTER (WHERE e.result = 'Pending'),
           count(*) FILTER (WHERE e.result = 'DeadLettered'),
           count(*) FILTER (WHERE e.result = 'Discarded')
    INTO v_retried, v_dead, v_discarded
    FROM workqueue.expire_leases(p_limit) e;
    PERFORM pg_notify('workqueue', r.sid::text)
    FROM (SELECT DISTINCT r.subscription_id AS sid FROM workqueue.rederive_stale(NULL, p_limit) r) r;
    SELECT * INTO v_purge FROM workqueue.purge(p_limit);
    PERFORM workqueue.fold_settled_counts();
    DELETE FROM workqueue.once_marker o
    WHERE o.key IN (SELECT x.key FROM workqueue.once_marker x WHERE x.expires_at <= now()
                    ORDER BY x.expires_at LIMIT p_limit FOR UPDATE SKIP LOCKED);
    RETURN QUERY SELECT true, v_retried, v_dead, v_discarded, v_purge.purged_deliveries,
                        v_purge.purged_messages, v_purge.purged_deduplication;
END
$$;
