-- fastapi-workqueue: PostgreSQL, version 23: listings answer with every field of a delivery.
--
-- list_deliveries (0002) left out the topic, the visibility and lease times, the claim time, the
-- cancel flag and the progress, which get_delivery returns: an operator paging through InFlight
-- deliveries could not see when their leases ran out, nor through Pending ones when they become
-- visible. It now returns get_delivery's columns (less the subscription, which the caller names),
-- in the same order. Its result columns change, so it is dropped and created again, and the
-- runtime role, where it exists, gets EXECUTE on it again.

DROP FUNCTION workqueue.list_deliveries(text, text, integer, bigint);

-- Deliveries of one subscription in one state, oldest first, paged by id.
CREATE OR REPLACE FUNCTION workqueue.list_deliveries(
    p_subscription text, p_status text, p_limit integer, p_after_id bigint DEFAULT 0
) RETURNS TABLE (
    delivery_id bigint, message_id uuid, topic text, partition_key text, status text, attempt integer,
    max_attempts integer, visible_at timestamptz, lease_expires_at timestamptz, cancel_requested boolean,
    progress_percent smallint, progress_message text, reason text, last_error text, note text,
    created_at timestamptz, claimed_at timestamptz, settled_at timestamptz, attributes jsonb, payload text,
    correlation_id text
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts, d.visible_at,
           d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message, d.reason,
           d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload,
           m.correlation_id
    FROM workqueue.delivery d
    JOIN workqueue.subscription s ON s.id = d.subscription_id
    JOIN workqueue.message m ON m.id = d.message_id
    WHERE s.name = p_subscription AND d.status = p_status AND d.id > coalesce(p_after_id, 0)
    ORDER BY d.id
    LIMIT p_limit
$$;

REVOKE ALL ON FUNCTION workqueue.list_deliveries(text, text, integer, bigint) FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.list_deliveries(text, text, integer, bigint) TO workqueue_runtime;
    END IF;
END
$$;
