-- fastapi-workqueue: PostgreSQL, version 25: what the jobs layer needs from the store.
--
-- The jobs layer (fastapi_workqueue/jobs) maps a job queue onto a topic and a None-mode
-- subscription, and a job onto a message (the job id is its MessageID). It needs:
--   * a Discard outcome of settle: a handler that finds its work no longer wanted ends the
--     delivery Discarded with its reason, never retried, its key freed as a completion frees it,
--     counted as Discarded in settled_count (0022). A cancel-requested delivery is Discarded as
--     before, keeping the operator's reason;
--   * release_deduplication_key: frees a unique job's key once the job that holds it is done,
--     and leaves alone a key that a later message holds;
--   * durable step results (step_result, step_get, step_put): one row per message and step, the
--     first write wins. The foreign key to message (ON DELETE CASCADE) removes a message's steps
--     when the retention purge removes the message, so purge itself is unchanged;
--   * claim_many: one claim across several None-mode subscriptions (a worker of several job
--     queues), the oldest due delivery first whatever its subscription. It reads each
--     subscription's claim index (delivery_claim) for at most the limit, merges those candidates,
--     and locks each subscription's share SKIP LOCKED from the same index, as claim does: it never
--     sorts the backlog, and concurrent claimers take different deliveries;
--   * known_messages and message_deliveries: which MessageIDs the store has (a schedule's ticks)
--     and every delivery of one message (a job's state);
--   * discard_dead_letters: discards a subscription's dead letters settled before a time, in
--     bounded batches (pruning failed jobs), counted in settled_count;
--   * rewrite_payload: replaces a message's payload (re-encryption with a new key) while no
--     delivery of it runs or has ended Completed or Discarded.
--
-- Replaces settle (0022), with the same name, parameters and results. The new functions are
-- granted to workqueue_runtime and workqueue_operator where those roles exist already, as an
-- upgrade gives them (roles/ says which role holds which).

-- ---------------------------------------------------------------------------------------------
-- Settle: the Discard outcome
-- ---------------------------------------------------------------------------------------------

-- Settles InFlight deliveries that still carry the given tokens: Complete, Retry or Fail (Pending
-- after backoff, DeadLettered on the last attempt), DeadLetter, Discard (Discarded with the
-- reason, never retried), Release (Pending, the attempt not spent). A cancel-requested delivery
-- becomes Discarded whatever the outcome; a stale token changes nothing (LeaseLost). p_draws are
-- the caller's jitter draws. The batch's terminal settles are counted in settled_count and its
-- keys handed over by release_keys.
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
                 WHEN l.outcome = 'Discard' THEN 'Discarded'
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
        RETURNING d.id, d.status, d.key_mode, d.subscription_id
    ), counted AS (
        -- The batch's terminal settles, one row per subscription (settled_count).
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, count(*) FILTER (WHERE u.status = 'Completed'),
               count(*) FILTER (WHERE u.status = 'Discarded')
        FROM u
        WHERE u.status IN ('Completed', 'Discarded')
        GROUP BY u.subscription_id
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

-- ---------------------------------------------------------------------------------------------
-- Deduplication keys: a unique job frees its key
-- ---------------------------------------------------------------------------------------------

-- Frees a topic's deduplication key if the given message holds it; true when it held it live (a
-- key of that message that had expired already goes too, and answers false).
CREATE OR REPLACE FUNCTION workqueue.release_deduplication_key(p_topic text, p_key text, p_message_id uuid)
RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH d AS (
        DELETE FROM workqueue.deduplication dd
        WHERE dd.topic = p_topic AND dd.deduplication_key = p_key AND dd.message_id = p_message_id
        RETURNING dd.expires_at
    )
    SELECT coalesce(bool_or(d.expires_at > now()), false) FROM d
$$;

-- ---------------------------------------------------------------------------------------------
-- Durable step results
-- ---------------------------------------------------------------------------------------------

-- The stored JSON result of each named step of a message's work. Removed with the message.
CREATE TABLE workqueue.step_result (
    message_id  uuid NOT NULL REFERENCES workqueue.message (id) ON DELETE CASCADE,
    name        text NOT NULL,
    value       text NOT NULL,              -- JSON text, kept as sent
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (message_id, name)
);

-- The stored result of one step (no row when none is stored).
CREATE OR REPLACE FUNCTION workqueue.step_get(p_message_id uuid, p_name text)
RETURNS TABLE (value text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT r.value FROM workqueue.step_result r WHERE r.message_id = p_message_id AND r.name = p_name
$$;

-- Stores the result of one step; the first write wins (a second put keeps the first value). The
-- message must be stored.
CREATE OR REPLACE FUNCTION workqueue.step_put(p_message_id uuid, p_name text, p_value text)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO workqueue.step_result (message_id, name, value)
    VALUES (p_message_id, p_name, p_value)
    ON CONFLICT (message_id, name) DO NOTHING;
EXCEPTION WHEN foreign_key_violation THEN
    RAISE EXCEPTION 'message % is not stored (never published, or purged): a step result belongs to a stored message',
        p_message_id USING ERRCODE = 'foreign_key_violation';
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Claim across several None-mode subscriptions
-- ---------------------------------------------------------------------------------------------

-- Claims up to p_limit visible deliveries across several None-mode subscriptions, the oldest due
-- first (visible_at, then id) whatever their subscription, each leased for its own
-- subscription's lease_seconds and answered with that subscription's name. Paused subscriptions
-- (or topics) and unknown names give nothing; an Exclusive or Ordered one is refused (claim takes
-- those). Each subscription's claim index gives at most p_limit candidates; the first p_limit of
-- them all set each subscription's share, which is locked from the same index SKIP LOCKED, as
-- claim locks, so concurrent claimers take different deliveries. Commits as a claim without
-- keys does (synchronous_commit off, 0017).
CREATE OR REPLACE FUNCTION workqueue.claim_many(p_subscriptions text[], p_limit integer)
RETURNS TABLE (
    subscription text, delivery_id bigint, lease_token uuid, attempt integer, max_attempts integer,
    lease_expires_at timestamptz, message_id uuid, topic text, partition_key text,
    attributes jsonb, payload text, payload_ref text, correlation_id text,
    published_at timestamptz
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_keyed text;
    v_sids integer[];
    v_shares integer[];
    v_ids bigint[];
BEGIN
    IF p_limit < 1 OR coalesce(cardinality(p_subscriptions), 0) = 0 THEN
        RETURN;
    END IF;
    SELECT format('%s is %s', s.name, s.partition_mode) INTO v_keyed
    FROM workqueue.subscription s
    WHERE s.name = ANY (p_subscriptions) AND s.partition_mode <> 'None'
    ORDER BY s.name
    LIMIT 1;
    IF v_keyed IS NOT NULL THEN
        RAISE EXCEPTION 'claim_many takes None-mode subscriptions only (%); claim an Exclusive or Ordered subscription with claim',
            v_keyed USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- Each subscription's share of the p_limit oldest due deliveries of them all.
    SELECT array_agg(x.sid), array_agg(x.n) INTO v_sids, v_shares
    FROM (
        SELECT c.sid, count(*)::integer AS n
        FROM (
            SELECT s.id AS sid
            FROM workqueue.subscription s
            JOIN workqueue.topic t ON t.name = s.topic
            CROSS JOIN LATERAL (
                SELECT d.id, d.visible_at FROM workqueue.delivery d
                WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
                  AND d.visible_at <= now()
                ORDER BY d.visible_at, d.id
                LIMIT p_limit
            ) d
            WHERE s.name = ANY (p_subscriptions) AND s.status = 'Active' AND t.status = 'Active'
            ORDER BY d.visible_at, d.id
            LIMIT p_limit
        ) c
        GROUP BY c.sid
    ) x;
    IF v_sids IS NULL THEN
        RETURN;
    END IF;

    -- Each share, locked from its subscription's index past the rows other claimers hold.
    SELECT array_agg(l.id) INTO v_ids
    FROM unnest(v_sids, v_shares) AS k(sid, n)
    CROSS JOIN LATERAL (
        SELECT d.id FROM workqueue.delivery d
        WHERE d.subscription_id = k.sid AND d.status = 'Pending' AND d.key_mode = 0
          AND d.visible_at <= now()
        ORDER BY d.visible_at, d.id
        LIMIT k.n
        FOR UPDATE SKIP LOCKED
    ) l;
    IF v_ids IS NULL THEN
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

-- ---------------------------------------------------------------------------------------------
-- Messages and their deliveries
-- ---------------------------------------------------------------------------------------------

-- Which of the given MessageIDs the store has.
CREATE OR REPLACE FUNCTION workqueue.known_messages(p_ids uuid[])
RETURNS TABLE (message_id uuid)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m.id FROM workqueue.message m WHERE m.id = ANY (p_ids)
$$;

-- Every delivery of one message, each with its subscription, as get_delivery answers, by id.
CREATE OR REPLACE FUNCTION workqueue.message_deliveries(p_message_id uuid)
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
    WHERE d.message_id = p_message_id
    ORDER BY d.id
$$;

-- ---------------------------------------------------------------------------------------------
-- Operator actions: pruning dead letters, rewriting a payload
-- ---------------------------------------------------------------------------------------------

-- Discards up to p_limit DeadLettered deliveries of a subscription settled before
-- p_settled_before (reason 'pruned'), oldest id first, counted in settled_count, their keys
-- handed over as a settle hands them; returns how many it discarded. A dead letter another
-- transaction holds (a replay) is skipped.
CREATE OR REPLACE FUNCTION workqueue.discard_dead_letters(
    p_subscription text, p_settled_before timestamptz, p_limit integer
) RETURNS integer
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
        SET status = 'Discarded', reason = 'pruned', settled_at = now(), lease_token = NULL,
            lease_expires_at = NULL
        WHERE d.id IN (
            SELECT x.id FROM workqueue.delivery x
            JOIN workqueue.subscription s ON s.id = x.subscription_id
            WHERE s.name = p_subscription AND x.status = 'DeadLettered' AND x.settled_at < p_settled_before
            ORDER BY x.id
            LIMIT p_limit
            FOR UPDATE OF x SKIP LOCKED
        )
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

-- Replaces a stored message's payload and content hash (re-encryption with a new key) while none
-- of its deliveries is InFlight or ended Completed or Discarded; true when it rewrote, false when
-- the message is not stored or a delivery forbids it. Its deliveries are locked first, so none is
-- claimed meanwhile. An envelope over the topic's cap is refused.
CREATE OR REPLACE FUNCTION workqueue.rewrite_payload(
    p_message_id uuid, p_payload text, p_content_hash text, p_envelope_bytes integer
) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_topic text;
    v_cap integer;
    v_settled boolean;
BEGIN
    SELECT m.topic, t.max_payload_bytes INTO v_topic, v_cap
    FROM workqueue.message m LEFT JOIN workqueue.topic t ON t.name = m.topic
    WHERE m.id = p_message_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_cap IS NOT NULL AND p_envelope_bytes > v_cap THEN
        RAISE EXCEPTION 'the rewritten envelope is % bytes; topic % accepts at most % bytes (max_payload_bytes)',
            p_envelope_bytes, quote_literal(v_topic), v_cap USING ERRCODE = 'program_limit_exceeded';
    END IF;
    SELECT coalesce(bool_or(x.status IN ('InFlight', 'Completed', 'Discarded')), false) INTO v_settled
    FROM (SELECT d.status FROM workqueue.delivery d WHERE d.message_id = p_message_id ORDER BY d.id FOR UPDATE) x;
    IF v_settled THEN
        RETURN false;
    END IF;
    UPDATE workqueue.message m SET payload = p_payload, content_hash = p_content_hash
    WHERE m.id = p_message_id;
    RETURN FOUND;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Privileges
-- ---------------------------------------------------------------------------------------------

REVOKE ALL ON FUNCTION workqueue.release_deduplication_key(text, text, uuid), workqueue.step_get(uuid, text),
                       workqueue.step_put(uuid, text, text), workqueue.claim_many(text[], integer),
                       workqueue.known_messages(uuid[]), workqueue.message_deliveries(uuid),
                       workqueue.discard_dead_letters(text, timestamptz, integer),
                       workqueue.rewrite_payload(uuid, text, text, integer)
    FROM PUBLIC;

-- A database whose roles were set up before this version can call what is theirs now.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.release_deduplication_key(text, text, uuid),
                                  workqueue.step_get(uuid, text), workqueue.step_put(uuid, text, text),
                                  workqueue.claim_many(text[], integer), workqueue.known_messages(uuid[]),
                                  workqueue.message_deliveries(uuid)
            TO workqueue_runtime;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_operator') THEN
        GRANT EXECUTE ON FUNCTION workqueue.discard_dead_letters(text, timestamptz, integer),
                                  workqueue.rewrite_payload(uuid, text, text, integer),
                                  workqueue.message_deliveries(uuid)
            TO workqueue_operator;
    END IF;
END
$$;
