-- fastapi-workqueue: PostgreSQL, version 13: purge reads only rows that may be past retention.
--
-- Replaces purge of 0002 (same name, parameter and results, the same rows deleted). Its two scans
-- started from the oldest settled delivery and the oldest message and tested each row against
-- its subscription's (or topic's) retention, a test no index could answer: while nothing was old
-- enough, every sweeper pass read every settled delivery and every message still within
-- retention (a week by default), so a pass over a large backlog or history cost seconds. Each
-- scan now also carries a bound an index range can answer, the shortest retention that applies
-- to any row, and stops there; the per-row test stays as it was.

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
        DELETE FROM workqueue.delivery d
        WHERE d.id IN (
            SELECT x.id FROM workqueue.delivery x
            JOIN workqueue.subscription s ON s.id = x.subscription_id
            WHERE x.status IN ('Completed', 'Discarded')
              AND x.settled_at < v_settled_before
              AND x.settled_at < now() - make_interval(secs => s.retention_seconds)
            ORDER BY x.settled_at
            LIMIT p_limit
        );
        GET DIAGNOSTICS v_deliveries = ROW_COUNT;
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
    );
    GET DIAGNOSTICS v_dedup = ROW_COUNT;

    RETURN QUERY SELECT v_deliveries, v_messages, v_dedup;
END
$$;
