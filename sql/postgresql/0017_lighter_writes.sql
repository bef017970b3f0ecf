-- fastapi-workqueue: PostgreSQL, version 17: less work for the server on every write of a
-- delivery, and a claim of deliveries without keys that does not wait for the disk.
--
-- 1. The two CHECK constraints of delivery (status and key_mode) go. PostgreSQL reads a table's
--    CHECK constraints from the catalog and plans them again for every statement that writes the
--    table, and every publish, claim, heartbeat and settle writes delivery: some 7 % of the
--    server's work for one published message. Only this schema's functions write delivery (the
--    runtime role has no table privileges, see roles/runtime_role.sql), they write only the
--    values the constraints allowed, and the conformance suite checks every state they produce.
-- 2. publish_one of 0016 (same name, parameters and results): the deliveries of one message are
--    inserted without sorting the subscriptions first. Their order among subscriptions means
--    nothing, and the sort node cost a few percent of a call.
-- 3. claim of 0004 (same name, parameters and results): on a subscription without keys (None) a
--    claim that took deliveries commits with synchronous_commit off. Every other write keeps
--    waiting for the disk, and a later synchronous commit of any session (the settle of the same
--    deliveries at the latest) makes the claim durable too, since the log is written in order.
--    Should the server crash in the fraction of a second before that, the claim is lost whole:
--    its deliveries are Pending again with their attempt counts as before, and a worker that
--    still runs one of them has a lease token that matches nothing, so its heartbeat ends the
--    handler (LeaseLost) and its settle changes nothing (invariant 3). Nothing accepted is lost,
--    none is settled twice; the delivery runs again, as at-least-once delivery allows, sooner
--    than if its lease had to expire. A claim on an Exclusive or Ordered subscription keeps the
--    synchronous commit: were its key's lock lost while the holder still ran, a second holder of
--    the key could start before the first one noticed.

ALTER TABLE workqueue.delivery DROP CONSTRAINT IF EXISTS delivery_status_check;
ALTER TABLE workqueue.delivery DROP CONSTRAINT IF EXISTS delivery_key_mode_check;

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
AS $$
#variable_conflict use_column
DECLARE
    v_visible timestamptz;
BEGIN
    -- As in publish: the message INSERT carries the guard (the topic exists, has no Exclusive or
    -- Ordered subscription, and the message is within its cap); the deliveries go to the
    -- subscriptions without keys.
    INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                        correlation_id, deduplication_key, content_hash)
    SELECT p_message_id, p_topic, p_partition_key, coalesce(p_attributes, '{}'::jsonb),
           p_payload, p_payload_ref, p_correlation_id, NULL, p_content_hash
    FROM workqueue.topic t
    WHERE t.name = p_topic
      AND NOT EXISTS (SELECT 1 FROM workqueue.subscription s WHERE s.topic = t.name AND s.partition_mode <> 'None')
      AND (t.max_payload_bytes IS NULL OR p_envelope_bytes <= t.max_payload_bytes)
    ON CONFLICT (id) DO NOTHING;
    IF FOUND THEN
        v_visible := CASE WHEN p_not_before IS NULL AND p_delay IS NULL THEN now()
                          ELSE greatest(now(), coalesce(p_not_before, now() + make_interval(secs => coalesce(p_delay, 0)))) END;
        INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
            max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at)
        SELECT s.id, p_message_id, p_partition_key, 0,
               coalesce(p_max_attempts, s.max_attempts), s.backoff_base_seconds, s.backoff_max_seconds,
               CASE WHEN p_backoff_schedule IS NULL THEN NULL
                    ELSE ARRAY(SELECT b::double precision FROM jsonb_array_elements_text(p_backoff_schedule::jsonb) AS b) END,
               v_visible
        FROM workqueue.subscription s
        WHERE s.topic = p_topic AND s.partition_mode = 'None'
          AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes));
        IF v_visible <= now() THEN
            PERFORM pg_notify('workqueue', s.id::text)
            FROM workqueue.subscription s
            WHERE s.topic = p_topic AND s.partition_mode = 'None'
              AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes));
        END IF;
        RETURN;  -- no rows: Accepted
    END IF;
    -- Not written: the guard failed or the MessageID is stored already. publish tells which. Its
    -- deduplication keys go as an array of one NULL, not as NULL: publish then takes its general
    -- path at once (the same answers, as 0010 says) instead of trying this guard again first.
    RETURN QUERY
    SELECT * FROM workqueue.publish(
        p_topic, ARRAY[p_message_id], ARRAY[p_partition_key], ARRAY[p_attributes], ARRAY[p_payload],
        ARRAY[p_payload_ref], ARRAY[p_correlation_id], ARRAY[p_content_hash], ARRAY[NULL::text], NULL,
        ARRAY[p_delay], ARRAY[p_not_before], ARRAY[p_max_attempts], ARRAY[p_backoff_schedule],
        ARRAY[p_envelope_bytes]);
END
$$;

CREATE OR REPLACE FUNCTION workqueue.claim(p_subscription text, p_limit integer)
RETURNS TABLE (
    delivery_id bigint, lease_token uuid, attempt integer, max_attempts integer,
    lease_expires_at timestamptz, message_id uuid, topic text, partition_key text,
    attributes jsonb, payload text, payload_ref text, correlation_id text,
    published_at timestamptz
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_sub record;
    v_keyed bigint[];
    v_keys text[];
    v_unkeyed bigint[];
    v_ids bigint[];
    v_got integer;
    v_key text;
BEGIN
    SELECT s.id, s.partition_mode, s.lease_seconds INTO v_sub
    FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic
    WHERE s.name = p_subscription AND s.status = 'Active' AND t.status = 'Active';
    IF NOT FOUND OR p_limit < 1 THEN
        RETURN;
    END IF;

    IF v_sub.partition_mode <> 'None' THEN
        -- Keys that can run now: their partition row is the lock.
        SELECT array_agg(k.next_id), array_agg(k.partition_key) INTO v_keyed, v_keys
        FROM (
            SELECT pt.next_id, pt.partition_key
            FROM workqueue.partition pt
            WHERE pt.subscription_id = v_sub.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
              AND pt.next_visible_at <= now()
            ORDER BY pt.next_visible_at
            LIMIT p_limit
            FOR UPDATE SKIP LOCKED
        ) k;
    END IF;

    -- Deliveries without a key lock (None mode, or no partition key). On a keyed subscription
    -- they share the claim with the keys: neither side can take every slot.
    SELECT array_agg(u.id) INTO v_unkeyed
    FROM (
        SELECT d.id
        FROM workqueue.delivery d
        WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0
          AND d.visible_at <= now()
        ORDER BY d.visible_at, d.id
        LIMIT CASE WHEN v_keyed IS NULL THEN p_limit
                   ELSE greatest(p_limit - cardinality(v_keyed), p_limit / 2) END
        FOR UPDATE SKIP LOCKED
    ) u;
    IF v_keyed IS NOT NULL AND v_unkeyed IS NOT NULL AND cardinality(v_keyed) + cardinality(v_unkeyed) > p_limit THEN
        v_keyed := v_keyed[1:p_limit - cardinality(v_unkeyed)];
        v_keys := v_keys[1:p_limit - cardinality(v_unkeyed)];
    END IF;
    v_ids := coalesce(v_keyed, '{}'::bigint[]) || coalesce(v_unkeyed, '{}'::bigint[]);
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
    IF v_sub.partition_mode = 'None' THEN
        -- This transaction commits without waiting for its WAL to reach disk (see the head of
        -- this file): a claim lost in a crash of the server leaves its deliveries Pending.
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;

    RETURN QUERY
    WITH d AS (
        UPDATE workqueue.delivery d
        SET status = 'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
            lease_token = gen_random_uuid(),
            lease_expires_at = now() + make_interval(secs => v_sub.lease_seconds),
            claimed_at = now(), progress_percent = NULL, progress_message = NULL
        WHERE d.id = ANY (v_ids) AND d.status = 'Pending'
        RETURNING d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, d.message_id,
                  d.partition_key, d.key_mode
    ), held AS (
        UPDATE workqueue.partition pt
        SET holder_id = d.id, next_id = NULL, next_visible_at = NULL
        FROM d
        WHERE pt.subscription_id = v_sub.id AND pt.partition_key = ANY (v_keys)
          AND d.key_mode > 0 AND pt.partition_key = d.partition_key
    )
    SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, m.id, m.topic,
           m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id, m.published_at
    FROM d JOIN workqueue.message m ON m.id = d.message_id
    ORDER BY d.id;
    GET DIAGNOSTICS v_got = ROW_COUNT;

    IF v_got < cardinality(v_ids) AND v_keys IS NOT NULL THEN
        -- A key pointed at a delivery that was no longer Pending: re-derive those keys.
        FOREACH v_key IN ARRAY v_keys LOOP
            IF EXISTS (SELECT 1 FROM workqueue.partition pt
                       WHERE pt.subscription_id = v_sub.id AND pt.partition_key = v_key AND pt.holder_id IS NULL) THEN
                PERFORM workqueue.refresh_partition(v_sub.id, v_key,
                    CASE v_sub.partition_mode WHEN 'Exclusive' THEN 1 ELSE 2 END::smallint);
            END IF;
        END LOOP;
    END IF;
END
$$;
