-- fastapi-workqueue: PostgreSQL, version 4: plans that stay cheap as tables grow, and once markers.
--
-- Replaces publish, claim, heartbeat, settle and expire_leases of 0002 (same names, parameters and
-- results). Inside a function a statement runs with a cached generic plan, which cannot see the
-- size of an array or a LIMIT parameter; joins against unnest() or a LIMIT $n CTE were then
-- planned as hash joins over whole tables, a cost that grew with the backlog. Every hot statement
-- now reaches its rows through an index condition (id = ANY(array), a primary key), whatever the
-- estimates. Arrays are walked once with a multi-argument unnest() instead of subscripted per row.
--
-- Also: a Release may carry a delay (used when context.once() finds its key busy), and the once
-- markers behind context.once().

-- ---------------------------------------------------------------------------------------------
-- Publish
-- ---------------------------------------------------------------------------------------------

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
    v_cap integer;
    v_has_keyed boolean;
    v_has_dedup boolean := EXISTS (SELECT 1 FROM unnest(p_deduplication_keys) k WHERE k IS NOT NULL);
    v_status text[];
    v_ids uuid[];
    v_accept boolean[];
    v_failed integer;
    v_failed_code text;
    v_accepted integer;
    v_inserted integer;
    v_notify integer[];
    v_key record;
BEGIN
    IF v_n = 0 THEN
        RETURN;
    END IF;
    SELECT t.max_payload_bytes,
           EXISTS (SELECT 1 FROM workqueue.subscription s WHERE s.topic = t.name AND s.partition_mode <> 'None')
    INTO v_cap, v_has_keyed
    FROM workqueue.topic t WHERE t.name = p_topic;
    IF NOT FOUND THEN
        RETURN QUERY SELECT i::integer, 'Rejected'::text, m, 'UnknownTopic'::text,
            format('topic %L does not exist; declare it in the WorkQueue topics or create it first', p_topic)
        FROM unnest(p_message_ids) WITH ORDINALITY AS x(m, i);
        RETURN;
    END IF;

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
        GET DIAGNOSTICS v_inserted = ROW_COUNT;
        IF v_inserted <> v_accepted THEN
            RAISE EXCEPTION 'a message with the same MessageID was published concurrently; retry the publish'
                USING ERRCODE = 'serialization_failure';
        END IF;

        IF v_has_dedup THEN
            INSERT INTO workqueue.deduplication AS dd (topic, deduplication_key, message_id, expires_at)
            SELECT p_topic, x.dkey, x.mid, now() + make_interval(secs => coalesce(x.ttl, 300))
            FROM unnest(v_accept, p_deduplication_keys, p_message_ids, p_deduplication_ttls) AS x(ok, dkey, mid, ttl)
            WHERE x.ok AND x.dkey IS NOT NULL
            ORDER BY x.dkey
            ON CONFLICT (topic, deduplication_key) DO UPDATE
            SET message_id = EXCLUDED.message_id, expires_at = EXCLUDED.expires_at
            WHERE dd.expires_at <= now();
            GET DIAGNOSTICS v_inserted = ROW_COUNT;
            IF v_inserted <> (SELECT count(*) FROM unnest(v_accept, p_deduplication_keys) AS x(ok, dkey)
                              WHERE x.ok AND x.dkey IS NOT NULL) THEN
                RAISE EXCEPTION 'a message with the same DeduplicationKey was published concurrently; retry the publish'
                    USING ERRCODE = 'serialization_failure';
            END IF;
        END IF;

        IF v_has_keyed THEN
            -- Lock (creating where needed) the keys of Exclusive and Ordered subscriptions, in key
            -- order, before any delivery gets its id: ids then follow commit order within a key.
            INSERT INTO workqueue.partition AS p (subscription_id, partition_key)
            SELECT DISTINCT s.id, x.pkey
            FROM unnest(v_accept, p_partition_keys, p_attributes) AS x(ok, pkey, attrs)
            JOIN workqueue.subscription s ON s.topic = p_topic AND s.partition_mode <> 'None'
            WHERE x.ok AND x.pkey IS NOT NULL
              AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, x.attrs))
            ORDER BY 1, 2
            ON CONFLICT (subscription_id, partition_key) DO UPDATE SET holder_id = p.holder_id;
        END IF;

        FOR v_key IN
            WITH new_delivery AS (
                INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
                    max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at)
                SELECT s.id, x.mid, x.pkey,
                       CASE WHEN x.pkey IS NULL OR s.partition_mode = 'None' THEN 0
                            WHEN s.partition_mode = 'Exclusive' THEN 1 ELSE 2 END,
                       coalesce(x.max_attempts, s.max_attempts), s.backoff_base_seconds, s.backoff_max_seconds,
                       CASE WHEN x.backoff IS NULL THEN NULL
                            ELSE ARRAY(SELECT b::double precision FROM jsonb_array_elements_text(x.backoff::jsonb) AS b) END,
                       greatest(now(), coalesce(x.not_before, now() + make_interval(secs => coalesce(x.delay, 0))))
                FROM unnest(v_accept, p_message_ids, p_partition_keys, p_attributes, p_max_attempts,
                            p_backoff_schedules, p_not_befores, p_delays)
                     WITH ORDINALITY AS x(ok, mid, pkey, attrs, max_attempts, backoff, not_before, delay, i)
                JOIN workqueue.subscription s ON s.topic = p_topic
                WHERE x.ok AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, x.attrs))
                ORDER BY x.i, s.id
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

-- ---------------------------------------------------------------------------------------------
-- Claim
-- ---------------------------------------------------------------------------------------------

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

-- ---------------------------------------------------------------------------------------------
-- Heartbeat
-- ---------------------------------------------------------------------------------------------

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
        WHERE d.id = ANY (p_ids) AND d.id = i.id AND d.lease_token = i.token AND d.status = 'InFlight'
          AND s.id = d.subscription_id
        RETURNING d.id, d.cancel_requested, d.lease_expires_at
    )
    SELECT i.id, u.id IS NOT NULL AND NOT u.cancel_requested, coalesce(u.cancel_requested, false),
           u.lease_expires_at
    FROM i LEFT JOIN u ON u.id = i.id
$$;

-- ---------------------------------------------------------------------------------------------
-- Settle
-- ---------------------------------------------------------------------------------------------

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
    v_keyed boolean;
    v_key record;
    v_notify integer[];
BEGIN
    WITH i AS (
        SELECT * FROM unnest(p_ids, p_tokens, p_outcomes, p_delays, p_reasons, p_errors)
                 AS t(id, token, outcome, delay, reason, error)
    ), locked AS (
        SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds,
               d.backoff_max_seconds, d.backoff_schedule
        FROM workqueue.delivery d
        WHERE d.id = ANY (p_ids) AND d.status = 'InFlight' AND d.lease_token = ANY (p_tokens)
        ORDER BY d.id
        FOR UPDATE
    ), plan AS (
        SELECT l.*, i.outcome, i.delay, i.reason, i.error,
            CASE WHEN l.cancel_requested THEN 'Discarded'
                 WHEN i.outcome = 'Complete' THEN 'Completed'
                 WHEN i.outcome = 'Release' THEN 'Pending'
                 WHEN i.outcome = 'DeadLetter' THEN 'DeadLettered'
                 WHEN l.attempt >= l.max_attempts THEN 'DeadLettered'
                 ELSE 'Pending' END AS new_status
        FROM locked l JOIN i ON i.id = l.id AND i.token = l.lease_token
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
        WHERE d.id = ANY (p_ids) AND d.id = pl.id
        RETURNING d.id, d.status, d.key_mode
    )
    SELECT array_agg(u.id), array_agg(u.status), bool_or(u.key_mode > 0)
    INTO v_ids, v_results, v_keyed
    FROM u;

    IF v_keyed THEN
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
    END IF;

    RETURN QUERY
    SELECT i.id, coalesce(x.result, 'LeaseLost')
    FROM unnest(p_ids) AS i(id)
    LEFT JOIN unnest(v_ids, v_results) AS x(id, result) ON x.id = i.id;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Lease expiry
-- ---------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION workqueue.expire_leases(p_limit integer)
RETURNS TABLE (delivery_id bigint, result text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_expired bigint[];
    v_ids bigint[];
    v_results text[];
    v_key record;
    v_notify integer[];
BEGIN
    SELECT array_agg(e.id) INTO v_expired
    FROM (
        SELECT d.id FROM workqueue.delivery d
        WHERE d.status = 'InFlight' AND d.lease_expires_at < now()
        ORDER BY d.lease_expires_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ) e;
    IF v_expired IS NULL THEN
        RETURN;
    END IF;

    WITH u AS (
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
        WHERE d.id = ANY (v_expired)
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

-- ---------------------------------------------------------------------------------------------
-- Once markers: context.once(key, fn) runs fn unless it already succeeded for the key
-- ---------------------------------------------------------------------------------------------

CREATE TABLE workqueue.once_marker (
    key         text PRIMARY KEY,
    state       text NOT NULL CHECK (state IN ('Running', 'Done')),
    token       uuid,
    expires_at  timestamptz NOT NULL
);
CREATE INDEX once_marker_expires_at ON workqueue.once_marker (expires_at);

-- Run: the caller holds the key for p_running_seconds and must finish or abort it. Done: it ran
-- already (within its TTL). Busy: another attempt is running it now.
CREATE OR REPLACE FUNCTION workqueue.once_begin(p_key text, p_running_seconds double precision)
RETURNS TABLE (state text, token uuid)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_token uuid := gen_random_uuid();
    v_state text;
BEGIN
    INSERT INTO workqueue.once_marker AS o (key, state, token, expires_at)
    VALUES (p_key, 'Running', v_token, now() + make_interval(secs => p_running_seconds))
    ON CONFLICT (key) DO UPDATE
    SET state = 'Running', token = v_token, expires_at = EXCLUDED.expires_at
    WHERE o.expires_at <= now();
    IF FOUND THEN
        RETURN QUERY SELECT 'Run'::text, v_token;
        RETURN;
    END IF;
    SELECT o.state INTO v_state FROM workqueue.once_marker o WHERE o.key = p_key;
    RETURN QUERY SELECT CASE WHEN v_state = 'Done' THEN 'Done' ELSE 'Busy' END, NULL::uuid;
END
$$;

CREATE OR REPLACE FUNCTION workqueue.once_finish(p_key text, p_token uuid, p_ttl_seconds double precision)
RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH u AS (
        UPDATE workqueue.once_marker o
        SET state = 'Done', token = NULL, expires_at = now() + make_interval(secs => p_ttl_seconds)
        WHERE o.key = p_key AND o.token = p_token
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM u)
$$;

CREATE OR REPLACE FUNCTION workqueue.once_abort(p_key text, p_token uuid)
RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH d AS (
        DELETE FROM workqueue.once_marker o WHERE o.key = p_key AND o.token = p_token RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM d)
$$;

-- The sweeper also drops expired once markers (same results as before; markers are not counted).
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
    DELETE FROM workqueue.once_marker o
    WHERE o.key IN (SELECT x.key FROM workqueue.once_marker x WHERE x.expires_at <= now()
                    ORDER BY x.expires_at LIMIT p_limit);
    RETURN QUERY SELECT true, v_retried, v_dead, v_discarded, v_purge.purged_deliveries,
                        v_purge.purged_messages, v_purge.purged_deduplication;
END
$$;
