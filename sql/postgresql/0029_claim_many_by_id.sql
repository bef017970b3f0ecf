-- fastapi-workqueue: PostgreSQL, version 29: claim_many reads the claim index once.
--
-- claim_many (0025) read the named subscriptions twice (one look for a keyed one, one join for the
-- active ones), read each subscription's claim index once to find its share of the oldest due
-- deliveries, then again to lock that share. A job worker calls it on every claim (the job queues'
-- group consumer takes every job queue at once), and it cost the server a third more than claim per
-- delivery. Backend CPU per delivery claimed, claims committed one at a time from a client until
-- 12,000 of a queue of 20,000 were taken, five empty queues beside it, medians of five runs on a
-- busy machine: in claims of 80, claim 21-23 µs, claim_many 32-33; of 12, claim 44, claim_many 57.
-- It now reads the subscriptions once, takes the oldest due deliveries of them all from the
-- indexes and locks those by id SKIP LOCKED: 23-26 µs in claims of 80, 50 in claims of 12 (in a
-- worker: bench/jobs_attempt.py). Only when another claimer holds some of them (or took them
-- meanwhile) does it go back to an index: the skipped ones' share of each subscription, locked past
-- the rows others hold, as before, so a claim under contention still takes as many as there are.
-- What a claim answers, in which order, and the refusal of keyed subscriptions are unchanged; the
-- function keeps its settings (0026) and its grants.

-- Claims up to p_limit visible deliveries across several None-mode subscriptions, the oldest due
-- first (visible_at, then id) whatever their subscription, each leased for its own
-- subscription's lease_seconds and answered with that subscription's name. Paused subscriptions
-- (or topics) and unknown names give nothing; an Exclusive or Ordered one is refused (claim takes
-- those). One read of the named subscriptions finds both. Each active subscription's claim index
-- gives at most p_limit candidates; the first p_limit of them all are locked by id SKIP LOCKED.
-- Those another claimer holds (or took meanwhile) are made up from their subscriptions' indexes:
-- each such subscription's share, locked past the rows other claimers hold as claim locks, so
-- concurrent claimers take different deliveries and none comes back short while work waits.
-- Commits as a claim without keys does (synchronous_commit off, 0017).
CREATE OR REPLACE FUNCTION workqueue.claim_many(p_subscriptions text[], p_limit integer)
RETURNS TABLE (
    subscription text, delivery_id bigint, lease_token uuid, attempt integer, max_attempts integer,
    lease_expires_at timestamptz, message_id uuid, topic text, partition_key text,
    attributes jsonb, payload text, payload_ref text, correlation_id text,
    published_at timestamptz
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_has_keyed boolean;
    v_keyed text;
    v_active integer[];
    v_candidates bigint[];
    v_candidate_sids integer[];
    v_sids integer[];
    v_shares integer[];
    v_ids bigint[];
    v_more bigint[];
BEGIN
    IF p_limit < 1 OR coalesce(cardinality(p_subscriptions), 0) = 0 THEN
        RETURN;
    END IF;
    SELECT bool_or(s.partition_mode <> 'None'),
           array_agg(s.id) FILTER (WHERE s.status = 'Active' AND t.status = 'Active')
    INTO v_has_keyed, v_active
    FROM workqueue.subscription s JOIN workqueue.topic t ON t.name = s.topic
    WHERE s.name = ANY (p_subscriptions);
    IF v_has_keyed THEN
        SELECT format('%s is %s', s.name, s.partition_mode) INTO v_keyed
        FROM workqueue.subscription s
        WHERE s.name = ANY (p_subscriptions) AND s.partition_mode <> 'None'
        ORDER BY s.name
        LIMIT 1;
        RAISE EXCEPTION 'claim_many takes None-mode subscriptions only (%); claim an Exclusive or Ordered subscription with claim',
            v_keyed USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_active IS NULL THEN
        RETURN;
    END IF;

    -- The p_limit oldest due deliveries of them all.
    SELECT array_agg(c.id), array_agg(c.sid) INTO v_candidates, v_candidate_sids
    FROM (
        SELECT d.id, a.sid
        FROM unnest(v_active) AS a(sid)
        CROSS JOIN LATERAL (
            SELECT d.id, d.visible_at FROM workqueue.delivery d
            WHERE d.subscription_id = a.sid AND d.status = 'Pending' AND d.key_mode = 0
              AND d.visible_at <= now()
            ORDER BY d.visible_at, d.id
            LIMIT p_limit
        ) d
        ORDER BY d.visible_at, d.id
        LIMIT p_limit
    ) c;
    IF v_candidates IS NULL THEN
        RETURN;
    END IF;

    -- Locked by id; what another claimer holds is skipped (and rechecked once locked).
    SELECT array_agg(l.id) INTO v_ids
    FROM (
        SELECT d.id FROM workqueue.delivery d
        WHERE d.id = ANY (v_candidates) AND d.status = 'Pending' AND d.key_mode = 0
          AND d.visible_at <= now()
        FOR UPDATE SKIP LOCKED
    ) l;
    v_ids := coalesce(v_ids, '{}'::bigint[]);

    IF cardinality(v_ids) < cardinality(v_candidates) THEN
        -- The skipped ones' shares, locked from their subscriptions' indexes past the rows other
        -- claimers hold (and those this claim holds already).
        SELECT array_agg(x.sid), array_agg(x.n) INTO v_sids, v_shares
        FROM (
            SELECT c.sid, count(*)::integer AS n
            FROM unnest(v_candidates, v_candidate_sids) AS c(id, sid)
            WHERE c.id <> ALL (v_ids)
            GROUP BY c.sid
        ) x;
        SELECT array_agg(l.id) INTO v_more
        FROM unnest(v_sids, v_shares) AS k(sid, n)
        CROSS JOIN LATERAL (
            SELECT d.id FROM workqueue.delivery d
            WHERE d.subscription_id = k.sid AND d.status = 'Pending' AND d.key_mode = 0
              AND d.visible_at <= now() AND d.id <> ALL (v_ids)
            ORDER BY d.visible_at, d.id
            LIMIT k.n
            FOR UPDATE SKIP LOCKED
        ) l;
        v_ids := v_ids || coalesce(v_more, '{}'::bigint[]);
    END IF;
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
    -- As claim on a subscription without keys: a claim lost in a crash leaves its deliveries Pending.
    PERFORM set_config('synchronous_commit', 'off', true);

    RETURN QUERY
    WITH d AS (
        UPDATE workqueue.delivery d
        SET status = 'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
            lease_token = gen_random_uuid(),
            lease_expires_at = now() + make_interval(secs => s.lease_seconds),
            claimed_at = now(), progress_percent = NULL, progress_message = NULL
        FROM workqueue.subscription s
        WHERE d.id = ANY (v_ids) AND d.status = 'Pending' AND s.id = d.subscription_id
        RETURNING s.name, d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at,
                  d.message_id, d.visible_at
    )
    SELECT d.name, d.id, d.lease_token, d.attempt, d.max_attempts, d.lease_expires_at, m.id, m.topic,
           m.partition_key, m.attributes, m.payload, m.payload_ref, m.correlation_id, m.published_at
    FROM d JOIN workqueue.message m ON m.id = d.message_id
    ORDER BY d.visible_at, d.id;
END
$$;
