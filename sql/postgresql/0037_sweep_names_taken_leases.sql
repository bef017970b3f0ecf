-- fastapi-workqueue: PostgreSQL, version 37: a sweeper pass says which leases it took back.
--
-- sweep answered only counts; it now also answers taken_back, one object per lease it expired:
-- the delivery, its subscription, what became of it (Pending, DeadLettered or Discarded), the
-- attempt, and the process that held it (delivery.held_by, 0033, with its host and pid). The host
-- logs each at INFO, so an operator reading the log learns whose work was taken back.

DROP FUNCTION workqueue.sweep(integer);

CREATE OR REPLACE FUNCTION workqueue.sweep(p_limit integer DEFAULT 1000)
RETURNS TABLE (
    ran boolean, retried integer, dead_lettered integer, discarded integer,
    purged_deliveries integer, purged_messages integer, purged_deduplication integer, taken_back jsonb
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
    v_taken_back jsonb;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('workqueue.sweep')::bigint) THEN
        RETURN QUERY SELECT false, 0, 0, 0, 0, 0, 0, '[]'::jsonb;
        RETURN;
    END IF;
    -- Each lease taken back, with its subscription and the process that held it (for the log).
    WITH e AS (SELECT * FROM workqueue.expire_leases(p_limit))
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
    SELECT * INTO v_purge FROM workqueue.purge(p_limit);
    PERFORM workqueue.fold_settled_counts();
    DELETE FROM workqueue.once_marker o
    WHERE o.key IN (SELECT x.key FROM workqueue.once_marker x WHERE x.expires_at <= now()
                    ORDER BY x.expires_at LIMIT p_limit FOR UPDATE SKIP LOCKED);
    RETURN QUERY SELECT true, v_retried, v_dead, v_discarded, v_purge.purged_deliveries,
                        v_purge.purged_messages, v_purge.purged_deduplication, v_taken_back;
END
$$;

REVOKE ALL ON FUNCTION workqueue.sweep(integer) FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.sweep(integer) TO workqueue_runtime;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_operator') THEN
        GRANT EXECUTE ON FUNCTION workqueue.sweep(integer) TO workqueue_operator;
    END IF;
END
$$;
