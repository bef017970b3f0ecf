-- fastapi-workqueue: PostgreSQL, version 14: settle costs the same per item at any batch size.
--
-- Replaces settle of 0007 (same name, parameters and results). 0007 joined the locked rows, the
-- items and the updated rows through CTE scans, and the planner, which cannot know how many items
-- come, planned those joins as nested loops: every item compared with every other, twice, which
-- made a settle of 300 items cost some 50 ms (seen while a worker drained a large backlog, whose
-- slower settles grew the batches further). Now each item reaches its row through the primary
-- key (a lateral lookup per item, in id order), the update joins by id alone, and the answers are
-- looked up by id in a jsonb object.

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
               d.backoff_max_seconds, d.backoff_schedule, i.outcome, i.delay, i.reason, i.error
        FROM (SELECT * FROM unnest(p_ids, p_tokens, p_outcomes, p_delays, p_reasons, p_errors)
                                AS t(id, token, outcome, delay, reason, error)
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
        WHERE d.id = pl.id
        RETURNING d.id, d.status, d.key_mode
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
