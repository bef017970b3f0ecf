-- fastapi-workqueue: PostgreSQL operations, version 1.
-- One function per queue operation. They are SECURITY DEFINER: a runtime role needs EXECUTE on
-- them and nothing else (roles/runtime_role.sql), so the claim, settle, cancel and sweep rules
-- cannot be bypassed by a caller with a connection string.
--
-- Lock order, everywhere: a partition row before a Pending or DeadLettered delivery of its key.
-- Settle and lease expiry lock their InFlight deliveries first (in id order) and then the
-- partition rows (in key order); a claim never waits for an InFlight delivery, so no cycle forms.

-- ---------------------------------------------------------------------------------------------
-- Helpers
-- ---------------------------------------------------------------------------------------------

-- Full-jitter exponential backoff, or the fixed schedule a delivery was published with.
CREATE OR REPLACE FUNCTION workqueue.backoff_seconds(
    p_attempt integer, p_base double precision, p_max double precision, p_schedule double precision[]
) RETURNS double precision
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN p_schedule IS NOT NULL AND cardinality(p_schedule) > 0
            THEN p_schedule[least(greatest(p_attempt, 1), cardinality(p_schedule))]
        ELSE random() * least(p_max, p_base * power(2::double precision, greatest(p_attempt, 1) - 1))
    END
$$;

-- The filter subset: {"field","operator","value"} leaves with eq, neq, startswith, isnull,
-- isnotnull, combined by {"logic": "and"|"or", "filters": [...]}. Case-sensitive. An attribute
-- that is absent matches only isnull. Validation of the allowed shape happens when a
-- subscription is saved; this function only evaluates.
CREATE OR REPLACE FUNCTION workqueue.filter_matches(p_filter jsonb, p_attributes jsonb)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_child jsonb;
    v_value text;
    v_logic text;
BEGIN
    IF p_filter IS NULL OR p_filter = 'null'::jsonb THEN
        RETURN true;
    END IF;
    IF p_filter ? 'filters' THEN
        v_logic := coalesce(p_filter ->> 'logic', 'and');
        FOR v_child IN SELECT jsonb_array_elements(p_filter -> 'filters') LOOP
            IF v_logic = 'or' AND workqueue.filter_matches(v_child, p_attributes) THEN
                RETURN true;
            ELSIF v_logic = 'and' AND NOT workqueue.filter_matches(v_child, p_attributes) THEN
                RETURN false;
            END IF;
        END LOOP;
        RETURN v_logic = 'and';
    END IF;
    v_value := coalesce(p_attributes, '{}'::jsonb) ->> (p_filter ->> 'field');
    RETURN CASE p_filter ->> 'operator'
        WHEN 'eq' THEN v_value IS NOT NULL AND v_value = (p_filter ->> 'value')
        WHEN 'neq' THEN v_value IS NOT NULL AND v_value <> (p_filter ->> 'value')
        WHEN 'startswith' THEN v_value IS NOT NULL AND left(v_value, length(p_filter ->> 'value')) = (p_filter ->> 'value')
        WHEN 'isnull' THEN v_value IS NULL
        WHEN 'isnotnull' THEN v_value IS NOT NULL
        ELSE false
    END;
END
$$;

-- Re-derives the state of one key from its deliveries: the holder, the next delivery to claim
-- and (Ordered) the dead-lettered head that blocks it. Deletes the row of a key with no live work.
-- The caller must already hold the locks of the deliveries it changed.
CREATE OR REPLACE FUNCTION workqueue.refresh_partition(p_subscription_id integer, p_key text, p_mode smallint)
RETURNS boolean   -- true when the key can be claimed right now
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_holder bigint;
    v_next bigint;
    v_next_visible timestamptz;
    v_blocked bigint;
    v_head record;
BEGIN
    INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
    VALUES (p_subscription_id, p_key)
    ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id
    RETURNING p.holder_id INTO v_holder;

    IF v_holder IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM workqueue.delivery d WHERE d.id = v_holder AND d.status = 'InFlight'
    ) THEN
        v_holder := NULL;
    END IF;

    IF p_mode = 2 THEN
        SELECT d.id, d.status, d.visible_at INTO v_head
        FROM workqueue.delivery d
        WHERE d.subscription_id = p_subscription_id AND d.partition_key = p_key AND d.key_mode = 2
          AND d.status IN ('Pending', 'InFlight', 'DeadLettered')
        ORDER BY d.id
        LIMIT 1;
        IF FOUND THEN
            IF v_head.status = 'InFlight' THEN
                v_holder := v_head.id;
            ELSIF v_head.status = 'DeadLettered' THEN
                v_blocked := v_head.id;
            ELSIF v_holder IS NULL THEN
                v_next := v_head.id;
                v_next_visible := v_head.visible_at;
            END IF;
        END IF;
    ELSIF v_holder IS NULL THEN
        SELECT d.id, d.visible_at INTO v_next, v_next_visible
        FROM workqueue.delivery d
        WHERE d.subscription_id = p_subscription_id AND d.partition_key = p_key AND d.key_mode = 1
          AND d.status = 'Pending'
        ORDER BY d.visible_at, d.id
        LIMIT 1;
    END IF;

    IF v_holder IS NULL AND v_next IS NULL AND v_blocked IS NULL THEN
        DELETE FROM workqueue.partition p
        WHERE p.subscription_id = p_subscription_id AND p.partition_key = p_key;
        RETURN false;
    END IF;
    UPDATE workqueue.partition p
    SET holder_id = v_holder, next_id = v_next, next_visible_at = v_next_visible, blocked_id = v_blocked
    WHERE p.subscription_id = p_subscription_id AND p.partition_key = p_key;
    RETURN v_holder IS NULL AND v_next IS NOT NULL AND v_next_visible <= now();
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Topology
-- ---------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION workqueue.sync_topic(
    p_name text, p_max_payload_bytes integer, p_is_fifo boolean, p_transport text DEFAULT 'database'
) RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO workqueue.topic AS t (name, transport, max_payload_bytes, is_fifo)
    VALUES (p_name, p_transport, p_max_payload_bytes, p_is_fifo)
    ON CONFLICT (name) DO UPDATE
    SET max_payload_bytes = EXCLUDED.max_payload_bytes, is_fifo = EXCLUDED.is_fifo,
        transport = EXCLUDED.transport, updated_at = now()
    WHERE (t.max_payload_bytes, t.is_fifo, t.transport)
          IS DISTINCT FROM (EXCLUDED.max_payload_bytes, EXCLUDED.is_fifo, EXCLUDED.transport)
$$;

-- Creates or updates a subscription's definition. The status (Active/Paused) is the operators'
-- and is only set when the subscription is created. A partition mode cannot change while the
-- subscription has live work (its deliveries were routed for the old mode).
CREATE OR REPLACE FUNCTION workqueue.sync_subscription(
    p_name text, p_topic text, p_handler_key text, p_partition_mode text,
    p_lease_seconds double precision, p_max_attempts integer,
    p_backoff_base_seconds double precision, p_backoff_max_seconds double precision,
    p_max_processing_seconds double precision, p_heartbeat_mode text, p_filter jsonb,
    p_host_type text, p_retention_seconds double precision, p_status text DEFAULT 'Active'
) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_existing workqueue.subscription%ROWTYPE;
    v_id integer;
BEGIN
    SELECT * INTO v_existing FROM workqueue.subscription s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO workqueue.subscription (
            name, topic, handler_key, partition_mode, lease_seconds, max_attempts,
            backoff_base_seconds, backoff_max_seconds, max_processing_seconds, heartbeat_mode,
            filter, host_type, retention_seconds, status)
        VALUES (p_name, p_topic, p_handler_key, p_partition_mode, p_lease_seconds, p_max_attempts,
            p_backoff_base_seconds, p_backoff_max_seconds, p_max_processing_seconds, p_heartbeat_mode,
            p_filter, p_host_type, p_retention_seconds, p_status)
        ON CONFLICT (name) DO NOTHING
        RETURNING id INTO v_id;
        IF v_id IS NULL THEN   -- created concurrently by another process: update it instead
            RETURN workqueue.sync_subscription(p_name, p_topic, p_handler_key, p_partition_mode,
                p_lease_seconds, p_max_attempts, p_backoff_base_seconds, p_backoff_max_seconds,
                p_max_processing_seconds, p_heartbeat_mode, p_filter, p_host_type,
                p_retention_seconds, p_status);
        END IF;
        RETURN v_id;
    END IF;
    IF v_existing.topic <> p_topic AND EXISTS (
        SELECT 1 FROM workqueue.delivery d
        WHERE d.subscription_id = v_existing.id AND d.status IN ('Pending', 'InFlight', 'DeadLettered')
    ) THEN
        RAISE EXCEPTION 'subscription % has live deliveries of topic %; it cannot move to topic % until they are settled or discarded',
            p_name, v_existing.topic, p_topic USING ERRCODE = 'object_in_use';
    END IF;
    IF v_existing.partition_mode <> p_partition_mode AND EXISTS (
        SELECT 1 FROM workqueue.delivery d
        WHERE d.subscription_id = v_existing.id AND d.status IN ('Pending', 'InFlight', 'DeadLettered')
    ) THEN
        RAISE EXCEPTION 'subscription % has live deliveries routed for partition mode %; change it to % once they are settled or discarded, or create a new subscription',
            p_name, v_existing.partition_mode, p_partition_mode USING ERRCODE = 'object_in_use';
    END IF;
    UPDATE workqueue.subscription s SET
        topic = p_topic, handler_key = p_handler_key, partition_mode = p_partition_mode,
        lease_seconds = p_lease_seconds, max_attempts = p_max_attempts,
        backoff_base_seconds = p_backoff_base_seconds, backoff_max_seconds = p_backoff_max_seconds,
        max_processing_seconds = p_max_processing_seconds, heartbeat_mode = p_heartbeat_mode,
        filter = p_filter, host_type = p_host_type, retention_seconds = p_retention_seconds,
        updated_at = now()
    WHERE s.id = v_existing.id
      AND (s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
           s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds,
           s.heartbeat_mode, s.filter, s.host_type, s.retention_seconds)
          IS DISTINCT FROM
          (p_topic, p_handler_key, p_partition_mode, p_lease_seconds, p_max_attempts,
           p_backoff_base_seconds, p_backoff_max_seconds, p_max_processing_seconds,
           p_heartbeat_mode, p_filter, p_host_type, p_retention_seconds);
    RETURN v_existing.id;
END
$$;

CREATE OR REPLACE FUNCTION workqueue.set_subscription_status(p_name text, p_status text)
RETURNS TABLE (subscription text, status text, changed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_old text;
BEGIN
    SELECT s.status INTO v_old FROM workqueue.subscription s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE workqueue.subscription s SET status = p_status, updated_at = now()
    WHERE s.name = p_name AND s.status <> p_status;
    IF p_status = 'Active' AND v_old <> 'Active' THEN
        PERFORM pg_notify('workqueue', (SELECT s.id::text FROM workqueue.subscription s WHERE s.name = p_name));
    END IF;
    RETURN QUERY SELECT p_name, p_status, v_old <> p_status;
END
$$;

CREATE OR REPLACE FUNCTION workqueue.list_subscriptions()
RETURNS TABLE (
    id integer, name text, topic text, handler_key text, partition_mode text,
    lease_seconds double precision, max_attempts integer, backoff_base_seconds double precision,
    backoff_max_seconds double precision, max_processing_seconds double precision,
    heartbeat_mode text, filter jsonb, status text, host_type text,
    retention_seconds double precision, topic_status text, transport text, is_fifo boolean,
    max_payload_bytes integer
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT s.id, s.name, s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
           s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds,
           s.heartbeat_mode, s.filter, s.status, s.host_type, s.retention_seconds,
           t.status, t.transport, t.is_fifo, t.max_payload_bytes
    FROM workqueue.subscription s
    JOIN workqueue.topic t ON t.name = s.topic
    ORDER BY s.name
$$;

CREATE OR REPLACE FUNCTION workqueue.list_topics()
RETURNS TABLE (name text, transport text, max_payload_bytes integer, is_fifo boolean, status text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT t.name, t.transport, t.max_payload_bytes, t.is_fifo, t.status
    FROM workqueue.topic t ORDER BY t.name
$$;

-- ---------------------------------------------------------------------------------------------
-- Publish
-- ---------------------------------------------------------------------------------------------

-- Publishes a batch of messages to one topic in the caller's transaction. Results come back
-- one per item, in order. The call is all-or-nothing: when any item is Rejected or a
-- MessageIDConflict, nothing is written and every other item reports BatchAborted.
CREATE OR REPLACE FUNCTION workqueue.publish(
    p_topic text,
    p_message_ids uuid[],
    p_partition_keys text[],
    p_attributes jsonb[],
    p_payloads text[],
    p_payload_refs text[],
    p_correlation_ids text[],
    p_content_hashes text[],
    p_deduplication_keys text[],
    p_deduplication_ttls double precision[],
    p_delays double precision[],
    p_not_befores timestamptz[],
    p_max_attempts integer[],
    p_backoff_schedules text[],
    p_envelope_bytes integer[]
) RETURNS TABLE (idx integer, status text, message_id uuid, error_code text, error_message text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_n integer := coalesce(cardinality(p_message_ids), 0);
    v_topic workqueue.topic%ROWTYPE;
    v_status text[];
    v_ids uuid[];
    v_codes text[];
    v_errors text[];
    v_failed integer;
    v_accepted integer[];
    v_inserted integer;
    v_notify integer[];
BEGIN
    IF v_n = 0 THEN
        RETURN;
    END IF;
    SELECT * INTO v_topic FROM workqueue.topic t WHERE t.name = p_topic;
    IF NOT FOUND THEN
        RETURN QUERY SELECT i, 'Rejected'::text, p_message_ids[i], 'UnknownTopic'::text,
            format('topic %L does not exist; declare it in the WorkQueue topics or create it first', p_topic)
        FROM generate_series(1, v_n) AS i;
        RETURN;
    END IF;

    -- Classify every item before writing anything.
    WITH item AS (
        SELECT i,
               p_message_ids[i] AS mid,
               p_content_hashes[i] AS hash,
               p_deduplication_keys[i] AS dkey,
               p_envelope_bytes[i] AS bytes,
               min(i) OVER (PARTITION BY p_message_ids[i]) AS first_by_id,
               first_value(p_content_hashes[i]) OVER (PARTITION BY p_message_ids[i] ORDER BY i) AS first_hash,
               CASE WHEN p_deduplication_keys[i] IS NULL THEN NULL
                    ELSE min(i) OVER (PARTITION BY p_deduplication_keys[i]) END AS first_by_dkey
        FROM generate_series(1, v_n) AS i
    ), classified AS (
        SELECT it.i,
            CASE
                WHEN v_topic.max_payload_bytes IS NOT NULL AND it.bytes > v_topic.max_payload_bytes THEN 'Rejected'
                WHEN it.first_by_id < it.i AND it.first_hash = it.hash THEN 'Duplicate'
                WHEN it.first_by_id < it.i THEN 'MessageIDConflict'
                WHEN m.id IS NOT NULL AND m.content_hash = it.hash THEN 'Duplicate'
                WHEN m.id IS NOT NULL THEN 'MessageIDConflict'
                WHEN dd.message_id IS NOT NULL THEN 'Duplicate'
                WHEN it.first_by_dkey < it.i THEN 'Duplicate'
                ELSE 'Accepted'
            END AS st,
            CASE
                WHEN v_topic.max_payload_bytes IS NULL OR it.bytes <= v_topic.max_payload_bytes THEN
                    CASE WHEN it.first_by_id < it.i OR m.id IS NOT NULL THEN it.mid
                         WHEN dd.message_id IS NOT NULL THEN dd.message_id
                         WHEN it.first_by_dkey < it.i THEN p_message_ids[it.first_by_dkey]
                         ELSE it.mid END
                ELSE it.mid
            END AS result_id,
            it.bytes
        FROM item it
        LEFT JOIN workqueue.message m ON m.id = it.mid
        LEFT JOIN workqueue.deduplication dd
               ON it.dkey IS NOT NULL AND dd.topic = p_topic AND dd.deduplication_key = it.dkey
              AND dd.expires_at > now()
    )
    SELECT array_agg(c.st ORDER BY c.i), array_agg(c.result_id ORDER BY c.i),
           array_agg(CASE c.st
                WHEN 'Rejected' THEN 'EnvelopeTooLarge'
                WHEN 'MessageIDConflict' THEN 'MessageIDConflict' END ORDER BY c.i),
           array_agg(CASE c.st
                WHEN 'Rejected' THEN format('the envelope is %s bytes; topic %L accepts at most %s bytes (max_payload_bytes); send a PayloadRef to the data instead',
                                            c.bytes, p_topic, v_topic.max_payload_bytes)
                WHEN 'MessageIDConflict' THEN 'a message with this MessageID and different content was already published; use a new MessageID for new content' END
                ORDER BY c.i)
    INTO v_status, v_ids, v_codes, v_errors
    FROM classified c;

    SELECT min(i) INTO v_failed FROM generate_series(1, v_n) AS i
    WHERE v_status[i] IN ('Rejected', 'MessageIDConflict');
    IF v_failed IS NOT NULL THEN
        RETURN QUERY SELECT i,
            CASE WHEN v_status[i] IN ('Rejected', 'MessageIDConflict') THEN v_status[i] ELSE 'Rejected' END,
            v_ids[i],
            CASE WHEN v_status[i] IN ('Rejected', 'MessageIDConflict') THEN v_codes[i] ELSE 'BatchAborted' END,
            CASE WHEN v_status[i] IN ('Rejected', 'MessageIDConflict') THEN v_errors[i]
                 ELSE format('not published: item %s of this call was refused (%s) and a publish call is all-or-nothing',
                             v_failed - 1, v_codes[v_failed]) END
        FROM generate_series(1, v_n) AS i;
        RETURN;
    END IF;

    SELECT array_agg(i ORDER BY i) INTO v_accepted
    FROM generate_series(1, v_n) AS i WHERE v_status[i] = 'Accepted';

    IF v_accepted IS NOT NULL THEN
        INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                            correlation_id, deduplication_key, content_hash)
        SELECT p_message_ids[a], p_topic, p_partition_keys[a], coalesce(p_attributes[a], '{}'::jsonb),
               p_payloads[a], p_payload_refs[a], p_correlation_ids[a], p_deduplication_keys[a],
               p_content_hashes[a]
        FROM unnest(v_accepted) AS a
        ORDER BY a
        ON CONFLICT (id) DO NOTHING;
        GET DIAGNOSTICS v_inserted = ROW_COUNT;
        IF v_inserted <> cardinality(v_accepted) THEN
            RAISE EXCEPTION 'a message with the same MessageID was published concurrently; retry the publish'
                USING ERRCODE = 'serialization_failure';
        END IF;

        INSERT INTO workqueue.deduplication AS dd (topic, deduplication_key, message_id, expires_at)
        SELECT p_topic, p_deduplication_keys[a], p_message_ids[a],
               now() + make_interval(secs => coalesce(p_deduplication_ttls[a], 300))
        FROM unnest(v_accepted) AS a
        WHERE p_deduplication_keys[a] IS NOT NULL
        ORDER BY p_deduplication_keys[a]
        ON CONFLICT (topic, deduplication_key) DO UPDATE
        SET message_id = EXCLUDED.message_id, expires_at = EXCLUDED.expires_at
        WHERE dd.expires_at <= now();
        GET DIAGNOSTICS v_inserted = ROW_COUNT;
        IF v_inserted <> (SELECT count(*) FROM unnest(v_accepted) AS a WHERE p_deduplication_keys[a] IS NOT NULL) THEN
            RAISE EXCEPTION 'a message with the same DeduplicationKey was published concurrently; retry the publish'
                USING ERRCODE = 'serialization_failure';
        END IF;

        -- Lock (creating where needed) the keys of Exclusive and Ordered subscriptions, in key
        -- order, before any delivery gets its id: ids then follow commit order within a key.
        INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
        SELECT DISTINCT s.id, p_partition_keys[a]
        FROM unnest(v_accepted) AS a
        JOIN workqueue.subscription s ON s.topic = p_topic AND s.partition_mode <> 'None'
        WHERE p_partition_keys[a] IS NOT NULL
          AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes[a]))
        ORDER BY 1, 2
        ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id;

        WITH new_delivery AS (
            INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
                max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at)
            SELECT s.id, p_message_ids[a], p_partition_keys[a],
                   CASE WHEN p_partition_keys[a] IS NULL OR s.partition_mode = 'None' THEN 0
                        WHEN s.partition_mode = 'Exclusive' THEN 1 ELSE 2 END,
                   coalesce(p_max_attempts[a], s.max_attempts), s.backoff_base_seconds,
                   s.backoff_max_seconds,
                   CASE WHEN p_backoff_schedules[a] IS NULL THEN NULL
                        ELSE ARRAY(SELECT x::double precision
                                   FROM jsonb_array_elements_text(p_backoff_schedules[a]::jsonb) AS x) END,
                   greatest(now(), coalesce(p_not_befores[a],
                                            now() + make_interval(secs => coalesce(p_delays[a], 0))))
            FROM unnest(v_accepted) AS a
            JOIN workqueue.subscription s ON s.topic = p_topic
            WHERE s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes[a])
            ORDER BY a, s.id
            RETURNING id, subscription_id, partition_key, key_mode, visible_at
        ), keyed_first AS (
            SELECT DISTINCT ON (nd.subscription_id, nd.partition_key)
                   nd.subscription_id, nd.partition_key, nd.key_mode, nd.id, nd.visible_at
            FROM new_delivery nd
            WHERE nd.key_mode > 0
            ORDER BY nd.subscription_id, nd.partition_key,
                     CASE WHEN nd.key_mode = 1 THEN nd.visible_at END, nd.id
        ), advanced AS (
            UPDATE workqueue.partition p
            SET next_id = kf.id, next_visible_at = kf.visible_at
            FROM keyed_first kf
            WHERE p.subscription_id = kf.subscription_id AND p.partition_key = kf.partition_key
              AND p.holder_id IS NULL
              AND ((kf.key_mode = 2 AND p.next_id IS NULL AND p.blocked_id IS NULL)
                   OR (kf.key_mode = 1 AND (p.next_id IS NULL OR kf.visible_at < p.next_visible_at)))
            RETURNING p.subscription_id
        )
        SELECT array_agg(DISTINCT nd.subscription_id) INTO v_notify
        FROM new_delivery nd
        WHERE nd.visible_at <= now() AND nd.key_mode = 0
           OR nd.subscription_id IN (SELECT ad.subscription_id FROM advanced ad);

        IF v_notify IS NOT NULL THEN
            PERFORM pg_notify('workqueue', sid::text) FROM unnest(v_notify) AS sid;
        END IF;
    END IF;

    RETURN QUERY SELECT i, v_status[i], v_ids[i], NULL::text, NULL::text
    FROM generate_series(1, v_n) AS i;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Consume: claim, heartbeat, settle (release is a settle with the outcome 'Release')
-- ---------------------------------------------------------------------------------------------

-- Claims up to p_limit visible deliveries of an Active subscription: attempt + 1, a fresh lease
-- token, the lease from the subscription's current lease_seconds. Keys of Exclusive and Ordered
-- subscriptions are claimed through their partition row, one delivery per key.
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
    v_lease interval;
    v_got integer := 0;
    v_keyed_first boolean;
BEGIN
    SELECT s.id, s.partition_mode, s.lease_seconds INTO v_sub
    FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic
    WHERE s.name = p_subscription AND s.status = 'Active' AND t.status = 'Active';
    IF NOT FOUND OR p_limit < 1 THEN
        RETURN;
    END IF;
    v_lease := make_interval(secs => v_sub.lease_seconds);
    -- On a keyed subscription, deliveries without a key share the claim with the keys; the
    -- side that goes first alternates at random so neither can starve the other.
    v_keyed_first := v_sub.partition_mode <> 'None' AND random() < 0.5;

    IF v_keyed_first THEN
        RETURN QUERY
        WITH p AS (
            SELECT pt.partition_key, pt.next_id
            FROM workqueue.partition pt
            WHERE pt.subscription_id = v_sub.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
              AND pt.next_visible_at <= now()
            ORDER BY pt.next_visible_at
            LIMIT p_limit
            FOR UPDATE SKIP LOCKED
        ), d AS (
            UPDATE workqueue.delivery d
            SET status = 'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
                lease_token = gen_random_uuid(), lease_expires_at = now() + v_lease,
                claimed_at = now(), progress_percent = NULL, progress_message = NULL
            FROM p
            WHERE d.id = p.next_id AND d.status = 'Pending'
            RETURNING d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at,
                      d.message_id, d.partition_key
        ), held AS (
            UPDATE workqueue.partition pt
            SET holder_id = d.id, next_id = NULL, next_visible_at = NULL
            FROM d
            WHERE pt.subscription_id = v_sub.id AND pt.partition_key = d.partition_key
        )
        SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, m.id, m.topic,
               m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id,
               m.published_at
        FROM d JOIN workqueue.message m ON m.id = d.message_id
        ORDER BY d.id;
        GET DIAGNOSTICS v_got = ROW_COUNT;
    END IF;

    IF v_got < p_limit THEN
        RETURN QUERY
        WITH c AS (
            SELECT d.id
            FROM workqueue.delivery d
            WHERE d.subscription_id = v_sub.id AND d.status = 'Pending' AND d.key_mode = 0
              AND d.visible_at <= now()
            ORDER BY d.visible_at, d.id
            LIMIT p_limit - v_got
            FOR UPDATE SKIP LOCKED
        ), d AS (
            UPDATE workqueue.delivery d
            SET status = 'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
                lease_token = gen_random_uuid(), lease_expires_at = now() + v_lease,
                claimed_at = now(), progress_percent = NULL, progress_message = NULL
            FROM c
            WHERE d.id = c.id
            RETURNING d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, d.message_id
        )
        SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, m.id, m.topic,
               m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id,
               m.published_at
        FROM d JOIN workqueue.message m ON m.id = d.message_id
        ORDER BY d.id;
        GET DIAGNOSTICS v_got = ROW_COUNT;
    ELSE
        v_got := 0;
    END IF;

    IF v_sub.partition_mode <> 'None' AND NOT v_keyed_first THEN
        -- v_got counts the rows of the last RETURN QUERY only: the unkeyed claim above.
        RETURN QUERY
        WITH p AS (
            SELECT pt.partition_key, pt.next_id
            FROM workqueue.partition pt
            WHERE pt.subscription_id = v_sub.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
              AND pt.next_visible_at <= now()
            ORDER BY pt.next_visible_at
            LIMIT p_limit - v_got
            FOR UPDATE SKIP LOCKED
        ), d AS (
            UPDATE workqueue.delivery d
            SET status = 'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
                lease_token = gen_random_uuid(), lease_expires_at = now() + v_lease,
                claimed_at = now(), progress_percent = NULL, progress_message = NULL
            FROM p
            WHERE d.id = p.next_id AND d.status = 'Pending'
            RETURNING d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at,
                      d.message_id, d.partition_key
        ), held AS (
            UPDATE workqueue.partition pt
            SET holder_id = d.id, next_id = NULL, next_visible_at = NULL
            FROM d
            WHERE pt.subscription_id = v_sub.id AND pt.partition_key = d.partition_key
        )
        SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, m.id, m.topic,
               m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id,
               m.published_at
        FROM d JOIN workqueue.message m ON m.id = d.message_id
        ORDER BY d.id;
    END IF;
END
$$;

-- Renews the leases of the given deliveries and stores their progress. alive is false once the
-- token is stale (the lease was lost) or an operator asked to cancel; a cancelled delivery's
-- lease is not renewed, so a holder that ignores the cancel loses it.
CREATE OR REPLACE FUNCTION workqueue.heartbeat(
    p_ids bigint[], p_tokens uuid[], p_percents smallint[], p_messages text[]
) RETURNS TABLE (delivery_id bigint, alive boolean, cancel_requested boolean, lease_expires_at timestamptz)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH i AS (
        SELECT * FROM unnest(p_ids, p_tokens, p_percents, p_messages) AS t(id, token, pct, msg)
    ), u AS (
        UPDATE workqueue.delivery d
        SET lease_expires_at = CASE WHEN d.cancel_requested THEN d.lease_expires_at
                                    ELSE now() + make_interval(secs => s.lease_seconds) END,
            progress_percent = coalesce(i.pct, d.progress_percent),
            progress_message = coalesce(i.msg, d.progress_message)
        FROM i, workqueue.subscription s
        WHERE d.id = i.id AND d.lease_token = i.token AND d.status = 'InFlight'
          AND s.id = d.subscription_id
        RETURNING d.id, d.cancel_requested, d.lease_expires_at
    )
    SELECT i.id, u.id IS NOT NULL AND NOT u.cancel_requested, coalesce(u.cancel_requested, false),
           u.lease_expires_at
    FROM i LEFT JOIN u ON u.id = i.id
$$;

-- Settles deliveries with their current lease token. Outcomes: Complete, Retry (explicit, with a
-- reason and optional delay), Fail (an error), DeadLetter, Release (shutdown: back to Pending at
-- once without consuming the attempt). A cancel-requested delivery becomes Discarded whatever
-- the outcome. A stale token changes nothing and answers LeaseLost.
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
    v_results text[];
    v_key record;
    v_notify integer[];
BEGIN
    WITH i AS (
        SELECT * FROM unnest(p_ids, p_tokens, p_outcomes, p_delays, p_reasons, p_errors)
                 AS t(id, token, outcome, delay, reason, error)
    ), locked AS (
        SELECT d.id, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds,
               d.backoff_max_seconds, d.backoff_schedule, i.outcome, i.delay, i.reason, i.error
        FROM workqueue.delivery d JOIN i ON i.id = d.id AND i.token = d.lease_token
        WHERE d.status = 'InFlight'
        ORDER BY d.id
        FOR UPDATE OF d
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
                WHEN pl.outcome = 'Release' THEN now()
                ELSE now() + make_interval(secs => coalesce(pl.delay,
                        workqueue.backoff_seconds(d.attempt, pl.backoff_base_seconds,
                                                  pl.backoff_max_seconds, pl.backoff_schedule))) END,
            lease_token = NULL,
            lease_expires_at = NULL,
            reason = CASE WHEN pl.cancel_requested THEN d.reason
                          WHEN pl.outcome = 'Complete' THEN NULL
                          WHEN pl.new_status = 'DeadLettered' AND pl.outcome NOT IN ('DeadLetter')
                              THEN coalesce('max attempts reached: ' || coalesce(pl.reason, pl.error), 'max attempts reached')
                          ELSE coalesce(pl.reason, d.reason) END,
            last_error = coalesce(pl.error, d.last_error),
            settled_at = CASE WHEN pl.new_status IN ('Completed', 'Discarded', 'DeadLettered') THEN now() END
        FROM plan pl
        WHERE d.id = pl.id
        RETURNING d.id, d.status, d.key_mode, d.subscription_id, d.partition_key
    )
    SELECT array_agg(u.id), array_agg(u.status) INTO v_ids, v_results FROM u;

    FOR v_key IN
        SELECT DISTINCT d.subscription_id, d.partition_key, d.key_mode
        FROM workqueue.delivery d
        WHERE d.id = ANY (v_ids) AND d.key_mode > 0
        ORDER BY d.subscription_id, d.partition_key
    LOOP
        IF workqueue.refresh_partition(v_key.subscription_id, v_key.partition_key, v_key.key_mode) THEN
            v_notify := array_append(v_notify, v_key.subscription_id);
        END IF;
    END LOOP;
    IF v_notify IS NOT NULL THEN
        PERFORM pg_notify('workqueue', sid::text) FROM (SELECT DISTINCT unnest(v_notify) AS sid) x;
    END IF;

    RETURN QUERY
    SELECT i.id, coalesce(x.result, 'LeaseLost')
    FROM unnest(p_ids) AS i(id)
    LEFT JOIN unnest(v_ids, v_results) AS x(id, result) ON x.id = i.id;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Sweeper: lease expiry and retention, one pass at a time across every process
-- ---------------------------------------------------------------------------------------------

-- InFlight deliveries whose lease ran out: Discarded when a cancel was requested, DeadLettered
-- when the attempt was the last, otherwise Pending again after backoff (the attempt counts).
CREATE OR REPLACE FUNCTION workqueue.expire_leases(p_limit integer)
RETURNS TABLE (delivery_id bigint, result text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    v_results text[];
    v_key record;
    v_notify integer[];
BEGIN
    WITH e AS (
        SELECT d.id FROM workqueue.delivery d
        WHERE d.status = 'InFlight' AND d.lease_expires_at < now()
        ORDER BY d.lease_expires_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), u AS (
        UPDATE workqueue.delivery d
        SET status = CASE WHEN d.cancel_requested THEN 'Discarded'
                          WHEN d.attempt >= d.max_attempts THEN 'DeadLettered'
                          ELSE 'Pending' END,
            visible_at = CASE WHEN d.cancel_requested OR d.attempt >= d.max_attempts THEN d.visible_at
                              ELSE now() + make_interval(secs => workqueue.backoff_seconds(
                                    d.attempt, d.backoff_base_seconds, d.backoff_max_seconds, d.backoff_schedule)) END,
            reason = CASE WHEN d.cancel_requested THEN d.reason
                          WHEN d.attempt >= d.max_attempts THEN 'lease expired on the final attempt'
                          ELSE 'lease expired' END,
            last_error = CASE WHEN d.cancel_requested THEN d.last_error
                              ELSE 'lease expired: the holder stopped renewing it' END,
            lease_token = NULL,
            lease_expires_at = NULL,
            settled_at = CASE WHEN d.cancel_requested OR d.attempt >= d.max_attempts THEN now() END
        FROM e
        WHERE d.id = e.id
        RETURNING d.id, d.status
    )
    SELECT array_agg(u.id), array_agg(u.status) INTO v_ids, v_results FROM u;

    FOR v_key IN
        SELECT DISTINCT d.subscription_id, d.partition_key, d.key_mode
        FROM workqueue.delivery d
        WHERE d.id = ANY (v_ids) AND d.key_mode > 0
        ORDER BY d.subscription_id, d.partition_key
    LOOP
        IF workqueue.refresh_partition(v_key.subscription_id, v_key.partition_key, v_key.key_mode) THEN
            v_notify := array_append(v_notify, v_key.subscription_id);
        END IF;
    END LOOP;
    IF v_notify IS NOT NULL THEN
        PERFORM pg_notify('workqueue', sid::text) FROM (SELECT DISTINCT unnest(v_notify) AS sid) x;
    END IF;

    RETURN QUERY SELECT x.id, x.result FROM unnest(v_ids, v_results) AS x(id, result);
END
$$;

-- Terminal deliveries past their subscription's retention, then messages that no delivery
-- references any more (kept as long as the longest retention of their topic, for duplicate
-- detection), then expired deduplication keys. Pending, InFlight and DeadLettered are never purged.
CREATE OR REPLACE FUNCTION workqueue.purge(p_limit integer)
RETURNS TABLE (purged_deliveries integer, purged_messages integer, purged_deduplication integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_deliveries integer;
    v_messages integer;
    v_dedup integer;
BEGIN
    DELETE FROM workqueue.delivery d
    WHERE d.id IN (
        SELECT x.id FROM workqueue.delivery x
        JOIN workqueue.subscription s ON s.id = x.subscription_id
        WHERE x.status IN ('Completed', 'Discarded')
          AND x.settled_at < now() - make_interval(secs => s.retention_seconds)
        ORDER BY x.settled_at
        LIMIT p_limit
    );
    GET DIAGNOSTICS v_deliveries = ROW_COUNT;

    DELETE FROM workqueue.message m
    WHERE m.id IN (
        SELECT x.id FROM workqueue.message x
        WHERE x.published_at < now() - make_interval(secs => coalesce(
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

-- One sweeper pass. A transaction-scoped advisory lock lets only one pass run at a time across
-- every process; a pass that finds the lock taken returns ran = false and does nothing.
CREATE OR REPLACE FUNCTION workqueue.sweep(p_limit integer DEFAULT 1000)
RETURNS TABLE (
    ran boolean, retried integer, dead_lettered integer, discarded integer,
    purged_deliveries integer, purged_messages integer, purged_deduplication integer
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
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('workqueue.sweep')::bigint) THEN
        RETURN QUERY SELECT false, 0, 0, 0, 0, 0, 0;
        RETURN;
    END IF;
    SELECT count(*) FILTER (WHERE e.result = 'Pending'),
           count(*) FILTER (WHERE e.result = 'DeadLettered'),
           count(*) FILTER (WHERE e.result = 'Discarded')
    INTO v_retried, v_dead, v_discarded
    FROM workqueue.expire_leases(p_limit) e;
    SELECT * INTO v_purge FROM workqueue.purge(p_limit);
    RETURN QUERY SELECT true, v_retried, v_dead, v_discarded, v_purge.purged_deliveries,
                        v_purge.purged_messages, v_purge.purged_deduplication;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Operator actions
-- ---------------------------------------------------------------------------------------------

-- DeadLettered → Pending with the same MessageID and the same place in its Ordered key,
-- attempts reset, the operator's note kept.
CREATE OR REPLACE FUNCTION workqueue.replay(p_subscription text, p_delivery_id bigint, p_note text)
RETURNS TABLE (result text, delivery_status text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_d record;
BEGIN
    SELECT d.id, d.status, d.key_mode, d.subscription_id, d.partition_key INTO v_d
    FROM workqueue.delivery d JOIN workqueue.subscription s ON s.id = d.subscription_id
    WHERE d.id = p_delivery_id AND s.name = p_subscription;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'NotFound'::text, NULL::text;
        RETURN;
    END IF;
    IF v_d.key_mode > 0 THEN
        INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
        VALUES (v_d.subscription_id, v_d.partition_key)
        ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id;
    END IF;
    UPDATE workqueue.delivery d
    SET status = 'Pending', attempt = 0, visible_at = now(), note = p_note, reason = NULL,
        settled_at = NULL, cancel_requested = false
    WHERE d.id = p_delivery_id AND d.status = 'DeadLettered';
    IF NOT FOUND THEN
        IF v_d.key_mode > 0 THEN
            PERFORM workqueue.refresh_partition(v_d.subscription_id, v_d.partition_key, v_d.key_mode);
        END IF;
        RETURN QUERY SELECT 'NotDeadLettered'::text, d.status FROM workqueue.delivery d WHERE d.id = p_delivery_id;
        RETURN;
    END IF;
    IF v_d.key_mode = 0 OR workqueue.refresh_partition(v_d.subscription_id, v_d.partition_key, v_d.key_mode) THEN
        PERFORM pg_notify('workqueue', v_d.subscription_id::text);
    END IF;
    RETURN QUERY SELECT 'Replayed'::text, 'Pending'::text;
END
$$;

-- Pending or DeadLettered → Discarded with the reason. InFlight → cancel requested: the
-- holder's next heartbeat reports it and the delivery becomes Discarded when the holder settles
-- (or at lease expiry if the holder died). It is never retried.
CREATE OR REPLACE FUNCTION workqueue.discard(p_subscription text, p_delivery_id bigint, p_reason text)
RETURNS TABLE (result text, cancel_requested boolean, delivery_status text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_d record;
    v_status text;
BEGIN
    SELECT d.id, d.status, d.key_mode, d.subscription_id, d.partition_key INTO v_d
    FROM workqueue.delivery d JOIN workqueue.subscription s ON s.id = d.subscription_id
    WHERE d.id = p_delivery_id AND s.name = p_subscription;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'NotFound'::text, false, NULL::text;
        RETURN;
    END IF;
    FOR v_try IN 1..3 LOOP
        -- An InFlight delivery is only flagged: that needs no key lock.
        UPDATE workqueue.delivery d SET cancel_requested = true, reason = p_reason
        WHERE d.id = p_delivery_id AND d.status = 'InFlight';
        IF FOUND THEN
            RETURN QUERY SELECT 'CancelRequested'::text, true, 'InFlight'::text;
            RETURN;
        END IF;
        IF v_d.key_mode > 0 THEN
            INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
            VALUES (v_d.subscription_id, v_d.partition_key)
            ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id;
        END IF;
        UPDATE workqueue.delivery d
        SET status = 'Discarded', reason = p_reason, settled_at = now(), lease_token = NULL,
            lease_expires_at = NULL
        WHERE d.id = p_delivery_id AND d.status IN ('Pending', 'DeadLettered')
        RETURNING d.status INTO v_status;
        IF v_status IS NOT NULL THEN
            IF v_d.key_mode > 0 AND workqueue.refresh_partition(v_d.subscription_id, v_d.partition_key, v_d.key_mode) THEN
                PERFORM pg_notify('workqueue', v_d.subscription_id::text);
            END IF;
            RETURN QUERY SELECT 'Discarded'::text, false, 'Discarded'::text;
            RETURN;
        END IF;
        SELECT d.status INTO v_status FROM workqueue.delivery d WHERE d.id = p_delivery_id;
        IF v_status IN ('Completed', 'Discarded') THEN
            IF v_d.key_mode > 0 THEN
                PERFORM workqueue.refresh_partition(v_d.subscription_id, v_d.partition_key, v_d.key_mode);
            END IF;
            RETURN QUERY SELECT 'AlreadyTerminal'::text, false, v_status;
            RETURN;
        END IF;
        -- It was claimed between the two updates: go round again.
    END LOOP;
    RAISE EXCEPTION 'delivery % changed state while being discarded; retry', p_delivery_id
        USING ERRCODE = 'serialization_failure';
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Operator reads
-- ---------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION workqueue.stats(p_subscription text DEFAULT NULL)
RETURNS TABLE (
    subscription text, topic text, subscription_status text, partition_mode text,
    pending bigint, claimable bigint, in_flight bigint, dead_lettered bigint, completed bigint,
    discarded bigint, oldest_pending_at timestamptz
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT s.name, s.topic, s.status, s.partition_mode,
           coalesce(c.pending, 0), coalesce(cl.claimable, 0), coalesce(c.in_flight, 0),
           coalesce(c.dead_lettered, 0), coalesce(c.completed, 0), coalesce(c.discarded, 0),
           c.oldest_pending_at
    FROM workqueue.subscription s
    LEFT JOIN LATERAL (
        SELECT count(*) FILTER (WHERE d.status = 'Pending') AS pending,
               count(*) FILTER (WHERE d.status = 'InFlight') AS in_flight,
               count(*) FILTER (WHERE d.status = 'DeadLettered') AS dead_lettered,
               count(*) FILTER (WHERE d.status = 'Completed') AS completed,
               count(*) FILTER (WHERE d.status = 'Discarded') AS discarded,
               min(d.created_at) FILTER (WHERE d.status = 'Pending') AS oldest_pending_at
        FROM workqueue.delivery d WHERE d.subscription_id = s.id
    ) c ON true
    LEFT JOIN LATERAL (
        SELECT (SELECT count(*) FROM workqueue.delivery d
                WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
                  AND d.visible_at <= now())
             + (SELECT count(*) FROM workqueue.partition p
                WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                  AND p.next_visible_at <= now()) AS claimable
    ) cl ON true
    WHERE p_subscription IS NULL OR s.name = p_subscription
    ORDER BY s.name
$$;

-- Backlog for autoscalers: claimable Pending (single flight per key applied) plus InFlight. A
-- paused subscription has nothing claimable.
CREATE OR REPLACE FUNCTION workqueue.backlog(p_subscription text)
RETURNS TABLE (subscription text, claimable bigint, in_flight bigint, backlog bigint)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH s AS (
        SELECT s.id, s.name, s.status = 'Active' AND t.status = 'Active' AS active
        FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic
        WHERE s.name = p_subscription
    ), n AS (
        SELECT s.name,
               CASE WHEN s.active THEN
                   (SELECT count(*) FROM workqueue.delivery d
                    WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
                      AND d.visible_at <= now())
                 + (SELECT count(*) FROM workqueue.partition p
                    WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                      AND p.next_visible_at <= now())
               ELSE 0 END AS claimable,
               (SELECT count(*) FROM workqueue.delivery d
                WHERE d.subscription_id = s.id AND d.status = 'InFlight') AS in_flight
        FROM s
    )
    SELECT n.name, n.claimable, n.in_flight, n.claimable + n.in_flight FROM n
$$;

CREATE OR REPLACE FUNCTION workqueue.get_delivery(p_delivery_id bigint)
RETURNS TABLE (
    delivery_id bigint, subscription text, message_id uuid, topic text, partition_key text,
    status text, attempt integer, max_attempts integer, visible_at timestamptz,
    lease_expires_at timestamptz, cancel_requested boolean, progress_percent smallint,
    progress_message text, reason text, last_error text, note text, created_at timestamptz,
    claimed_at timestamptz, settled_at timestamptz, attributes jsonb, payload text,
    correlation_id text
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.id, s.name, d.message_id, m.topic, d.partition_key, d.status, d.attempt,
           d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id
    FROM workqueue.delivery d
    JOIN workqueue.subscription s ON s.id = d.subscription_id
    JOIN workqueue.message m ON m.id = d.message_id
    WHERE d.id = p_delivery_id
$$;

-- Deliveries of one subscription in one state, oldest first, paged by id.
CREATE OR REPLACE FUNCTION workqueue.list_deliveries(
    p_subscription text, p_status text, p_limit integer, p_after_id bigint DEFAULT 0
) RETURNS TABLE (
    delivery_id bigint, message_id uuid, partition_key text, status text, attempt integer,
    max_attempts integer, reason text, last_error text, note text, created_at timestamptz,
    settled_at timestamptz, attributes jsonb, payload text, correlation_id text
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT d.id, d.message_id, d.partition_key, d.status, d.attempt, d.max_attempts, d.reason,
           d.last_error, d.note, d.created_at, d.settled_at, m.attributes, m.payload, m.correlation_id
    FROM workqueue.delivery d
    JOIN workqueue.subscription s ON s.id = d.subscription_id
    JOIN workqueue.message m ON m.id = d.message_id
    WHERE s.name = p_subscription AND d.status = p_status AND d.id > coalesce(p_after_id, 0)
    ORDER BY d.id
    LIMIT p_limit
$$;

-- Keys of an Exclusive or Ordered subscription with live work. condition: InFlight (a delivery
-- of the key is running), Blocked (Ordered: the head is dead-lettered, or waiting to be retried),
-- Idle (waiting work, nothing running, not blocked).
CREATE OR REPLACE FUNCTION workqueue.partitions(p_subscription text, p_condition text, p_limit integer)
RETURNS TABLE (
    partition_key text, condition text, head_delivery_id bigint, head_status text,
    head_attempt integer, head_visible_at timestamptz, waiting_items bigint
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH s AS (
        SELECT s.id, s.partition_mode FROM workqueue.subscription s WHERE s.name = p_subscription
    ), k AS (
        SELECT p.partition_key,
               CASE WHEN p.holder_id IS NOT NULL THEN 'InFlight'
                    WHEN p.blocked_id IS NOT NULL THEN 'Blocked'
                    WHEN s.partition_mode = 'Ordered' AND h.attempt > 0 AND p.next_visible_at > now() THEN 'Blocked'
                    ELSE 'Idle' END AS condition,
               coalesce(p.holder_id, p.blocked_id, p.next_id) AS head_id
        FROM workqueue.partition p
        JOIN s ON s.id = p.subscription_id
        LEFT JOIN workqueue.delivery h ON h.id = coalesce(p.holder_id, p.blocked_id, p.next_id)
    )
    SELECT k.partition_key, k.condition, k.head_id, h.status, h.attempt, h.visible_at,
           (SELECT count(*) FROM workqueue.delivery w, s
            WHERE w.subscription_id = s.id AND w.partition_key = k.partition_key
              AND w.status = 'Pending' AND w.id <> k.head_id)
    FROM k
    LEFT JOIN workqueue.delivery h ON h.id = k.head_id
    WHERE p_condition IS NULL OR k.condition = p_condition
    ORDER BY k.partition_key
    LIMIT p_limit
$$;
