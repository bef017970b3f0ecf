-- fastapi-workqueue: PostgreSQL, version 8: release_keys deletes emptied keys in a statement of its own.
--
-- Replaces release_keys of 0007 (same name, parameters and result). In 0007 the DELETE of keys
-- left with nothing was a sibling of the UPDATE in one WITH, and a sibling cannot see the rows the
-- UPDATE changes in the same statement: emptied partition rows stayed behind (harmless for claims,
-- but listed as Idle keys with no head). Now the DELETE runs after the UPDATE.

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
    )
    SELECT DISTINCT u.subscription_id FROM updated u
    WHERE u.holder_id IS NULL AND u.next_id IS NOT NULL AND u.next_visible_at <= now();

    -- Keys left with nothing lose their row. A statement of its own: a DELETE beside the UPDATE
    -- in one WITH would not see the rows that UPDATE just changed.
    DELETE FROM workqueue.partition p
    USING (SELECT DISTINCT d.subscription_id, d.partition_key FROM workqueue.delivery d
           WHERE d.id = ANY (p_ids) AND d.key_mode > 0) k
    WHERE p.subscription_id = k.subscription_id AND p.partition_key = k.partition_key
      AND p.holder_id IS NULL AND p.next_id IS NULL AND p.blocked_id IS NULL;
END
$$;
