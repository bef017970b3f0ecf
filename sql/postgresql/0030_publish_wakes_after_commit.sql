-- fastapi-workqueue: PostgreSQL, version 30: a publish wakes its consumers after its commit, not
-- inside it.
--
-- A transaction that has called pg_notify takes a lock of the whole database at its commit (so
-- that notifications arrive in commit order) and holds it until the commit is over, including the
-- wait for its WAL to reach the disk. Every publish_one sent its wake-ups with pg_notify inside the
-- publishing transaction, the request's own: the commits of concurrent publishers therefore went
-- through that lock one at a time, each waiting for the one before it to be flushed, and a
-- publishing request cost the baseline endpoint's throughput far more than its statements did
-- (bench/load.py, set-up publish against baseline at 8 clients).
--
-- publish_one_quiet is publish_one without the NOTIFY: when the message is Accepted and some
-- subscription has work to claim now, it answers one row, status Accepted, whose
-- wake_subscriptions lists those subscriptions' ids; with nobody to wake it answers no rows, as
-- publish_one does. The PostgreSQL transport calls it and, once the transaction has committed
-- (the request's session, or the call's own), sends the ids in one NOTIFY of their own from a
-- connection that writes nothing, so the lock is held for a moment and no commit waits on another's
-- flush. The payload is the ids joined by commas; the listener (database/listener.py) wakes each,
-- and every consumer when it cannot read one. A rollback wakes nobody, as before.
--
-- publish_one keeps its parameters, answers and grants and sends its NOTIFY as before (for a
-- process of an earlier version during a rolling deploy): it calls publish_one_quiet and notifies
-- what it answers. A listener of an earlier version ignores a payload of several ids; its
-- consumers find that work on their next poll.

-- publish_one without the NOTIFY: the same writes and answers, and when the message is Accepted
-- with work to claim now, one row (status Accepted) naming the subscriptions to wake once the
-- transaction has committed.
CREATE OR REPLACE FUNCTION workqueue.publish_one_quiet(
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
) RETURNS TABLE (idx integer, status text, message_id uuid, error_code text, error_message text,
                wake_subscriptions integer[])
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
    v_wake integer[];
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
        SELECT r.*, NULL::integer[] FROM workqueue.publish(
            p_topic, ARRAY[p_message_id], ARRAY[p_partition_key], ARRAY[p_attributes], ARRAY[p_payload],
            ARRAY[p_payload_ref], ARRAY[p_correlation_id], ARRAY[p_content_hash], ARRAY[NULL::text], NULL,
            ARRAY[p_delay], ARRAY[p_not_before], ARRAY[p_max_attempts], ARRAY[p_backoff_schedule],
            ARRAY[p_envelope_bytes]) AS r;
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
        -- The subscriptions with work to claim now (its unkeyed delivery, or a key it can claim)
        -- are answered, not notified: the caller wakes them once the transaction has committed.
        SELECT array_agg(x.sid ORDER BY x.sid) INTO v_wake
        FROM unnest(v_sids, v_modes) AS x(sid, mode)
        WHERE x.mode = 0 OR x.sid = ANY (v_notify);
        IF v_wake IS NOT NULL THEN
            RETURN QUERY SELECT 1, 'Accepted'::text, p_message_id, NULL::text, NULL::text, v_wake;
            RETURN;
        END IF;
    END IF;
    RETURN;  -- no rows: Accepted, nobody to wake
END
$$;

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
    v_row record;
BEGIN
    FOR v_row IN
        SELECT * FROM workqueue.publish_one_quiet(
            p_topic, p_message_id, p_partition_key, p_attributes, p_payload, p_payload_ref,
            p_correlation_id, p_content_hash, p_delay, p_not_before, p_max_attempts,
            p_backoff_schedule, p_envelope_bytes)
    LOOP
        IF v_row.wake_subscriptions IS NOT NULL THEN
            PERFORM pg_notify('workqueue', sid::text) FROM unnest(v_row.wake_subscriptions) AS sid;
        ELSE
            idx := v_row.idx;
            status := v_row.status;
            message_id := v_row.message_id;
            error_code := v_row.error_code;
            error_message := v_row.error_message;
            RETURN NEXT;
        END IF;
    END LOOP;
    RETURN;  -- no rows: Accepted
END
$$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.publish_one_quiet(text, uuid, text, jsonb, text, text, text, text,
            double precision, timestamptz, integer, text, integer) TO workqueue_runtime;
    END IF;
END
$$;
