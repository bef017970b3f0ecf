-- fastapi-workqueue: PostgreSQL, version 15: heartbeat costs the same per item at any batch size.
--
-- Replaces heartbeat of 0004 (same name, parameters and results). 0004 joined the items with the
-- deliveries and then the answers with the items, joins the planner may run as nested loops that
-- compare every item with every other (what 0014 mended in settle); a worker heartbeats all its
-- InFlight deliveries, often a thousand, in one call. As in 0014: each item finds and locks its
-- row through the primary key, in id order, the update joins by id alone, and the answers are
-- looked up by id in a jsonb object.

CREATE OR REPLACE FUNCTION workqueue.heartbeat(
    p_ids bigint[], p_tokens uuid[], p_percents smallint[], p_messages text[]
) RETURNS TABLE (delivery_id bigint, alive boolean, cancel_requested boolean, lease_expires_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_found jsonb;  -- delivery id -> [cancel_requested, lease_expires_at]
BEGIN
    WITH locked AS (
        SELECT d.id, d.subscription_id, i.pct, i.msg
        FROM (SELECT * FROM unnest(p_ids, p_tokens, p_percents, p_messages) AS t(id, token, pct, msg)
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
        SET lease_expires_at = CASE WHEN d.cancel_requested THEN d.lease_expires_at
                                    ELSE now() + make_interval(secs => s.lease_seconds) END,
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
