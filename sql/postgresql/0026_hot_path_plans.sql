-- fastapi-workqueue: PostgreSQL, version 26: the functions of an order's path plan once, and a
-- message to a topic with Exclusive or Ordered subscriptions is published in one call.
--
-- Generic plans. A PL/pgSQL function plans each of its statements with the call's values (a
-- "custom" plan) for its first five calls in a session, and keeps doing so while a custom plan
-- looks cheaper than the generic one. For the statements of publish, claim, settle and the key
-- handling that is nearly always: they read a handful of rows through a primary key or a partial
-- index, so the server planned them again on every call. bench/load_sql.py measured the example
-- app's path (a publish to an Exclusive and an Ordered subscription, each claimed and settled):
-- 12.0 server CPU-ms per order one at a time before this migration, 4.7 with these settings alone
-- and 3.3-3.9 with publish_one's single call below too; 0.95 and 0.50-0.64 in batches of 50. `plan_cache_mode = force_generic_plan` plans each statement once per session, and
-- `enable_seqscan = off` keeps those plans, made without the call's values, on the indexes they
-- were written for even while a table is small or its statistics are stale (a generic plan that
-- guessed a sequential scan of `delivery` would keep it for the session). Both settings hold only
-- while the function runs; SET LOCAL of other settings inside (claim's synchronous_commit) still
-- lasts until the transaction ends.
--
-- publish_one (0012, 0016, 0017) wrote only to topics without keyed subscriptions; for any other
-- topic its guard failed and it called publish with arrays of one, two functions and a failed
-- INSERT per message: the example app's every order. It now writes every topic's message itself:
-- the message, then one statement that reads the subscriptions, computes each delivery's key mode
-- from its subscription's partition mode as that statement sees it, locks (creating where needed)
-- the key's partition row and inserts the deliveries (as publish does since 0018: the key mode is
-- never decided by an earlier statement), then one UPDATE that points each key that has nothing
-- to run at its new delivery. Unknown topics, messages over the cap and stored MessageIDs still go
-- to publish, which tells which and answers.

CREATE OR REPLACE FUNCTION workqueue.publish_one(
    p_topic text,
    p_message_id uuid,
    p_partition_key text,
    p_attributes jsonb,
    p_payload text,
    p_payload_ref text,
    p_correlation_id text,
    p_content_hash text,
    p_delay double precision,
    p_not_before timestamptz,
    p_max_attempts integer,
    p_backoff_schedule text,
    p_envelope_bytes integer
) RETURNS TABLE (idx integer, status text, message_id uuid, error_code text, error_message text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_visible timestamptz;
    v_backoff double precision[];
    v_sids integer[];
    v_ids bigint[];
    v_modes smallint[];
    v_notify integer[];
BEGIN
    -- The message INSERT carries the guard: the topic exists and the message is within its cap.
    INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                        correlation_id, deduplication_key, content_hash)
    SELECT p_message_id, p_topic, p_partition_key, coalesce(p_attributes, '{}'::jsonb),
           p_payload, p_payload_ref, p_correlation_id, NULL, p_content_hash
    FROM workqueue.topic t
    WHERE t.name = p_topic
      AND (t.max_payload_bytes IS NULL OR p_envelope_bytes <= t.max_payload_bytes)
    ON CONFLICT (id) DO NOTHING;
    IF NOT FOUND THEN
        -- Not written: the guard failed or the MessageID is stored already. publish tells which. Its
        -- deduplication keys go as an array of one NULL, not as NULL: publish then takes its general
        -- path at once (the same answers, as 0010 says).
        RETURN QUERY
        SELECT * FROM workqueue.publish(
            p_topic, ARRAY[p_message_id], ARRAY[p_partition_key], ARRAY[p_attributes], ARRAY[p_payload],
            ARRAY[p_payload_ref], ARRAY[p_correlation_id], ARRAY[p_content_hash], ARRAY[NULL::text], NULL,
            ARRAY[p_delay], ARRAY[p_not_before], ARRAY[p_max_attempts], ARRAY[p_backoff_schedule],
            ARRAY[p_envelope_bytes]);
        RETURN;
    END IF;
    v_visible := CASE WHEN p_not_before IS NULL AND p_delay IS NULL THEN now()
                      ELSE greatest(now(), coalesce(p_not_before, now() + make_interval(secs => coalesce(p_delay, 0)))) END;
    IF p_backoff_schedule IS NOT NULL THEN
        v_backoff := ARRAY(SELECT b::double precision FROM jsonb_array_elements_text(p_backoff_schedule::jsonb) AS b);
    END IF;

    -- One statement reads the subscriptions once, locks the key of every keyed delivery (in
    -- subscription order, as publish does) and inserts the deliveries, each keyed one formed from
    -- its key's locked row: its id is taken after the lock.
    WITH target AS MATERIALIZED (
        SELECT s.id AS sid,
               (CASE WHEN p_partition_key IS NULL OR s.partition_mode = 'None' THEN 0
                     WHEN s.partition_mode = 'Exclusive' THEN 1 ELSE 2 END)::smallint AS key_mode,
               coalesce(p_max_attempts, s.max_attempts) AS max_attempts,
               s.backoff_base_seconds, s.backoff_max_seconds
        FROM workqueue.subscription s
        WHERE s.topic = p_topic AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes))
    ), locked AS (
        INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
        SELECT t.sid, p_partition_key FROM target t WHERE t.key_mode > 0
        ORDER BY 1
        ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id
        RETURNING p.subscription_id
    ), new_delivery AS (
        INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
            max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at)
        SELECT t.sid, p_message_id, p_partition_key, t.key_mode, t.max_attempts, t.backoff_base_seconds,
               t.backoff_max_seconds, v_backoff, v_visible
        FROM target t
        LEFT JOIN locked l ON l.subscription_id = t.sid
        WHERE t.key_mode = 0 OR l.subscription_id IS NOT NULL
        ORDER BY t.sid
        RETURNING id, subscription_id, key_mode
    )
    SELECT array_agg(nd.subscription_id), array_agg(nd.id), array_agg(nd.key_mode)
    INTO v_sids, v_ids, v_modes
    FROM new_delivery nd;

    IF 0 < ANY (v_modes) THEN
        -- A key with nothing to run (no holder; Ordered: nothing ahead and no dead-lettered head;
        -- Exclusive: nothing due sooner) gets the new delivery as its next one. Its row is this
        -- transaction's since the statement above.
        WITH pointed AS (
            UPDATE workqueue.partition p
            SET next_id = x.id, next_visible_at = v_visible
            FROM unnest(v_sids, v_ids, v_modes) AS x(sid, id, mode)
            WHERE x.mode > 0 AND p.subscription_id = x.sid AND p.partition_key = p_partition_key
              AND p.holder_id IS NULL
              AND ((x.mode = 2 AND p.next_id IS NULL AND p.blocked_id IS NULL)
                   OR (x.mode = 1 AND (p.next_id IS NULL OR v_visible < p.next_visible_at)))
            RETURNING p.subscription_id
        )
        SELECT array_agg(pointed.subscription_id) INTO v_notify FROM pointed;
    END IF;
    IF v_visible <= now() THEN
        -- One wake-up per subscription with work to claim now: its unkeyed delivery, or a key it
        -- can claim.
        PERFORM pg_notify('workqueue', x.sid::text)
        FROM unnest(v_sids, v_modes) AS x(sid, mode)
        WHERE x.mode = 0 OR x.sid = ANY (v_notify)
        ORDER BY x.sid;
    END IF;
    RETURN;  -- no rows: Accepted
END
$$;

-- The rest of an order's path: the same bodies, planned once per session.
ALTER FUNCTION workqueue.publish(text, uuid[], text[], jsonb[], text[], text[], text[], text[], text[],
    double precision[], double precision[], timestamptz[], integer[], text[], integer[])
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off;
ALTER FUNCTION workqueue.claim(text, integer)
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off;
ALTER FUNCTION workqueue.claim_many(text[], integer)
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off;
ALTER FUNCTION workqueue.heartbeat(bigint[], uuid[], smallint[], text[])
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off;
ALTER FUNCTION workqueue.settle(bigint[], uuid[], text[], double precision[], text[], text[], double precision[])
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off;
ALTER FUNCTION workqueue.refresh_partition(integer, text, smallint)
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off;
ALTER FUNCTION workqueue.release_keys(bigint[])
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off;
ALTER FUNCTION workqueue.rederive_stale(integer[], integer)
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off;
