-- fastapi-workqueue: PostgreSQL, version 36: a subscription or a topic can be retired, then deleted.
--
-- A subscription removed from the code stayed in the store, kept getting a delivery of every
-- message and, with no handler left, kept its hosts' health at 503. Now:
--   * a subscription can be retired (retired_at, set by retire_subscription): publish, publish_one
--     and publish_one_quiet give it no delivery, while claim and claim_many still take what it
--     holds (it drains); discard_pending discards its Pending deliveries on request; listings and
--     stats show it Retired; resume (set_subscription_status 'Active') takes it back;
--   * a topic can be retired (set_topic_status 'Retired'): publish refuses new messages with
--     TopicRetired, and its subscriptions drain;
--   * delete_subscription and delete_topic remove what is retired and empty, and refuse otherwise,
--     saying what is left.
-- Retired is a column of its own, not a value of status: a retired subscription keeps its Active
-- or Paused state, which is what claims read.

ALTER TABLE workqueue.topic ADD COLUMN retired_at timestamptz;
ALTER TABLE workqueue.subscription ADD COLUMN retired_at timestamptz;

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
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_n integer := coalesce(cardinality(p_message_ids), 0);
    v_cap integer;
    v_plain boolean;
    v_has_dedup boolean;
    v_too_large boolean;
    v_status text[];
    v_ids uuid[];
    v_accept boolean[];
    v_inserted uuid[];
    v_failed integer;
    v_failed_code text;
    v_accepted integer;
    v_count integer;
    v_notify integer[];
    v_key record;
    v_visible timestamptz;
    v_all boolean;
    v_first bigint[];
    v_retired boolean;
BEGIN
    IF v_n = 0 THEN
        RETURN;
    END IF;
    IF v_n = 1 AND p_deduplication_keys IS NULL THEN  -- plain expressions: no query to decide
        -- One message, the most common call: two plain statements instead of 0010's one with
        -- CTEs, which costs less to run. The message INSERT carries the guard of 0010; the
        -- deliveries go to the topic's subscriptions without keys (the guard saw no other kind:
        -- a keyed subscription saved in between gets none, as if saved after this call, and
        -- never a delivery without its key's bookkeeping).
        INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                            correlation_id, deduplication_key, content_hash)
        SELECT p_message_ids[1], p_topic, p_partition_keys[1], coalesce(p_attributes[1], '{}'::jsonb),
               p_payloads[1], p_payload_refs[1], p_correlation_ids[1], NULL, p_content_hashes[1]
        FROM workqueue.topic t
        WHERE t.name = p_topic AND t.retired_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM workqueue.subscription s
                          WHERE s.topic = t.name AND s.partition_mode <> 'None' AND s.retired_at IS NULL)
          AND (t.max_payload_bytes IS NULL OR p_envelope_bytes[1] <= t.max_payload_bytes)
        ON CONFLICT (id) DO NOTHING;
        IF FOUND THEN
            v_visible := CASE WHEN p_not_befores IS NULL AND p_delays IS NULL THEN now()
                              ELSE greatest(now(), coalesce(p_not_befores[1],
                                                            now() + make_interval(secs => coalesce(p_delays[1], 0)))) END;
            INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
                max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at)
            SELECT s.id, p_message_ids[1], p_partition_keys[1], 0,
                   coalesce(p_max_attempts[1], s.max_attempts), s.backoff_base_seconds, s.backoff_max_seconds,
                   CASE WHEN p_backoff_schedules[1] IS NULL THEN NULL
                        ELSE ARRAY(SELECT b::double precision FROM jsonb_array_elements_text(p_backoff_schedules[1]::jsonb) AS b) END,
                   v_visible
            FROM workqueue.subscription s
            WHERE s.topic = p_topic AND s.partition_mode = 'None' AND s.retired_at IS NULL
              AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes[1]))
            ORDER BY s.id;
            IF v_visible <= now() THEN
                PERFORM pg_notify('workqueue', s.id::text)
                FROM workqueue.subscription s
                WHERE s.topic = p_topic AND s.partition_mode = 'None' AND s.retired_at IS NULL
                  AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes[1]));
            END IF;
            RETURN;  -- no rows: Accepted
        END IF;
        -- Not written: the guard failed or the MessageID is stored already; the paths below
        -- tell which and answer.
    ELSIF p_deduplication_keys IS NULL THEN
        -- The common case: the same checks as 0010's statement, then the messages, then their
        -- deliveries and the wake-ups. The messages go in with a plain INSERT, which costs
        -- markedly less per row than ON CONFLICT; a MessageID that is stored already (or given
        -- twice in the call) makes it fail as a whole, and the INSERT runs again with ON
        -- CONFLICT, so that what follows can tell Duplicate from MessageIDConflict as before.
        -- (The block is a subtransaction: one per call of many messages, none for one message.)
        SELECT true INTO v_plain
        FROM workqueue.topic t
        WHERE t.name = p_topic AND t.retired_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM workqueue.subscription s
                          WHERE s.topic = t.name AND s.partition_mode <> 'None' AND s.retired_at IS NULL)
          AND (t.max_payload_bytes IS NULL
               OR NOT EXISTS (SELECT 1 FROM unnest(p_envelope_bytes) b WHERE b > t.max_payload_bytes));
        IF v_plain THEN
            BEGIN
                INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                                    correlation_id, deduplication_key, content_hash)
                SELECT x.mid, p_topic, x.pkey, coalesce(x.attrs, '{}'::jsonb), x.payload, x.ref, x.corr, NULL, x.hash
                FROM unnest(p_message_ids, p_partition_keys, p_attributes, p_payloads, p_payload_refs,
                            p_correlation_ids, p_content_hashes)
                     WITH ORDINALITY AS x(mid, pkey, attrs, payload, ref, corr, hash, i)
                ORDER BY x.i;
                v_inserted := p_message_ids;
            EXCEPTION WHEN unique_violation THEN
                WITH ins AS (
                    INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                                        correlation_id, deduplication_key, content_hash)
                    SELECT x.mid, p_topic, x.pkey, coalesce(x.attrs, '{}'::jsonb), x.payload, x.ref, x.corr, NULL, x.hash
                    FROM unnest(p_message_ids, p_partition_keys, p_attributes, p_payloads, p_payload_refs,
                                p_correlation_ids, p_content_hashes)
                         WITH ORDINALITY AS x(mid, pkey, attrs, payload, ref, corr, hash, i)
                    ORDER BY x.i
                    ON CONFLICT (id) DO NOTHING
                    RETURNING m.id
                )
                SELECT array_agg(ins.id) INTO v_inserted FROM ins;
                -- A MessageID given more than once gets its deliveries from its first item only.
                SELECT array_agg(k.i) INTO v_first
                FROM (SELECT min(x.i) AS i FROM unnest(p_message_ids) WITH ORDINALITY AS x(mid, i)
                      WHERE x.mid = ANY (v_inserted) GROUP BY x.mid) k;
            END;
            v_all := coalesce(cardinality(v_inserted), 0) = v_n;
            -- Deliveries to the subscriptions without keys (the check saw no other kind; see the
            -- path of one message above).
            WITH new_delivery AS (
                INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
                    max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at)
                SELECT s.id, x.mid, x.pkey, 0,
                       coalesce(x.max_attempts, s.max_attempts), s.backoff_base_seconds, s.backoff_max_seconds,
                       CASE WHEN x.backoff IS NULL THEN NULL
                            ELSE ARRAY(SELECT b::double precision FROM jsonb_array_elements_text(x.backoff::jsonb) AS b) END,
                       greatest(now(), coalesce(x.not_before, now() + make_interval(secs => coalesce(x.delay, 0))))
                FROM unnest(p_message_ids, p_partition_keys, p_attributes, p_max_attempts, p_backoff_schedules,
                            p_not_befores, p_delays)
                     WITH ORDINALITY AS x(mid, pkey, attrs, max_attempts, backoff, not_before, delay, i)
                JOIN workqueue.subscription s ON s.topic = p_topic AND s.partition_mode = 'None' AND s.retired_at IS NULL
                WHERE (v_all OR x.i = ANY (v_first))
                  AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, x.attrs))
                ORDER BY x.i, s.id
                RETURNING subscription_id, visible_at
            )
            SELECT count(pg_notify('workqueue', w.sid::text)) INTO v_count
            FROM (SELECT DISTINCT nd.subscription_id AS sid FROM new_delivery nd WHERE nd.visible_at <= now()) w;
            IF v_all THEN
                RETURN;  -- no rows: every item was Accepted (the caller knows their MessageIDs)
            END IF;
            -- Some items repeat a stored message (or an earlier item of the call): Duplicate when
            -- the content is the same, else the call is refused and what it wrote is taken back.
            WITH item AS (
                SELECT x.i::integer AS i, x.mid, x.hash,
                       min(x.i) OVER (PARTITION BY x.mid) AS first_by_id
                FROM unnest(p_message_ids, p_content_hashes) WITH ORDINALITY AS x(mid, hash, i)
            ), classified AS (
                SELECT it.i, it.mid,
                       CASE WHEN it.first_by_id = it.i AND it.mid = ANY (v_inserted) THEN 'Accepted'
                            WHEN s.content_hash = it.hash THEN 'Duplicate'
                            ELSE 'MessageIDConflict' END AS st
                FROM item it
                LEFT JOIN workqueue.message s ON s.id = it.mid AND s.id = ANY (p_message_ids)
            )
            SELECT array_agg(c.st ORDER BY c.i), array_agg(c.mid ORDER BY c.i),
                   min(c.i) FILTER (WHERE c.st = 'MessageIDConflict')
            INTO v_status, v_ids, v_failed
            FROM classified c;
            IF v_failed IS NOT NULL THEN
                DELETE FROM workqueue.delivery d WHERE d.message_id = ANY (v_inserted);
                DELETE FROM workqueue.message m WHERE m.id = ANY (v_inserted);
                RETURN QUERY
                SELECT x.i::integer,
                       CASE WHEN x.st = 'MessageIDConflict' THEN x.st ELSE 'Rejected' END,
                       x.mid,
                       CASE WHEN x.st = 'MessageIDConflict' THEN x.st ELSE 'BatchAborted' END,
                       CASE WHEN x.st = 'MessageIDConflict'
                            THEN 'a message with this MessageID and different content was already published; use a new MessageID for new content'
                            ELSE format('not published: item %s of this call was refused (MessageIDConflict) and a publish call is all-or-nothing',
                                        v_failed - 1) END
                FROM unnest(v_status, v_ids) WITH ORDINALITY AS x(st, mid, i);
                RETURN;
            END IF;
            RETURN QUERY SELECT x.i::integer, x.st, x.mid, NULL::text, NULL::text
            FROM unnest(v_status, v_ids) WITH ORDINALITY AS x(st, mid, i);
            RETURN;
        END IF;
        -- The guard failed, so nothing was written: an unknown topic, a keyed subscription, or an
        -- item over the topic's cap. The paths below tell which and answer.
    END IF;
    SELECT t.max_payload_bytes,
           EXISTS (SELECT 1 FROM unnest(p_deduplication_keys) k WHERE k IS NOT NULL),
           t.max_payload_bytes IS NOT NULL AND EXISTS (SELECT 1 FROM unnest(p_envelope_bytes) b WHERE b > t.max_payload_bytes),
           t.retired_at IS NOT NULL
    INTO v_cap, v_has_dedup, v_too_large, v_retired
    FROM workqueue.topic t WHERE t.name = p_topic;
    IF NOT FOUND THEN
        RETURN QUERY SELECT i::integer, 'Rejected'::text, m, 'UnknownTopic'::text,
            format('topic %L does not exist; declare it in the WorkQueue topics or create it first', p_topic)
        FROM unnest(p_message_ids) WITH ORDINALITY AS x(m, i);
        RETURN;
    END IF;
    IF v_retired THEN
        RETURN QUERY SELECT i::integer, 'Rejected'::text, m, 'TopicRetired'::text,
            format('topic %L is retired and takes no new messages; publish to the topic that replaced it, '
                   'or take it back with `workqueue topics resume %s`', p_topic, p_topic)
        FROM unnest(p_message_ids) WITH ORDINALITY AS x(m, i);
        RETURN;
    END IF;


    IF NOT v_has_dedup AND NOT v_too_large THEN
        -- Fast path: write, then look at the items that clashed with a stored message.
        WITH ins AS (
            INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                                correlation_id, deduplication_key, content_hash)
            SELECT x.mid, p_topic, x.pkey, coalesce(x.attrs, '{}'::jsonb), x.payload, x.ref, x.corr, NULL, x.hash
            FROM unnest(p_message_ids, p_partition_keys, p_attributes, p_payloads, p_payload_refs,
                        p_correlation_ids, p_content_hashes)
                 WITH ORDINALITY AS x(mid, pkey, attrs, payload, ref, corr, hash, i)
            ORDER BY x.i
            ON CONFLICT (id) DO NOTHING
            RETURNING m.id
        )
        SELECT array_agg(ins.id) INTO v_inserted FROM ins;
        v_count := coalesce(cardinality(v_inserted), 0);

        IF v_count = v_n THEN
            v_status := array_fill('Accepted'::text, ARRAY[v_n]);
            v_ids := p_message_ids;
            v_accept := array_fill(true, ARRAY[v_n]);
        ELSE
            -- An item is accepted when this call inserted it and it is the first with its id; the
            -- others repeat a stored message (or an earlier item): same content, Duplicate.
            WITH item AS (
                SELECT x.i::integer AS i, x.mid, x.hash,
                       min(x.i) OVER (PARTITION BY x.mid) AS first_by_id
                FROM unnest(p_message_ids, p_content_hashes) WITH ORDINALITY AS x(mid, hash, i)
            ), classified AS (
                SELECT it.i, it.mid,
                       CASE WHEN it.first_by_id = it.i AND it.mid = ANY (v_inserted) THEN 'Accepted'
                            WHEN s.content_hash = it.hash THEN 'Duplicate'
                            ELSE 'MessageIDConflict' END AS st
                FROM item it
                LEFT JOIN workqueue.message s ON s.id = it.mid AND s.id = ANY (p_message_ids)
            )
            SELECT array_agg(c.st ORDER BY c.i), array_agg(c.mid ORDER BY c.i),
                   array_agg(c.st = 'Accepted' ORDER BY c.i),
                   min(c.i) FILTER (WHERE c.st = 'MessageIDConflict')
            INTO v_status, v_ids, v_accept, v_failed
            FROM classified c;
            IF v_failed IS NOT NULL THEN
                DELETE FROM workqueue.message m WHERE m.id = ANY (v_inserted);
                RETURN QUERY
                SELECT x.i::integer,
                       CASE WHEN x.st = 'MessageIDConflict' THEN x.st ELSE 'Rejected' END,
                       x.mid,
                       CASE WHEN x.st = 'MessageIDConflict' THEN x.st ELSE 'BatchAborted' END,
                       CASE WHEN x.st = 'MessageIDConflict'
                            THEN 'a message with this MessageID and different content was already published; use a new MessageID for new content'
                            ELSE format('not published: item %s of this call was refused (MessageIDConflict) and a publish call is all-or-nothing',
                                        v_failed - 1) END
                FROM unnest(v_status, v_ids) WITH ORDINALITY AS x(st, mid, i);
                RETURN;
            END IF;
        END IF;
        v_accepted := v_count;
    ELSE
        -- Classify every item before writing anything: refused (too large), a repeat of an earlier
        -- item or of a stored message (Duplicate or MessageIDConflict), a live deduplication key.
        WITH item AS (
            SELECT x.i::integer AS i, x.mid, x.hash, x.dkey, x.bytes,
                   min(x.i) OVER (PARTITION BY x.mid) AS first_by_id,
                   first_value(x.hash) OVER (PARTITION BY x.mid ORDER BY x.i) AS first_hash,
                   CASE WHEN x.dkey IS NULL THEN NULL ELSE min(x.i) OVER (PARTITION BY x.dkey) END AS first_by_dkey,
                   first_value(x.mid) OVER (PARTITION BY x.dkey ORDER BY x.i) AS first_mid_by_dkey
            FROM unnest(p_message_ids, p_content_hashes, p_deduplication_keys, p_envelope_bytes)
                 WITH ORDINALITY AS x(mid, hash, dkey, bytes, i)
        ), stored AS (
            SELECT m.id, m.content_hash FROM workqueue.message m WHERE m.id = ANY (p_message_ids)
        ), live_key AS (
            SELECT dd.deduplication_key, dd.message_id FROM workqueue.deduplication dd
            WHERE v_has_dedup AND dd.topic = p_topic AND dd.deduplication_key = ANY (p_deduplication_keys)
              AND dd.expires_at > now()
        ), classified AS (
            SELECT it.i,
                CASE
                    WHEN v_cap IS NOT NULL AND it.bytes > v_cap THEN 'Rejected'
                    WHEN it.first_by_id < it.i AND it.first_hash = it.hash THEN 'Duplicate'
                    WHEN it.first_by_id < it.i THEN 'MessageIDConflict'
                    WHEN s.id IS NOT NULL AND s.content_hash = it.hash THEN 'Duplicate'
                    WHEN s.id IS NOT NULL THEN 'MessageIDConflict'
                    WHEN lk.message_id IS NOT NULL THEN 'Duplicate'
                    WHEN it.first_by_dkey < it.i THEN 'Duplicate'
                    ELSE 'Accepted'
                END AS st,
                CASE
                    WHEN v_cap IS NOT NULL AND it.bytes > v_cap THEN it.mid
                    WHEN it.first_by_id < it.i OR s.id IS NOT NULL THEN it.mid
                    WHEN lk.message_id IS NOT NULL THEN lk.message_id
                    WHEN it.first_by_dkey < it.i THEN it.first_mid_by_dkey
                    ELSE it.mid
                END AS result_id
            FROM item it
            LEFT JOIN stored s ON s.id = it.mid
            LEFT JOIN live_key lk ON lk.deduplication_key = it.dkey
        )
        SELECT array_agg(c.st ORDER BY c.i), array_agg(c.result_id ORDER BY c.i),
               array_agg(c.st = 'Accepted' ORDER BY c.i),
               min(c.i) FILTER (WHERE c.st IN ('Rejected', 'MessageIDConflict')),
               count(*) FILTER (WHERE c.st = 'Accepted')
        INTO v_status, v_ids, v_accept, v_failed, v_accepted
        FROM classified c;

        IF v_failed IS NOT NULL THEN
            v_failed_code := CASE v_status[v_failed] WHEN 'Rejected' THEN 'EnvelopeTooLarge' ELSE 'MessageIDConflict' END;
            RETURN QUERY
            SELECT x.i::integer,
                CASE WHEN x.st IN ('Rejected', 'MessageIDConflict') THEN x.st ELSE 'Rejected' END,
                x.mid,
                CASE x.st WHEN 'Rejected' THEN 'EnvelopeTooLarge' WHEN 'MessageIDConflict' THEN 'MessageIDConflict'
                          ELSE 'BatchAborted' END,
                CASE x.st
                    WHEN 'Rejected' THEN format('the envelope is %s bytes; topic %L accepts at most %s bytes (max_payload_bytes); send a PayloadRef to the data instead',
                                                x.bytes, p_topic, v_cap)
                    WHEN 'MessageIDConflict' THEN 'a message with this MessageID and different content was already published; use a new MessageID for new content'
                    ELSE format('not published: item %s of this call was refused (%s) and a publish call is all-or-nothing',
                                v_failed - 1, v_failed_code) END
            FROM unnest(v_status, v_ids, p_envelope_bytes) WITH ORDINALITY AS x(st, mid, bytes, i);
            RETURN;
        END IF;

        IF v_accepted > 0 THEN
            INSERT INTO workqueue.message AS m (id, topic, partition_key, attributes, payload, payload_ref,
                                                correlation_id, deduplication_key, content_hash)
            SELECT x.mid, p_topic, x.pkey, coalesce(x.attrs, '{}'::jsonb), x.payload, x.ref, x.corr, x.dkey, x.hash
            FROM unnest(v_accept, p_message_ids, p_partition_keys, p_attributes, p_payloads, p_payload_refs,
                        p_correlation_ids, p_deduplication_keys, p_content_hashes)
                 WITH ORDINALITY AS x(ok, mid, pkey, attrs, payload, ref, corr, dkey, hash, i)
            WHERE x.ok
            ORDER BY x.i
            ON CONFLICT (id) DO NOTHING;
            GET DIAGNOSTICS v_count = ROW_COUNT;
            IF v_count <> v_accepted THEN
                RAISE EXCEPTION 'a message with the same MessageID was published concurrently; retry the publish'
                    USING ERRCODE = 'serialization_failure';
            END IF;

            INSERT INTO workqueue.deduplication AS dd (topic, deduplication_key, message_id, expires_at)
            SELECT p_topic, x.dkey, x.mid, now() + make_interval(secs => coalesce(x.ttl, 300))
            FROM unnest(v_accept, p_deduplication_keys, p_message_ids, p_deduplication_ttls) AS x(ok, dkey, mid, ttl)
            WHERE x.ok AND x.dkey IS NOT NULL
            ORDER BY x.dkey
            ON CONFLICT (topic, deduplication_key) DO UPDATE
            SET message_id = EXCLUDED.message_id, expires_at = EXCLUDED.expires_at
            WHERE dd.expires_at <= now();
            GET DIAGNOSTICS v_count = ROW_COUNT;
            IF v_count <> (SELECT count(*) FROM unnest(v_accept, p_deduplication_keys) AS x(ok, dkey)
                           WHERE x.ok AND x.dkey IS NOT NULL) THEN
                RAISE EXCEPTION 'a message with the same DeduplicationKey was published concurrently; retry the publish'
                    USING ERRCODE = 'serialization_failure';
            END IF;
        END IF;
    END IF;

    IF v_accepted > 0 THEN
        -- One statement reads the subscriptions once and does all of it: it computes each
        -- delivery's key mode from its subscription's partition mode as that statement sees it,
        -- locks (creating where needed) the key of every keyed delivery, in key order, and inserts
        -- the deliveries; a keyed delivery is only formed from its key's locked row, so its id is
        -- taken after the lock: ids follow commit order within a key. Nothing is decided by an
        -- earlier statement, which saw the subscriptions as they were before this call waited.
        FOR v_key IN
            WITH target AS MATERIALIZED (
                SELECT x.i, s.id AS sid, x.mid, x.pkey,
                       (CASE WHEN x.pkey IS NULL OR s.partition_mode = 'None' THEN 0
                             WHEN s.partition_mode = 'Exclusive' THEN 1 ELSE 2 END)::smallint AS key_mode,
                       coalesce(x.max_attempts, s.max_attempts) AS max_attempts,
                       s.backoff_base_seconds, s.backoff_max_seconds,
                       CASE WHEN x.backoff IS NULL THEN NULL
                            ELSE ARRAY(SELECT b::double precision FROM jsonb_array_elements_text(x.backoff::jsonb) AS b) END
                           AS backoff_schedule,
                       greatest(now(), coalesce(x.not_before, now() + make_interval(secs => coalesce(x.delay, 0))))
                           AS visible_at
                FROM unnest(v_accept, p_message_ids, p_partition_keys, p_attributes, p_max_attempts,
                            p_backoff_schedules, p_not_befores, p_delays)
                     WITH ORDINALITY AS x(ok, mid, pkey, attrs, max_attempts, backoff, not_before, delay, i)
                JOIN workqueue.subscription s ON s.topic = p_topic AND s.retired_at IS NULL
                WHERE x.ok AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, x.attrs))
            ), locked AS (
                INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
                SELECT DISTINCT t.sid, t.pkey FROM target t WHERE t.key_mode > 0
                ORDER BY 1, 2
                ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id
                RETURNING p.subscription_id, p.partition_key
            ), new_delivery AS (
                INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
                    max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at)
                SELECT t.sid, t.mid, t.pkey, t.key_mode, t.max_attempts, t.backoff_base_seconds,
                       t.backoff_max_seconds, t.backoff_schedule, t.visible_at
                FROM target t
                LEFT JOIN locked l ON l.subscription_id = t.sid AND l.partition_key = t.pkey
                WHERE t.key_mode = 0 OR l.subscription_id IS NOT NULL
                ORDER BY t.i, t.sid
                RETURNING id, subscription_id, partition_key, key_mode, visible_at
            )
            -- One row per subscription with immediately visible unkeyed work (to notify), and one
            -- per key that got work: its first new delivery (Ordered) or its earliest (Exclusive).
            SELECT DISTINCT ON (nd.subscription_id, nd.partition_key)
                   nd.subscription_id, nd.partition_key, nd.key_mode, nd.id, nd.visible_at
            FROM new_delivery nd
            WHERE nd.key_mode > 0 OR nd.visible_at <= now()
            ORDER BY nd.subscription_id, nd.partition_key, nd.key_mode DESC,
                     CASE WHEN nd.key_mode = 1 THEN nd.visible_at END, nd.id
        LOOP
            IF v_key.key_mode = 0 THEN
                v_notify := array_append(v_notify, v_key.subscription_id);
                CONTINUE;
            END IF;
            -- The key's row is this transaction's since the statement above.
            UPDATE workqueue.partition p
            SET next_id = v_key.id, next_visible_at = v_key.visible_at
            WHERE p.subscription_id = v_key.subscription_id AND p.partition_key = v_key.partition_key
              AND p.holder_id IS NULL
              AND ((v_key.key_mode = 2 AND p.next_id IS NULL AND p.blocked_id IS NULL)
                   OR (v_key.key_mode = 1 AND (p.next_id IS NULL OR v_key.visible_at < p.next_visible_at)));
            IF FOUND AND v_key.visible_at <= now() THEN
                v_notify := array_append(v_notify, v_key.subscription_id);
            END IF;
        END LOOP;

        IF v_notify IS NOT NULL THEN
            PERFORM pg_notify('workqueue', sid::text) FROM (SELECT DISTINCT unnest(v_notify) AS sid) x;
        END IF;
    END IF;

    RETURN QUERY SELECT x.i::integer, x.st, x.mid, NULL::text, NULL::text
    FROM unnest(v_status, v_ids) WITH ORDINALITY AS x(st, mid, i);
END
$$;

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
    WHERE t.name = p_topic AND t.retired_at IS NULL
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
        WHERE s.topic = p_topic AND s.retired_at IS NULL
          AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, p_attributes))
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
           s.heartbeat_mode, s.filter, CASE WHEN s.status = 'Active' AND s.retired_at IS NOT NULL THEN 'Retired' ELSE s.status END, s.host_type,
           s.retention_seconds, CASE WHEN t.status = 'Active' AND t.retired_at IS NOT NULL THEN 'Retired' ELSE t.status END, t.transport,
           t.is_fifo, t.max_payload_bytes
    FROM workqueue.subscription s
    JOIN workqueue.topic t ON t.name = s.topic
    ORDER BY s.name
$$;

CREATE OR REPLACE FUNCTION workqueue.list_topics()
RETURNS TABLE (name text, transport text, max_payload_bytes integer, is_fifo boolean, status text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT t.name, t.transport, t.max_payload_bytes, t.is_fifo,
           CASE WHEN t.status = 'Active' AND t.retired_at IS NOT NULL THEN 'Retired' ELSE t.status END
    FROM workqueue.topic t ORDER BY t.name
$$;

CREATE OR REPLACE FUNCTION workqueue.stats(p_subscription text DEFAULT NULL)
RETURNS TABLE (
    subscription text, topic text, subscription_status text, partition_mode text,
    pending bigint, claimable bigint, in_flight bigint, dead_lettered bigint, completed bigint,
    discarded bigint, oldest_pending_at timestamptz
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- Each count reads the rows of its state through a partial index: Pending in three parts (by
    -- key mode, the indexes claims use), InFlight, DeadLettered. Completed and Discarded, the
    -- states history accumulates in, are the sums of settled_count.
    SELECT s.name, s.topic, CASE WHEN s.status = 'Active' AND s.retired_at IS NOT NULL THEN 'Retired' ELSE s.status END, s.partition_mode,
           p.pending, coalesce(cl.claimable, 0), f.in_flight, dl.dead_lettered,
           coalesce(t.completed, 0)::bigint, coalesce(t.discarded, 0)::bigint, p.oldest_pending_at
    FROM workqueue.subscription s
    LEFT JOIN (
        SELECT c.subscription_id, sum(c.completed) AS completed, sum(c.discarded) AS discarded
        FROM workqueue.settled_count c
        GROUP BY c.subscription_id
    ) t ON t.subscription_id = s.id
    CROSS JOIN LATERAL (
        SELECT count(*) AS pending, min(w.created_at) AS oldest_pending_at
        FROM (
            SELECT d.created_at FROM workqueue.delivery d
            WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
            UNION ALL
            SELECT d.created_at FROM workqueue.delivery d
            WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 1
            UNION ALL
            SELECT d.created_at FROM workqueue.delivery d
            WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 2
        ) w
    ) p
    CROSS JOIN LATERAL (
        SELECT count(*) AS in_flight FROM workqueue.delivery d
        WHERE d.subscription_id = s.id AND d.status = 'InFlight'
    ) f
    CROSS JOIN LATERAL (
        SELECT count(*) AS dead_lettered FROM workqueue.delivery d
        WHERE d.subscription_id = s.id AND d.status = 'DeadLettered'
    ) dl
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
    IF p_status = 'Active' THEN  -- resume takes back a retired subscription too
        SELECT CASE WHEN s.retired_at IS NOT NULL AND s.status = 'Active' THEN 'Retired' ELSE s.status END
        INTO v_old FROM workqueue.subscription s WHERE s.name = p_name;
    END IF;
    UPDATE workqueue.subscription s
    SET status = p_status, retired_at = CASE WHEN p_status = 'Active' THEN NULL ELSE s.retired_at END,
        updated_at = now()
    WHERE s.name = p_name AND (s.status <> p_status OR (p_status = 'Active' AND s.retired_at IS NOT NULL));
    IF p_status = 'Active' AND v_old <> 'Active' THEN
        PERFORM pg_notify('workqueue', (SELECT s.id::text FROM workqueue.subscription s WHERE s.name = p_name));
    END IF;
    RETURN QUERY SELECT p_name, p_status, v_old <> p_status;
END
$$;

-- Retires a subscription (retired_at): publish gives it no new delivery from the commit on, while
-- what it holds still drains (claims go on: its status stays Active, or Paused) and its counts stay
-- readable; listings show it Retired. resume (set_subscription_status 'Active') takes it back.
-- changed is false when it was retired already.
CREATE OR REPLACE FUNCTION workqueue.retire_subscription(p_name text)
RETURNS TABLE (subscription text, status text, changed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_old text;
BEGIN
    SELECT CASE WHEN s.retired_at IS NOT NULL THEN 'Retired' ELSE s.status END INTO v_old
    FROM workqueue.subscription s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE workqueue.subscription s SET retired_at = now(), updated_at = now()
    WHERE s.name = p_name AND s.retired_at IS NULL;
    RETURN QUERY SELECT p_name, 'Retired'::text, v_old <> 'Retired';
END
$$;

-- Discards up to p_limit Pending deliveries of a subscription (visible or waiting out a delay or a
-- backoff), oldest id first, with p_reason, counted in settled_count, their keys handed over as a
-- settle hands them; returns how many it discarded. One another transaction holds (a claim) is
-- skipped: it is InFlight, and drains.
CREATE OR REPLACE FUNCTION workqueue.discard_pending(p_subscription text, p_reason text, p_limit integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_ids bigint[];
    v_count integer;
    v_keyed boolean;
BEGIN
    WITH u AS (
        UPDATE workqueue.delivery d
        SET status = 'Discarded', reason = p_reason, settled_at = now(), lease_token = NULL,
            lease_expires_at = NULL
        WHERE d.id IN (
            SELECT x.id FROM workqueue.delivery x
            JOIN workqueue.subscription s ON s.id = x.subscription_id
            WHERE s.name = p_subscription AND x.status = 'Pending'
            ORDER BY x.id
            LIMIT p_limit
            FOR UPDATE OF x SKIP LOCKED
        ) AND d.status = 'Pending'
        RETURNING d.id, d.subscription_id, d.key_mode
    ), counted AS (
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, 0, count(*)
        FROM u
        GROUP BY u.subscription_id
    )
    SELECT array_agg(u.id), count(*), bool_or(u.key_mode > 0) INTO v_ids, v_count, v_keyed
    FROM u;
    IF v_keyed THEN
        PERFORM pg_notify('workqueue', r.subscription_id::text) FROM workqueue.release_keys(v_ids) r;
    END IF;
    RETURN v_count;
END
$$;

-- Deletes a retired subscription with its ended deliveries, keys, counts and history. result:
-- Deleted, NotFound, NotRetired (retire it first), or HasDeliveries (remaining says how many are
-- still Pending, InFlight or DeadLettered: drain, discard or replay them first).
CREATE OR REPLACE FUNCTION workqueue.delete_subscription(p_name text)
RETURNS TABLE (subscription text, result text, remaining bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_id integer;
    v_retired timestamptz;
    v_live bigint;
BEGIN
    SELECT s.id, s.retired_at INTO v_id, v_retired FROM workqueue.subscription s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT p_name, 'NotFound'::text, 0::bigint;
        RETURN;
    END IF;
    IF v_retired IS NULL THEN
        RETURN QUERY SELECT p_name, 'NotRetired'::text, 0::bigint;
        RETURN;
    END IF;
    SELECT count(*) INTO v_live FROM workqueue.delivery d
    WHERE d.subscription_id = v_id AND d.status IN ('Pending', 'InFlight', 'DeadLettered');
    IF v_live > 0 THEN
        RETURN QUERY SELECT p_name, 'HasDeliveries'::text, v_live;
        RETURN;
    END IF;
    DELETE FROM workqueue.delivery d WHERE d.subscription_id = v_id;
    DELETE FROM workqueue.partition p WHERE p.subscription_id = v_id;
    DELETE FROM workqueue.partition_stale p WHERE p.subscription_id = v_id;
    DELETE FROM workqueue.settled_count c WHERE c.subscription_id = v_id;
    DELETE FROM workqueue.stats_history h WHERE h.subscription_id = v_id;
    DELETE FROM workqueue.subscription s WHERE s.id = v_id;
    RETURN QUERY SELECT p_name, 'Deleted'::text, 0::bigint;
END
$$;

-- Retires (p_status 'Retired': retired_at), pauses ('Paused') or takes back ('Active': active and
-- not retired) a topic. A retired topic refuses new messages (TopicRetired) while its
-- subscriptions drain what they hold.
CREATE OR REPLACE FUNCTION workqueue.set_topic_status(p_name text, p_status text)
RETURNS TABLE (topic text, status text, changed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_old text;
BEGIN
    SELECT CASE WHEN t.status = 'Active' AND t.retired_at IS NOT NULL THEN 'Retired' ELSE t.status END
    INTO v_old FROM workqueue.topic t WHERE t.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_status NOT IN ('Active', 'Paused', 'Retired') THEN
        RAISE EXCEPTION 'a topic''s status is Active, Paused or Retired, not %', p_status
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE workqueue.topic t
    SET status = CASE WHEN p_status = 'Retired' THEN t.status ELSE p_status END,
        retired_at = CASE WHEN p_status = 'Retired' THEN coalesce(t.retired_at, now())
                          WHEN p_status = 'Active' THEN NULL ELSE t.retired_at END,
        updated_at = now()
    WHERE t.name = p_name;
    RETURN QUERY SELECT p_name, p_status, v_old <> p_status;
END
$$;

-- Deletes a retired topic that no subscription names any more (delete them first). result:
-- Deleted, NotFound, NotRetired, or HasSubscriptions (remaining says how many).
CREATE OR REPLACE FUNCTION workqueue.delete_topic(p_name text)
RETURNS TABLE (topic text, result text, remaining bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_retired timestamptz;
    v_subscriptions bigint;
BEGIN
    SELECT t.retired_at INTO v_retired FROM workqueue.topic t WHERE t.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT p_name, 'NotFound'::text, 0::bigint;
        RETURN;
    END IF;
    IF v_retired IS NULL THEN
        RETURN QUERY SELECT p_name, 'NotRetired'::text, 0::bigint;
        RETURN;
    END IF;
    SELECT count(*) INTO v_subscriptions FROM workqueue.subscription s WHERE s.topic = p_name;
    IF v_subscriptions > 0 THEN
        RETURN QUERY SELECT p_name, 'HasSubscriptions'::text, v_subscriptions;
        RETURN;
    END IF;
    DELETE FROM workqueue.deduplication dd WHERE dd.topic = p_name;
    DELETE FROM workqueue.topic t WHERE t.name = p_name;
    RETURN QUERY SELECT p_name, 'Deleted'::text, 0::bigint;
END
$$;

REVOKE ALL ON FUNCTION workqueue.retire_subscription(text), workqueue.discard_pending(text, text, integer),
    workqueue.delete_subscription(text), workqueue.set_topic_status(text, text), workqueue.delete_topic(text)
    FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_operator') THEN
        GRANT EXECUTE ON FUNCTION workqueue.retire_subscription(text), workqueue.discard_pending(text, text, integer),
            workqueue.set_topic_status(text, text) TO workqueue_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_admin') THEN
        GRANT EXECUTE ON FUNCTION workqueue.delete_subscription(text), workqueue.delete_topic(text) TO workqueue_admin;
    END IF;
END
$$;
