-- fastapi-workqueue: PostgreSQL, version 7: keys freed in one statement per settle batch.
--
-- settle and expire_leases (of 0004) re-derived each key they touched with refresh_partition, four
-- statements per key. release_keys does the same for every key of a batch at once: the deliveries
-- just settled (or expired) give up their hold, and each key gets its next delivery (Exclusive: the
-- earliest visible Pending one; Ordered: the head, or the dead-lettered head that blocks it) in one
-- UPDATE (after locking them), keys left with nothing are deleted. Same results as
-- refresh_partition; refresh_partition stays for the operator actions and the claim's repair.

CREATE OR REPLACE FUNCTION workqueue.release_keys(p_ids bigint[])
RETURNS TABLE (subscription_id integer)   -- subscriptions with a key that can be claimed now
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    -- Lock the keys first, in key order; the next statement then reads their deliveries with a
    -- snapshot taken after every publish that touched them committed (as refresh_partition does).
    PERFORM 1
    FROM workqueue.partition p
    JOIN (SELECT DISTINCT d.subscription_id, d.partition_key FROM workqueue.delivery d
          WHERE d.id = ANY (p_ids) AND d.key_mode > 0) k
      ON p.subscription_id = k.subscription_id AND p.partition_key = k.partition_key
    ORDER BY p.subscription_id, p.partition_key
    FOR UPDATE OF p;

    RETURN QUERY
    WITH k AS (
        SELECT DISTINCT d.subscription_id, d.partition_key, d.key_mode
        FROM workqueue.delivery d
        WHERE d.id = ANY (p_ids) AND d.key_mode > 0
    ), state AS (
        SELECT k.subscription_id, k.partition_key, k.key_mode,
               o.id AS head_id, o.status AS head_status, o.visible_at AS head_visible_at,
               e.id AS next_pending_id, e.visible_at AS next_pending_visible_at
        FROM k
        LEFT JOIN LATERAL (
            SELECT d.id, d.status, d.visible_at FROM workqueue.delivery d
            WHERE k.key_mode = 2 AND d.subscription_id = k.subscription_id AND d.partition_key = k.partition_key
              AND d.key_mode = 2 AND d.status IN ('Pending', 'InFlight', 'DeadLettered')
            ORDER BY d.id
            LIMIT 1
        ) o ON true
        LEFT JOIN LATERAL (
            SELECT d.id, d.visible_at FROM workqueue.delivery d
            WHERE k.key_mode = 1 AND d.subscription_id = k.subscription_id AND d.partition_key = k.partition_key
              AND d.key_mode = 1 AND d.status = 'Pending'
            ORDER BY d.visible_at, d.id
            LIMIT 1
        ) e ON true
    ), updated AS (
        UPDATE workqueue.partition p
        SET holder_id = n.holder_id, next_id = n.next_id, next_visible_at = n.next_visible_at,
            blocked_id = n.blocked_id
        FROM (
            SELECT s.subscription_id, s.partition_key, x.holder_id,
                   CASE WHEN x.holder_id IS NOT NULL THEN NULL
                        WHEN s.key_mode = 1 THEN s.next_pending_id
                        WHEN s.head_status = 'Pending' THEN s.head_id END AS next_id,
                   CASE WHEN x.holder_id IS NOT NULL THEN NULL
                        WHEN s.key_mode = 1 THEN s.next_pending_visible_at
                        WHEN s.head_status = 'Pending' THEN s.head_visible_at END AS next_visible_at,
                   CASE WHEN s.key_mode = 2 AND s.head_status = 'DeadLettered' THEN s.head_id END AS blocked_id
            FROM state s
            JOIN workqueue.partition cur
              ON cur.subscription_id = s.subscription_id AND cur.partition_key = s.partition_key
            CROSS JOIN LATERAL (
                SELECT CASE WHEN s.key_mode = 2 AND s.head_status = 'InFlight' THEN s.head_id
                            WHEN cur.holder_id = ANY (p_ids) THEN NULL
                            ELSE cur.holder_id END AS holder_id
            ) x
        ) n
        WHERE p.subscription_id = n.subscription_id AND p.partition_key = n.partition_key
        RETURNING p.subscription_id, p.partition_key, p.holder_id, p.next_id, p.next_visible_at, p.blocked_id
    ), emptied AS (
        DELETE FROM workqueue.partition p
        USING updated u
        WHERE p.subscription_id = u.subscription_id AND p.partition_key = u.partition_key
          AND u.holder_id IS NULL AND u.next_id IS NULL AND u.blocked_id IS NULL
    )
    SELECT DISTINCT u.subscription_id FROM updated u
    WHERE u.holder_id IS NULL AND u.next_id IS NOT NULL AND u.next_visible_at <= now();
END
$$;

CREATE OR REPLACE FUNCTION workqueue.settle(
    p_ids bigint[], p_tokens uuid[], p_outcomes text[], p_delays double precision[],
    p_reasons text[], p_errors text[]
) RETURNS TABLE (delivery_id bigint, result text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    v_results text[];
    v_keyed boolean;
BEGIN
    WITH i AS (
        SELECT * FROM unnest(p_ids, p_tokens, p_outcomes, p_delays, p_reasons, p_errors)
                 AS t(id, token, outcome, delay, reason, error)
    ), locked AS (
        SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds,
               d.backoff_max_seconds, d.backoff_schedule
        FROM workqueue.delivery d
        WHERE d.id = ANY (p_ids) AND d.status = 'InFlight' AND d.lease_token = ANY (p_tokens)
        ORDER BY d.id
        FOR UPDATE
    ), plan AS (
        SELECT l.*, i.outcome, i.delay, i.reason, i.error,
            CASE WHEN l.cancel_requested THEN 'Discarded'
                 WHEN i.outcome = 'Complete' THEN 'Completed'
                 WHEN i.outcome = 'Release' THEN 'Pending'
                 WHEN i.outcome = 'DeadLetter' THEN 'DeadLettered'
                 WHEN l.attempt >= l.max_attempts THEN 'DeadLettered'
                 ELSE 'Pending' END AS new_status
        FROM locked l JOIN i ON i.id = l.id AND i.token = l.lease_token
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
                                                  pl.backoff_max_seconds, pl.backoff_schedule))) END,
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
        WHERE d.id = ANY (p_ids) AND d.id = pl.id
        RETURNING d.id, d.status, d.key_mode
    )
    SELECT array_agg(u.id), array_agg(u.status), bool_or(u.key_mode > 0)
    INTO v_ids, v_results, v_keyed
    FROM u;

    IF v_keyed THEN
        PERFORM pg_notify('workqueue', r.subscription_id::text) FROM workqueue.release_keys(v_ids) r;
    END IF;

    RETURN QUERY
    SELECT i.id, coalesce(x.result, 'LeaseLost')
    FROM unnest(p_ids) AS i(id)
    LEFT JOIN unnest(v_ids, v_results) AS x(id, result) ON x.id = i.id;
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
        RETURNING d.id, d.status, d.key_mode
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

REVOKE ALL ON FUNCTION workqueue.release_keys(bigint[]) FROM PUBLIC;
