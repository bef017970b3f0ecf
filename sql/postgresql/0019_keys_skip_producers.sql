-- fastapi-workqueue: PostgreSQL, version 19: settles and sweeps never wait for a producer.
--
-- A publish locks the partition row of each key it writes to (INSERT ... ON CONFLICT DO UPDATE,
-- on purpose: delivery ids then follow commit order within a key, which Ordered relies on) until
-- its caller commits. release_keys (0008), through which settle and expire_leases hand a key over
-- to its next delivery, locked the same rows FOR UPDATE: a request that published to a key and
-- then did slow work held up the settle batch that contained that key, every batch its process
-- wrote after it, and a sweeper pass (with the sweep lock held).
--
-- Replaces release_keys of 0008, claim of 0017, purge of 0013 and sweep of 0004 (same names,
-- parameters and results), and adds the table partition_stale and the function rederive_stale:
-- * release_keys locks the keys' rows FOR UPDATE SKIP LOCKED. The deliveries' own changes commit
--   at once as before; a key whose row another transaction holds is written to partition_stale
--   (a key to re-derive) and keeps its old row until then: its holder still names the settled
--   delivery, so nothing of the key is claimed meanwhile (single flight holds), and only its
--   hand-over waits for the producer.
-- * rederive_stale re-derives such keys where nobody holds them any more (SKIP LOCKED again):
--   the next claim of the subscription (after an index probe of the table, which is empty but
--   under contention), the next settle of a key of the subscription, and every sweeper pass call
--   it. After the producer commits, the key's next delivery is claimable without any other
--   publish: the next claim re-derives it.
-- * A marker is written with ON CONFLICT DO UPDATE ... WHERE false, which locks an existing row
--   without changing it, and rederive_stale takes the markers FOR UPDATE SKIP LOCKED and deletes
--   them before it re-derives: a marker that a settle writes while its key is being re-derived
--   waits for that re-derivation to commit and then stays, so no settle's hand-over is lost.
-- * purge takes the expired deduplication keys SKIP LOCKED (a producer taking an expired key over
--   holds its row until it commits), and sweep the expired once markers likewise.
--
-- replay and discard still wait for a producer of their own key: they change that key's work.

CREATE TABLE workqueue.partition_stale (
    subscription_id  integer NOT NULL,
    partition_key    text NOT NULL,
    key_mode         smallint NOT NULL,
    PRIMARY KEY (subscription_id, partition_key)
);

-- Re-derives (refresh_partition) up to p_limit keys marked stale, of the given subscriptions (all
-- when NULL), whose marker and partition row nobody else holds; returns the subscriptions that
-- got a key claimable now (once per key). A marker whose key has no row any more is dropped: a
-- producer that creates the row hands the key over itself.
CREATE OR REPLACE FUNCTION workqueue.rederive_stale(p_subscription_ids integer[], p_limit integer)
RETURNS TABLE (subscription_id integer)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_sids integer[];
    v_keys text[];
    v_modes smallint[];
    v_free_sids integer[];
    v_free_keys text[];
    v_key record;
BEGIN
    SELECT array_agg(m.subscription_id), array_agg(m.partition_key), array_agg(m.key_mode)
    INTO v_sids, v_keys, v_modes
    FROM (
        SELECT ps.subscription_id, ps.partition_key, ps.key_mode
        FROM workqueue.partition_stale ps
        WHERE p_subscription_ids IS NULL OR ps.subscription_id = ANY (p_subscription_ids)
        ORDER BY ps.subscription_id, ps.partition_key
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ) m;
    IF v_sids IS NULL THEN
        RETURN;
    END IF;

    SELECT array_agg(f.subscription_id), array_agg(f.partition_key) INTO v_free_sids, v_free_keys
    FROM (
        SELECT p.subscription_id, p.partition_key
        FROM workqueue.partition p
        JOIN unnest(v_sids, v_keys) AS k(sid, key) ON p.subscription_id = k.sid AND p.partition_key = k.key
        ORDER BY p.subscription_id, p.partition_key
        FOR UPDATE OF p SKIP LOCKED
    ) f;

    DELETE FROM workqueue.partition_stale ps
    USING unnest(v_sids, v_keys) AS k(sid, key)
    WHERE ps.subscription_id = k.sid AND ps.partition_key = k.key
      AND ((k.sid, k.key) IN (SELECT * FROM unnest(v_free_sids, v_free_keys))
           OR NOT EXISTS (SELECT 1 FROM workqueue.partition p
                          WHERE p.subscription_id = k.sid AND p.partition_key = k.key));

    FOR v_key IN
        SELECT k.sid, k.key, k.mode
        FROM unnest(v_sids, v_keys, v_modes) AS k(sid, key, mode)
        WHERE (k.sid, k.key) IN (SELECT * FROM unnest(v_free_sids, v_free_keys))
        ORDER BY k.sid, k.key
    LOOP
        IF workqueue.refresh_partition(v_key.sid, v_key.key, v_key.mode) THEN
            subscription_id := v_key.sid;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION workqueue.release_keys(p_ids bigint[])
RETURNS TABLE (subscription_id integer)   -- subscriptions with a key that can be claimed now
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_sids integer[];
    v_keys text[];
    v_modes smallint[];
    v_held_sids integer[];
    v_held_keys text[];
BEGIN
    SELECT array_agg(k.subscription_id ORDER BY k.subscription_id, k.partition_key),
           array_agg(k.partition_key ORDER BY k.subscription_id, k.partition_key),
           array_agg(k.key_mode ORDER BY k.subscription_id, k.partition_key)
    INTO v_sids, v_keys, v_modes
    FROM (SELECT DISTINCT d.subscription_id, d.partition_key, d.key_mode FROM workqueue.delivery d
          WHERE d.id = ANY (p_ids) AND d.key_mode > 0) k;
    IF v_sids IS NULL THEN
        RETURN;
    END IF;

    -- Lock the keys nobody else holds, in key order; the next statements then read their
    -- deliveries with a snapshot taken after every publish that touched them committed (a
    -- publish locks a key before its deliveries of that key get their ids).
    SELECT array_agg(h.subscription_id), array_agg(h.partition_key) INTO v_held_sids, v_held_keys
    FROM (
        SELECT p.subscription_id, p.partition_key
        FROM workqueue.partition p
        JOIN unnest(v_sids, v_keys) AS k(sid, key) ON p.subscription_id = k.sid AND p.partition_key = k.key
        ORDER BY p.subscription_id, p.partition_key
        FOR UPDATE OF p SKIP LOCKED
    ) h;

    IF coalesce(cardinality(v_held_keys), 0) < cardinality(v_keys) THEN
        -- The others are held (by a producer, most likely): re-derived later, by whoever locks
        -- them first. WHERE false: an existing marker is locked, not changed.
        INSERT INTO workqueue.partition_stale AS ps (subscription_id, partition_key, key_mode)
        SELECT k.sid, k.key, k.mode
        FROM unnest(v_sids, v_keys, v_modes) AS k(sid, key, mode)
        WHERE (k.sid, k.key) NOT IN (SELECT h.sid, h.key FROM unnest(v_held_sids, v_held_keys) AS h(sid, key)
                                     WHERE h.sid IS NOT NULL)
        ORDER BY k.sid, k.key
        ON CONFLICT (subscription_id, partition_key) DO UPDATE SET key_mode = EXCLUDED.key_mode WHERE false;
    END IF;

    IF v_held_keys IS NOT NULL THEN
        RETURN QUERY
        WITH k AS (
            SELECT k.sid AS subscription_id, k.key AS partition_key, k.mode AS key_mode
            FROM unnest(v_sids, v_keys, v_modes) AS k(sid, key, mode)
            WHERE (k.sid, k.key) IN (SELECT * FROM unnest(v_held_sids, v_held_keys))
        ), state AS (
            SELECT k.subscription_id, k.partition_key, k.key_mode,
                   o.id AS head_id, o.status AS head_status, o.visible_at AS head_visible_at,
                   e.id AS next_pending_id, e.visible_at AS next_pending_visible_at
            FROM k
            LEFT JOIN LATERAL (
                SELECT d.id, d.status, d.visible_at FROM workqueue.delivery d
                WHERE k.key_mode = 2 AND d.subscription_id = k.subscription_id AND d.partition_key = k.partition_key
                  AND d.key_mode = 2 AND d.status IN ('Pending', 'InFlight', 'DeadLettered')
                ORDER BY d.id
                LIMIT 1
            ) o ON true
            LEFT JOIN LATERAL (
                SELECT d.id, d.visible_at FROM workqueue.delivery d
                WHERE k.key_mode = 1 AND d.subscription_id = k.subscription_id AND d.partition_key = k.partition_key
                  AND d.key_mode = 1 AND d.status = 'Pending'
                ORDER BY d.visible_at, d.id
                LIMIT 1
            ) e ON true
        ), updated AS (
            UPDATE workqueue.partition p
            SET holder_id = n.holder_id, next_id = n.next_id, next_visible_at = n.next_visible_at,
                blocked_id = n.blocked_id
            FROM (
                SELECT s.subscription_id, s.partition_key, x.holder_id,
                       CASE WHEN x.holder_id IS NOT NULL THEN NULL
                            WHEN s.key_mode = 1 THEN s.next_pending_id
                            WHEN s.head_status = 'Pending' THEN s.head_id END AS next_id,
                       CASE WHEN x.holder_id IS NOT NULL THEN NULL
                            WHEN s.key_mode = 1 THEN s.next_pending_visible_at
                            WHEN s.head_status = 'Pending' THEN s.head_visible_at END AS next_visible_at,
                       CASE WHEN s.key_mode = 2 AND s.head_status = 'DeadLettered' THEN s.head_id END AS blocked_id
                FROM state s
                JOIN workqueue.partition cur
                  ON cur.subscription_id = s.subscription_id AND cur.partition_key = s.partition_key
                CROSS JOIN LATERAL (
                    SELECT CASE WHEN s.key_mode = 2 AND s.head_status = 'InFlight' THEN s.head_id
                                WHEN cur.holder_id = ANY (p_ids) THEN NULL
                                ELSE cur.holder_id END AS holder_id
                ) x
            ) n
            WHERE p.subscription_id = n.subscription_id AND p.partition_key = n.partition_key
            RETURNING p.subscription_id, p.partition_key, p.holder_id, p.next_id, p.next_visible_at, p.blocked_id
        )
        SELECT DISTINCT u.subscription_id FROM updated u
        WHERE u.holder_id IS NULL AND u.next_id IS NOT NULL AND u.next_visible_at <= now();

        -- Keys left with nothing lose their row (a statement of its own, as in 0008).
        DELETE FROM workqueue.partition p
        USING unnest(v_held_sids, v_held_keys) AS k(sid, key)
        WHERE p.subscription_id = k.sid AND p.partition_key = k.key
          AND p.holder_id IS NULL AND p.next_id IS NULL AND p.blocked_id IS NULL;
    END IF;

    -- The next settle of a subscription also re-derives its keys that earlier ones left stale.
    IF EXISTS (SELECT 1 FROM workqueue.partition_stale ps WHERE ps.subscription_id = ANY (v_sids)) THEN
        RETURN QUERY SELECT r.subscription_id
        FROM workqueue.rederive_stale(ARRAY(SELECT DISTINCT unnest(v_sids)), 100) r;
    END IF;
END
$$;

-- claim of 0017 with the stale keys of its subscription re-derived first.
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
        -- Keys a settle or the sweeper could not hand over (their producer held them) are
        -- re-derived first, where nobody holds them now; the table is empty but under contention.
        IF EXISTS (SELECT 1 FROM workqueue.partition_stale ps WHERE ps.subscription_id = v_sub.id) THEN
            PERFORM workqueue.rederive_stale(ARRAY[v_sub.id], p_limit);
        END IF;
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
        -- This transaction commits without waiting for its WAL to reach disk (see 0017): a claim
        -- lost in a crash of the server leaves its deliveries Pending.
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

-- purge of 0013 with the deduplication keys taken SKIP LOCKED.
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
        FOR UPDATE SKIP LOCKED  -- a producer taking the expired key over holds it until it commits
    );
    GET DIAGNOSTICS v_dedup = ROW_COUNT;

    RETURN QUERY SELECT v_deliveries, v_messages, v_dedup;
END
$$;

-- The sweeper also re-derives keys left stale (and notifies their subscriptions), and takes the
-- expired once markers SKIP LOCKED.
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
    PERFORM pg_notify('workqueue', r.sid::text)
    FROM (SELECT DISTINCT r.subscription_id AS sid FROM workqueue.rederive_stale(NULL, p_limit) r) r;
    SELECT * INTO v_purge FROM workqueue.purge(p_limit);
    DELETE FROM workqueue.once_marker o
    WHERE o.key IN (SELECT x.key FROM workqueue.once_marker x WHERE x.expires_at <= now()
                    ORDER BY x.expires_at LIMIT p_limit FOR UPDATE SKIP LOCKED);
    RETURN QUERY SELECT true, v_retried, v_dead, v_discarded, v_purge.purged_deliveries,
                        v_purge.purged_messages, v_purge.purged_deduplication;
END
$$;
