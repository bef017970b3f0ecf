-- fastapi-workqueue: PostgreSQL, version 16: publish_one hands a message it did not write
-- straight to publish's general path.
--
-- Replaces publish_one of 0012 (same name, parameters and results, the same answers). 0012 handed
-- such a message (a keyed topic, a repeated MessageID, a message over the topic's cap, an unknown
-- topic) to publish with no deduplication keys, and publish's own path for one message then ran
-- the guard that had just failed a second time before it took its general path. Every single
-- publish to a topic with an Exclusive or Ordered subscription paid for that.

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
          AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes))
        ORDER BY s.id;
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
