-- fastapi-workqueue: PostgreSQL, version 20: the jitter of a retry is drawn by the caller.
--
-- settle (0014) drew each retry's full-jitter backoff with the database's random(), which nothing
-- outside could choose: a test of the backoff could only look at the delays it got, and a draw
-- near 0 made a delivery visible again at once (the conformance case C16 failed some 4 % of
-- runs). Now the transports draw a fraction u in [0, 1) per settled item from a random source
-- their caller may pass (`rng`), and settle takes them as p_draws: the delay of a retry without
-- one of its own is u x min(backoff_max_seconds, backoff_base_seconds x 2^(attempt - 1)); a
-- message's own backoff schedule still wins. p_draws may be left out (an older caller): the
-- database's random() draws then, as before. Lease expiry (expire_leases) keeps drawing there.
--
-- Replaces backoff_seconds of 0002 (one more parameter, p_draw, defaulting to NULL: random()) and
-- settle of 0014 (one more parameter, p_draws, defaulting to NULL; the same results). A function
-- with another parameter list is another function, so both are dropped and created again, and the
-- runtime role, where it exists, gets EXECUTE on the new settle.

DROP FUNCTION workqueue.backoff_seconds(integer, double precision, double precision, double precision[]);

-- Full-jitter exponential backoff with the draw p_draw (random() when it is NULL), or the fixed
-- schedule a delivery was published with.
CREATE OR REPLACE FUNCTION workqueue.backoff_seconds(
    p_attempt integer, p_base double precision, p_max double precision, p_schedule double precision[],
    p_draw double precision DEFAULT NULL
) RETURNS double precision
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN p_schedule IS NOT NULL AND cardinality(p_schedule) > 0
            THEN p_schedule[least(greatest(p_attempt, 1), cardinality(p_schedule))]
        ELSE coalesce(p_draw, random()) * least(p_max, p_base * power(2::double precision, greatest(p_attempt, 1) - 1))
    END
$$;

DROP FUNCTION workqueue.settle(bigint[], uuid[], text[], double precision[], text[], text[]);

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

REVOKE ALL ON FUNCTION workqueue.backoff_seconds(integer, double precision, double precision, double precision[],
                                                 double precision) FROM PUBLIC;
REVOKE ALL ON FUNCTION workqueue.settle(bigint[], uuid[], text[], double precision[], text[], text[],
                                        double precision[]) FROM PUBLIC;

-- A database whose runtime role (roles/runtime_role.sql) was set up before this version keeps
-- being able to settle.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.settle(bigint[], uuid[], text[], double precision[], text[], text[],
                                                   double precision[])
            TO workqueue_runtime;
    END IF;
END
$$;
