-- fastapi-workqueue: the SQLite statements, by name.
--
-- SQLite has no stored procedures: each queue operation (the same routines as PostgreSQL's
-- functions and SQL Server's procedures, with the same names) is a Python function in
-- fastapi_workqueue/database/sqlite_routines.py that runs these statements inside one
-- BEGIN IMMEDIATE transaction. Parameters are named (:name); times are epoch seconds.

-- name: topic_get
SELECT name, max_payload_bytes, status, retired_at FROM topic WHERE name = :name;

-- name: topic_insert
INSERT INTO topic (name, transport, max_payload_bytes, is_fifo, created_at, updated_at)
VALUES (:name, :transport, :max_payload_bytes, :is_fifo, :now, :now)
ON CONFLICT (name) DO UPDATE
SET max_payload_bytes = excluded.max_payload_bytes, is_fifo = excluded.is_fifo,
    transport = excluded.transport, updated_at = excluded.updated_at
WHERE (topic.max_payload_bytes IS NOT excluded.max_payload_bytes OR topic.is_fifo IS NOT excluded.is_fifo
       OR topic.transport IS NOT excluded.transport);

-- name: topic_list
SELECT t.name, t.transport, t.max_payload_bytes, t.is_fifo,
       CASE WHEN t.status = 'Active' AND t.retired_at IS NOT NULL THEN 'Retired' ELSE t.status END AS status
FROM topic t ORDER BY t.name;

-- name: subscription_get
SELECT * FROM subscription WHERE name = :name;

-- name: subscription_insert
INSERT INTO subscription (name, topic, handler_key, partition_mode, lease_seconds, max_attempts,
    backoff_base_seconds, backoff_max_seconds, max_processing_seconds, heartbeat_mode, filter, host_type,
    retention_seconds, status, created_at, updated_at, max_in_flight, key_concurrency, rate_limit, key_rate_limit)
VALUES (:name, :topic, :handler_key, :partition_mode, :lease_seconds, :max_attempts, :backoff_base_seconds,
    :backoff_max_seconds, :max_processing_seconds, :heartbeat_mode, :filter, :host_type, :retention_seconds,
    :status, :now, :now, :max_in_flight, :key_concurrency, :rate_limit, :key_rate_limit)
RETURNING id;

-- name: subscription_update
UPDATE subscription SET topic = :topic, handler_key = :handler_key, partition_mode = :partition_mode,
    lease_seconds = :lease_seconds, max_attempts = :max_attempts, backoff_base_seconds = :backoff_base_seconds,
    backoff_max_seconds = :backoff_max_seconds, max_processing_seconds = :max_processing_seconds,
    heartbeat_mode = :heartbeat_mode, filter = :filter, host_type = :host_type,
    retention_seconds = :retention_seconds, max_in_flight = :max_in_flight, key_concurrency = :key_concurrency,
    rate_limit = :rate_limit, key_rate_limit = :key_rate_limit, updated_at = :now
WHERE id = :id;

-- name: subscription_live_count
SELECT count(*) AS n FROM delivery
WHERE subscription_id = :id AND status IN ('Pending', 'InFlight', 'DeadLettered');

-- name: subscription_set_status
-- Resume (Active) takes back a retired subscription too.
UPDATE subscription
SET status = :status, retired_at = CASE WHEN :status = 'Active' THEN NULL ELSE retired_at END, updated_at = :now
WHERE name = :name AND (status <> :status OR (:status = 'Active' AND retired_at IS NOT NULL));

-- name: subscription_retire
-- A paused one is paused no more: it drains (and cannot be paused while retired).
UPDATE subscription SET retired_at = :now, status = 'Active', updated_at = :now WHERE name = :name AND retired_at IS NULL;

-- name: subscription_delete
DELETE FROM subscription WHERE id = :id;

-- name: subscription_deliveries_delete
DELETE FROM delivery WHERE subscription_id = :id;

-- name: subscription_keys_delete
DELETE FROM partition WHERE subscription_id = :id;

-- name: subscription_counts_delete
DELETE FROM settled_count WHERE subscription_id = :id;

-- name: subscription_history_delete
DELETE FROM stats_history WHERE subscription_id = :id;

-- name: subscription_buckets_delete
DELETE FROM rate_bucket WHERE subscription_id = :id;

-- name: pending_discard
-- Up to :limit Pending deliveries of a subscription, oldest id first (discard_pending).
UPDATE delivery SET status = 'Discarded', reason = :reason, settled_at = :now, lease_token = NULL,
                    lease_expires_at = NULL
WHERE id IN (
    SELECT id FROM delivery WHERE subscription_id = :subscription_id AND status = 'Pending'
    ORDER BY id LIMIT :limit)
RETURNING id, key_mode, partition_key;

-- name: topic_set_status
UPDATE topic
SET status = CASE WHEN :status = 'Retired' THEN status ELSE :status END,
    retired_at = CASE WHEN :status = 'Retired' THEN coalesce(retired_at, :now)
                      WHEN :status = 'Active' THEN NULL ELSE retired_at END,
    updated_at = :now
WHERE name = :name;

-- name: topic_subscription_count
SELECT count(*) AS n FROM subscription WHERE topic = :name;

-- name: topic_delete
DELETE FROM topic WHERE name = :name;

-- name: topic_deduplication_delete
DELETE FROM deduplication WHERE topic = :name;

-- name: subscription_list
SELECT s.id, s.name, s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
       s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds, s.heartbeat_mode, s.filter,
       CASE WHEN s.status = 'Active' AND s.retired_at IS NOT NULL THEN 'Retired' ELSE s.status END AS status, s.host_type, s.retention_seconds,
       CASE WHEN t.status = 'Active' AND t.retired_at IS NOT NULL THEN 'Retired' ELSE t.status END AS topic_status, t.transport, t.is_fifo,
       t.max_payload_bytes, s.max_in_flight, s.key_concurrency, s.rate_limit, s.key_rate_limit
FROM subscription s JOIN topic t ON t.name = s.topic
ORDER BY s.name;

-- name: subscriptions_of_topic
SELECT id, partition_mode, filter, max_attempts, backoff_base_seconds, backoff_max_seconds
FROM subscription WHERE topic = :topic AND retired_at IS NULL ORDER BY id;

-- name: subscriptions_named
-- The subscriptions of a JSON array of names (claim_many), active when they and their topics are.
SELECT s.id, s.name, s.partition_mode, s.lease_seconds, s.status = 'Active' AND t.status = 'Active' AS active,
       s.max_in_flight IS NOT NULL OR s.key_concurrency IS NOT NULL OR s.rate_limit IS NOT NULL
           OR s.key_rate_limit IS NOT NULL AS limited
FROM subscription s JOIN topic t ON t.name = s.topic
WHERE s.name IN (SELECT value FROM json_each(:names))
ORDER BY s.name;

-- name: subscription_active
SELECT s.id, s.partition_mode, s.lease_seconds, s.max_in_flight, s.key_concurrency, s.rate_limit, s.key_rate_limit
FROM subscription s JOIN topic t ON t.name = s.topic
WHERE s.name = :name AND s.status = 'Active' AND t.status = 'Active';

-- name: message_hash
SELECT id, topic, content_hash FROM message WHERE id = :id;

-- name: message_insert
INSERT INTO message (id, topic, partition_key, attributes, payload, payload_ref, correlation_id,
                     deduplication_key, content_hash, published_at)
VALUES (:id, :topic, :partition_key, :attributes, :payload, :payload_ref, :correlation_id,
        :deduplication_key, :content_hash, :now);

-- name: message_known
-- Which of a JSON array of MessageIDs are stored.
SELECT id AS message_id FROM message WHERE id IN (SELECT value FROM json_each(:ids));

-- name: message_cap
SELECT m.topic, t.max_payload_bytes FROM message m LEFT JOIN topic t ON t.name = m.topic WHERE m.id = :id;

-- name: message_delivery_statuses
SELECT status FROM delivery WHERE message_id = :message_id;

-- name: message_rewrite
UPDATE message SET payload = :payload, content_hash = :content_hash WHERE id = :id;

-- name: message_get
SELECT id, topic, partition_key, attributes, payload, payload_ref, correlation_id, published_at
FROM message WHERE id = :id;

-- name: dedup_live
SELECT message_id FROM deduplication
WHERE topic = :topic AND deduplication_key = :key AND expires_at > :now;

-- name: dedup_release
DELETE FROM deduplication WHERE topic = :topic AND deduplication_key = :key AND message_id = :message_id
RETURNING expires_at;

-- name: dedup_upsert
INSERT INTO deduplication (topic, deduplication_key, message_id, expires_at)
VALUES (:topic, :key, :message_id, :expires_at)
ON CONFLICT (topic, deduplication_key) DO UPDATE
SET message_id = excluded.message_id, expires_at = excluded.expires_at;

-- name: partition_touch
INSERT INTO partition (subscription_id, partition_key) VALUES (:subscription_id, :key)
ON CONFLICT (subscription_id, partition_key) DO NOTHING;

-- name: partition_get
SELECT holder_id, next_id, next_visible_at, blocked_id FROM partition
WHERE subscription_id = :subscription_id AND partition_key = :key;

-- name: partition_set
UPDATE partition SET holder_id = :holder_id, next_id = :next_id, next_visible_at = :next_visible_at,
                     blocked_id = :blocked_id, next_priority = coalesce(:next_priority, 0)
WHERE subscription_id = :subscription_id AND partition_key = :key;

-- name: partition_delete
DELETE FROM partition WHERE subscription_id = :subscription_id AND partition_key = :key;

-- name: partition_advance
UPDATE partition SET next_id = :id, next_visible_at = :visible_at, next_priority = :priority
WHERE subscription_id = :subscription_id AND partition_key = :key AND holder_id IS NULL
  AND ((:key_mode = 2 AND next_id IS NULL AND blocked_id IS NULL)
       OR (:key_mode = 1 AND (next_id IS NULL OR :visible_at < next_visible_at)));

-- name: partition_ready_priority
-- Keys that can run now whose next delivery has a priority: claimed before the others.
SELECT partition_key, next_id, next_priority, next_visible_at FROM partition
WHERE subscription_id = :subscription_id AND holder_id IS NULL AND next_id IS NOT NULL
  AND next_visible_at <= :now AND next_priority > 0
ORDER BY next_priority DESC, next_visible_at, next_id
LIMIT :limit;

-- name: partition_ready
SELECT partition_key, next_id, next_priority, next_visible_at FROM partition
WHERE subscription_id = :subscription_id AND holder_id IS NULL AND next_id IS NOT NULL
  AND next_visible_at <= :now AND next_priority = 0
ORDER BY next_visible_at, next_id
LIMIT :limit;

-- name: partition_hold
UPDATE partition SET holder_id = :id, next_id = NULL, next_visible_at = NULL, next_priority = 0
WHERE subscription_id = :subscription_id AND partition_key = :key;

-- name: ordered_head
SELECT id, status, visible_at, priority FROM delivery
WHERE subscription_id = :subscription_id AND partition_key = :key AND key_mode = 2
  AND status IN ('Pending', 'InFlight', 'DeadLettered')
ORDER BY id LIMIT 1;

-- name: exclusive_next
SELECT id, visible_at, priority FROM delivery
WHERE subscription_id = :subscription_id AND partition_key = :key AND key_mode = 1 AND status = 'Pending'
ORDER BY visible_at, id LIMIT 1;

-- name: delivery_insert
INSERT INTO delivery (subscription_id, message_id, partition_key, key_mode, max_attempts,
                      backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at, created_at, priority)
VALUES (:subscription_id, :message_id, :partition_key, :key_mode, :max_attempts, :backoff_base_seconds,
        :backoff_max_seconds, :backoff_schedule, :visible_at, :now, :priority)
RETURNING id;

-- name: delivery_status
SELECT id, status FROM delivery WHERE id = :id;

-- name: claimable_unkeyed_priority
-- Claimable deliveries without a key lock that have a priority: claimed before the others.
SELECT id, visible_at, priority, partition_key FROM delivery
WHERE subscription_id = :subscription_id AND status = 'Pending' AND key_mode = 0 AND priority > 0
  AND visible_at <= :now
ORDER BY priority DESC, visible_at, id
LIMIT :limit;

-- name: claimable_unkeyed
SELECT id, visible_at, priority, partition_key FROM delivery
WHERE subscription_id = :subscription_id AND status = 'Pending' AND key_mode = 0 AND priority = 0
  AND visible_at <= :now
ORDER BY visible_at, id
LIMIT :limit;

-- name: claimable_unkeyed_past_priority
-- claimable_unkeyed_priority past the keys a flow limit holds back (a JSON array), in a window.
SELECT id, visible_at, priority, partition_key FROM delivery
WHERE subscription_id = :subscription_id AND status = 'Pending' AND key_mode = 0 AND priority > 0
  AND visible_at <= :now
  AND (partition_key IS NULL OR partition_key NOT IN (SELECT value FROM json_each(:blocked)))
ORDER BY priority DESC, visible_at, id
LIMIT :limit;

-- name: claimable_unkeyed_past
SELECT id, visible_at, priority, partition_key FROM delivery
WHERE subscription_id = :subscription_id AND status = 'Pending' AND key_mode = 0 AND priority = 0
  AND visible_at <= :now
  AND (partition_key IS NULL OR partition_key NOT IN (SELECT value FROM json_each(:blocked)))
ORDER BY visible_at, id
LIMIT :limit;

-- name: partition_ready_past_priority
SELECT partition_key, next_id, next_priority, next_visible_at FROM partition
WHERE subscription_id = :subscription_id AND holder_id IS NULL AND next_id IS NOT NULL
  AND next_visible_at <= :now AND next_priority > 0
  AND partition_key NOT IN (SELECT value FROM json_each(:blocked))
ORDER BY next_priority DESC, next_visible_at, next_id
LIMIT :limit;

-- name: partition_ready_past
SELECT partition_key, next_id, next_priority, next_visible_at FROM partition
WHERE subscription_id = :subscription_id AND holder_id IS NULL AND next_id IS NOT NULL
  AND next_visible_at <= :now AND next_priority = 0
  AND partition_key NOT IN (SELECT value FROM json_each(:blocked))
ORDER BY next_visible_at, next_id
LIMIT :limit;

-- name: in_flight_count
-- A holder that died holds its slot until its lease runs out.
SELECT count(*) AS n FROM delivery
WHERE subscription_id = :subscription_id AND status = 'InFlight' AND lease_expires_at > :now;

-- name: in_flight_keys
SELECT partition_key, count(*) AS n FROM delivery
WHERE subscription_id = :subscription_id AND status = 'InFlight' AND lease_expires_at > :now
  AND partition_key IS NOT NULL
GROUP BY partition_key;

-- name: work_waiting
-- Claimable work is left (after a claim that a flow limit held back).
SELECT EXISTS (SELECT 1 FROM delivery WHERE subscription_id = :subscription_id AND status = 'Pending'
                 AND key_mode = 0 AND visible_at <= :now)
    OR EXISTS (SELECT 1 FROM partition WHERE subscription_id = :subscription_id AND holder_id IS NULL
                 AND next_id IS NOT NULL AND next_visible_at <= :now) AS waiting;

-- name: flow_waiting
-- Claimable deliveries a flow limit holds back (flow_state): all while :full, else those of the
-- keys of a JSON array, up to :cap.
SELECT count(*) AS n FROM (
    SELECT 1 FROM delivery
    WHERE subscription_id = :subscription_id AND status = 'Pending' AND key_mode = 0 AND visible_at <= :now
      AND (:full OR partition_key IN (SELECT value FROM json_each(:keys)))
    UNION ALL
    SELECT 1 FROM partition
    WHERE subscription_id = :subscription_id AND holder_id IS NULL AND next_id IS NOT NULL
      AND next_visible_at <= :now AND (:full OR partition_key IN (SELECT value FROM json_each(:keys)))
    LIMIT :cap);

-- name: rate_buckets
SELECT per_key, partition_key, tokens, updated_at FROM rate_bucket WHERE subscription_id = :subscription_id;

-- name: rate_bucket_put
INSERT INTO rate_bucket (subscription_id, per_key, partition_key, tokens, updated_at)
VALUES (:subscription_id, :per_key, :key, :tokens, :now)
ON CONFLICT (subscription_id, per_key, partition_key) DO UPDATE
SET tokens = excluded.tokens, updated_at = excluded.updated_at;

-- name: rate_buckets_purge
-- Buckets full again (idle as long as an empty one takes to fill: burst / rate, one second for a
-- rate of at least one a second), or whose subscription has no such limit any more.
WITH r AS (
    SELECT b.rowid AS rid, b.updated_at, CASE WHEN b.per_key THEN s.key_rate_limit ELSE s.rate_limit END AS rate
    FROM rate_bucket b LEFT JOIN subscription s ON s.id = b.subscription_id
), per_second AS (
    SELECT rid, updated_at,
           CAST(substr(rate, 1, instr(rate, '/') - 1) AS REAL)
           / CASE substr(rate, instr(rate, '/') + 1) WHEN 's' THEN 1 WHEN 'm' THEN 60 ELSE 3600 END AS rate
    FROM r
)
DELETE FROM rate_bucket WHERE rowid IN (
    SELECT rid FROM per_second
    WHERE rate IS NULL OR updated_at + max(1.0, rate) / rate <= :now
    LIMIT :limit);

-- name: delivery_claim
UPDATE delivery
SET status = 'InFlight', attempt = attempt + 1, claim_count = claim_count + 1, lease_token = :token,
    lease_expires_at = :lease_expires_at, claimed_at = :now, held_by = :holder, progress_percent = NULL,
    progress_message = NULL
WHERE id = :id AND status = 'Pending'
RETURNING id, lease_token, attempt, max_attempts, lease_expires_at, message_id, partition_key, key_mode, priority;

-- name: delivery_heartbeat
-- A cancel-requested delivery is renewed too (its handler is winding down; its key stays busy).
UPDATE delivery
SET lease_expires_at = :lease_expires_at,
    progress_percent = coalesce(:percent, progress_percent),
    progress_message = coalesce(:message, progress_message)
WHERE id = :id AND lease_token = :token AND status = 'InFlight'
RETURNING id, cancel_requested, lease_expires_at;

-- name: delivery_held
SELECT d.id, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds, d.backoff_max_seconds,
       d.backoff_schedule, d.reason, d.last_error, d.subscription_id, d.partition_key, d.key_mode,
       s.lease_seconds
FROM delivery d JOIN subscription s ON s.id = d.subscription_id
WHERE d.id = :id AND d.lease_token = :token AND d.status = 'InFlight';

-- name: delivery_settle
UPDATE delivery
SET status = :status, attempt = :attempt, visible_at = coalesce(:visible_at, visible_at), lease_token = NULL,
    lease_expires_at = NULL, reason = :reason, last_error = :last_error, settled_at = :settled_at
WHERE id = :id;

-- name: expired_leases
SELECT d.id, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds, d.backoff_max_seconds,
       d.backoff_schedule, d.reason, d.last_error, d.subscription_id, d.partition_key, d.key_mode
FROM delivery d
WHERE d.status = 'InFlight' AND d.lease_expires_at < :now
ORDER BY d.lease_expires_at
LIMIT :limit;

-- name: lock_take
INSERT INTO lock (name, holder, expires_at) VALUES (:name, :holder, :expires_at)
ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at
WHERE lock.expires_at <= :now;

-- name: lock_holder
SELECT holder FROM lock WHERE name = :name;

-- name: lock_release
DELETE FROM lock WHERE name = :name AND holder = :holder;

-- name: purge_deliveries
-- The first bound (the shortest retention of any subscription) is what the index range answers:
-- a pass reads no delivery settled within every retention (as PostgreSQL's purge).
DELETE FROM delivery WHERE id IN (
    SELECT d.id FROM delivery d JOIN subscription s ON s.id = d.subscription_id
    WHERE d.status IN ('Completed', 'Discarded')
      AND d.settled_at < :now - (SELECT min(retention_seconds) FROM subscription)
      AND d.settled_at < :now - s.retention_seconds
    ORDER BY d.settled_at LIMIT :limit)
RETURNING subscription_id, status;

-- name: purge_messages
-- Likewise bounded by the shortest topic retention (a week at the most).
DELETE FROM message WHERE id IN (
    SELECT m.id FROM message m
    WHERE m.published_at < :now - min(604800, coalesce(
              (SELECT min(r.seconds) FROM (SELECT max(retention_seconds) AS seconds FROM subscription GROUP BY topic) r),
              604800))
      AND m.published_at < :now - coalesce(
              (SELECT max(s.retention_seconds) FROM subscription s WHERE s.topic = m.topic), 604800)
      AND NOT EXISTS (SELECT 1 FROM delivery d WHERE d.message_id = m.id)
    ORDER BY m.published_at LIMIT :limit);

-- name: purge_deduplication
DELETE FROM deduplication WHERE rowid IN (
    SELECT rowid FROM deduplication WHERE expires_at <= :now ORDER BY expires_at LIMIT :limit);

-- name: purge_once_markers
DELETE FROM once_marker WHERE key IN (
    SELECT key FROM once_marker WHERE expires_at <= :now ORDER BY expires_at LIMIT :limit);

-- name: prune_deliveries
DELETE FROM delivery WHERE id IN (
    SELECT id FROM delivery WHERE status IN ('Completed', 'Discarded') AND settled_at < :cutoff
    ORDER BY settled_at LIMIT :limit)
RETURNING subscription_id, status;

-- name: settled_count_add
INSERT INTO settled_count (subscription_id, completed, discarded) VALUES (:subscription_id, :completed, :discarded)
ON CONFLICT (subscription_id) DO UPDATE
SET completed = completed + excluded.completed, discarded = discarded + excluded.discarded;

-- name: delivery_of_subscription
SELECT d.id, d.status, d.key_mode, d.subscription_id, d.partition_key, d.attempt
FROM delivery d JOIN subscription s ON s.id = d.subscription_id
WHERE d.id = :id AND s.name = :subscription;

-- name: delivery_replay
UPDATE delivery SET status = 'Pending', attempt = 0, visible_at = :now, note = :note, reason = NULL,
                    settled_at = NULL, cancel_requested = 0
WHERE id = :id AND status = 'DeadLettered';

-- name: delivery_cancel
UPDATE delivery SET reason = CASE WHEN cancel_requested = 1 THEN reason ELSE :reason END, cancel_requested = 1
WHERE id = :id AND status = 'InFlight';

-- name: dead_letters_discard
-- Up to :limit dead letters of a subscription settled before :settled_before, oldest id first.
UPDATE delivery SET status = 'Discarded', reason = 'pruned', settled_at = :now, lease_token = NULL,
                    lease_expires_at = NULL
WHERE id IN (
    SELECT id FROM delivery
    WHERE subscription_id = :subscription_id AND status = 'DeadLettered' AND settled_at < :settled_before
    ORDER BY id LIMIT :limit)
RETURNING id, key_mode, partition_key;

-- name: delivery_discard
UPDATE delivery SET status = 'Discarded', reason = :reason, settled_at = :now, lease_token = NULL,
                    lease_expires_at = NULL
WHERE id = :id AND status IN ('Pending', 'DeadLettered');

-- name: stats
-- Each state through a partial index (Pending in three parts, by key mode; each index's own WHERE
-- is repeated so SQLite can use it); Completed and Discarded from settled_count, not the history.
SELECT s.name AS subscription, s.topic, CASE WHEN s.status = 'Active' AND s.retired_at IS NOT NULL THEN 'Retired' ELSE s.status END AS subscription_status,
       s.partition_mode,
       (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0)
     + (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.key_mode = 1 AND d.status = 'Pending')
     + (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.key_mode = 2
          AND d.status IN ('Pending', 'InFlight', 'DeadLettered') AND d.status = 'Pending') AS pending,
       -- (nothing is claimable while the subscription or its topic is paused, as backlog says)
       CASE WHEN s.status = 'Active' AND t.status = 'Active' THEN
           (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'Pending'
              AND d.key_mode = 0 AND d.visible_at <= :now)
         + (SELECT count(*) FROM partition p WHERE p.subscription_id = s.id AND p.holder_id IS NULL
              AND p.next_id IS NOT NULL AND p.next_visible_at <= :now)
       ELSE 0 END AS claimable,
       (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'InFlight') AS in_flight,
       (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'DeadLettered')
           AS dead_lettered,
       coalesce((SELECT c.completed FROM settled_count c WHERE c.subscription_id = s.id), 0) AS completed,
       coalesce((SELECT c.discarded FROM settled_count c WHERE c.subscription_id = s.id), 0) AS discarded,
       -- since when the longest-waiting due delivery waits (one still delayed is not waiting yet)
       (SELECT min(w.visible_at) FROM (
            SELECT d.visible_at FROM delivery d
            WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
            UNION ALL
            SELECT d.visible_at FROM delivery d
            WHERE d.subscription_id = s.id AND d.key_mode = 1 AND d.status = 'Pending'
            UNION ALL
            SELECT d.visible_at FROM delivery d
            WHERE d.subscription_id = s.id AND d.key_mode = 2
              AND d.status IN ('Pending', 'InFlight', 'DeadLettered') AND d.status = 'Pending') w
        WHERE w.visible_at <= :now)
           AS oldest_pending_at
FROM subscription s JOIN topic t ON t.name = s.topic
WHERE :subscription IS NULL OR s.name = :subscription
ORDER BY s.name;

-- name: backlog
SELECT s.name AS subscription,
       CASE WHEN s.status = 'Active' AND t.status = 'Active' THEN
           (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'Pending'
              AND d.key_mode = 0 AND d.visible_at <= :now)
         + (SELECT count(*) FROM partition p WHERE p.subscription_id = s.id AND p.holder_id IS NULL
              AND p.next_id IS NOT NULL AND p.next_visible_at <= :now)
       ELSE 0 END AS claimable,
       (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'InFlight') AS in_flight
FROM subscription s JOIN topic t ON t.name = s.topic
WHERE s.name = :subscription;

-- name: delivery_get
SELECT d.id AS delivery_id, s.name AS subscription, d.message_id, m.topic, d.partition_key, d.status,
       d.attempt, d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested, d.progress_percent,
       d.progress_message, d.reason, d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at,
       m.attributes, m.payload, m.correlation_id,
       d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid,
       p.started_at AS holder_started_at
FROM delivery d
JOIN subscription s ON s.id = d.subscription_id
JOIN message m ON m.id = d.message_id
LEFT JOIN process p ON p.id = d.held_by
WHERE d.id = :id;

-- name: message_deliveries
SELECT d.id AS delivery_id, s.name AS subscription, d.message_id, m.topic, d.partition_key, d.status,
       d.attempt, d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested, d.progress_percent,
       d.progress_message, d.reason, d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at,
       m.attributes, m.payload, m.correlation_id,
       d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid,
       p.started_at AS holder_started_at
FROM delivery d
JOIN subscription s ON s.id = d.subscription_id
JOIN message m ON m.id = d.message_id
LEFT JOIN process p ON p.id = d.held_by
WHERE d.message_id = :message_id
ORDER BY d.id;

-- name: delivery_list
SELECT d.id AS delivery_id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts,
       d.visible_at, d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message, d.reason,
       d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id,
       d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid,
       p.started_at AS holder_started_at
FROM delivery d
JOIN subscription s ON s.id = d.subscription_id
JOIN message m ON m.id = d.message_id
LEFT JOIN process p ON p.id = d.held_by
WHERE s.name = :subscription AND d.status = :status AND d.id > coalesce(:after_id, 0)
ORDER BY d.id
LIMIT :limit;

-- name: partitions
SELECT k.partition_key, k.condition, k.head_id AS head_delivery_id, h.status AS head_status,
       h.attempt AS head_attempt, h.visible_at AS head_visible_at,
       (SELECT count(*) FROM delivery w WHERE w.subscription_id = k.subscription_id
          AND w.partition_key = k.partition_key AND w.status = 'Pending' AND w.id <> k.head_id) AS waiting_items
FROM (
    SELECT p.subscription_id, p.partition_key,
           CASE WHEN p.holder_id IS NOT NULL THEN 'InFlight'
                WHEN p.blocked_id IS NOT NULL THEN 'Blocked'
                WHEN s.partition_mode = 'Ordered' AND n.attempt > 0 AND p.next_visible_at > :now THEN 'Blocked'
                ELSE 'Idle' END AS condition,
           coalesce(p.holder_id, p.blocked_id, p.next_id) AS head_id
    FROM partition p
    JOIN subscription s ON s.id = p.subscription_id
    LEFT JOIN delivery n ON n.id = coalesce(p.holder_id, p.blocked_id, p.next_id)
    WHERE s.name = :subscription
) k
LEFT JOIN delivery h ON h.id = k.head_id
WHERE :condition IS NULL OR k.condition = :condition
ORDER BY k.partition_key
LIMIT :limit;

-- name: once_take
INSERT INTO once_marker (key, state, token, expires_at) VALUES (:key, 'Running', :token, :expires_at)
ON CONFLICT (key) DO UPDATE SET state = 'Running', token = excluded.token, expires_at = excluded.expires_at
WHERE once_marker.expires_at <= :now;

-- name: once_get
SELECT state, token FROM once_marker WHERE key = :key;

-- name: once_finish
UPDATE once_marker SET state = 'Done', token = NULL, expires_at = :expires_at WHERE key = :key AND token = :token;

-- name: once_abort
DELETE FROM once_marker WHERE key = :key AND token = :token;

-- name: once_renew
UPDATE once_marker SET expires_at = :expires_at WHERE key = :key AND token = :token AND state = 'Running';

-- name: step_get
SELECT value FROM step_result WHERE message_id = :message_id AND name = :name;

-- name: step_put
INSERT INTO step_result (message_id, name, value, created_at) VALUES (:message_id, :name, :value, :now)
ON CONFLICT (message_id, name) DO NOTHING;

-- name: result_put
INSERT INTO message_result (message_id, value, stored_at)
SELECT d.message_id, :value, :now FROM delivery d WHERE d.id = :delivery_id
ON CONFLICT (message_id) DO UPDATE SET value = excluded.value, stored_at = excluded.stored_at;

-- name: result_get
SELECT value, stored_at FROM message_result WHERE message_id = :message_id;

-- name: dedup_holder
SELECT message_id FROM deduplication WHERE topic = :topic AND deduplication_key = :key;

-- name: dedup_delete
DELETE FROM deduplication WHERE topic = :topic AND deduplication_key = :key;

-- name: dedup_expire_at
UPDATE deduplication SET expires_at = :expires_at WHERE topic = :topic AND deduplication_key = :key;

-- name: message_deliveries_waiting
-- The deliveries of a message and whether each still waits out a debounce window.
SELECT status = 'Pending' AND key_mode = 0 AND claimed_at IS NULL AND visible_at > :now AS waiting
FROM delivery WHERE message_id = :message_id;

-- name: message_deliveries_push
UPDATE delivery SET visible_at = :visible_at WHERE message_id = :message_id;

-- name: group_insert
INSERT INTO message_group (id, then_message_id, members, remaining, created_at)
VALUES (:id, :then_message_id, :members, 0, :now);

-- name: group_member_insert
INSERT INTO message_group_member (group_id, message_id, ordinal) VALUES (:group_id, :message_id, :ordinal);

-- name: group_mark_members
UPDATE delivery SET group_id = :group_id WHERE message_id IN (SELECT value FROM json_each(:ids));

-- name: group_members_ended
-- Members that ended already (or have no delivery) count as ended.
UPDATE message_group_member SET ended_at = :now
WHERE group_id = :group_id AND NOT EXISTS (
    SELECT 1 FROM delivery d WHERE d.message_id = message_group_member.message_id
      AND d.status IN ('Pending', 'InFlight'));

-- name: group_count
UPDATE message_group SET remaining = (
    SELECT count(*) FROM message_group_member mm WHERE mm.group_id = :group_id AND mm.ended_at IS NULL)
WHERE id = :group_id
RETURNING remaining, then_message_id;

-- name: group_release
UPDATE message_group SET released_at = :now WHERE id = :group_id;

-- name: message_release
UPDATE delivery SET visible_at = :now
WHERE message_id = :message_id AND status = 'Pending' AND key_mode = 0
RETURNING subscription_id;

-- name: group_members
SELECT mm.ordinal, mm.message_id, mm.ended_at, d.id AS delivery_id, s.name AS subscription, d.status, d.attempt,
       d.max_attempts, d.visible_at, d.reason, d.last_error, d.created_at, d.claimed_at, d.settled_at,
       m.attributes, r.value AS result
FROM message_group_member mm
LEFT JOIN delivery d ON d.id = (SELECT min(x.id) FROM delivery x WHERE x.message_id = mm.message_id)
LEFT JOIN subscription s ON s.id = d.subscription_id
LEFT JOIN message m ON m.id = mm.message_id
LEFT JOIN message_result r ON r.message_id = mm.message_id
WHERE mm.group_id = :group_id
ORDER BY mm.ordinal;

-- name: api_key_create
INSERT INTO api_key (id, name, prefix, key_hash, scopes, created_at, expires_at, topics)
VALUES (:id, :name, :prefix, :key_hash, :scopes, :now, :expires_at, :topics);

-- name: api_key_touch
UPDATE api_key SET last_used_at = :now
WHERE id = :id AND revoked_at IS NULL AND (last_used_at IS NULL OR last_used_at < :now - 60);

-- name: api_key_touch_due
SELECT 1 FROM api_key
WHERE id = :id AND revoked_at IS NULL AND (last_used_at IS NULL OR last_used_at < :now - 60);

-- name: api_key_live_name
SELECT id FROM api_key WHERE name = :name AND revoked_at IS NULL;

-- name: api_key_verify
SELECT id, name, scopes, topics, session_generation FROM api_key
WHERE prefix = :prefix AND key_hash = :key_hash AND revoked_at IS NULL
  AND (expires_at IS NULL OR expires_at > :now);

-- name: api_key_session
SELECT id, name, scopes, topics, session_generation FROM api_key
WHERE prefix = :prefix AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > :now);

-- name: api_key_end_sessions
UPDATE api_key SET session_generation = session_generation + 1
WHERE id = :id AND session_generation = :session_generation;

-- name: api_key_list
SELECT id, name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at, topics FROM api_key
ORDER BY created_at, name;

-- name: api_key_revoke
UPDATE api_key SET revoked_at = :now
WHERE revoked_at IS NULL AND (id = lower(:key) OR prefix = :key OR name = :key);

-- name: schema_versions
SELECT version, name, checksum FROM schema_migration ORDER BY version;

-- The sweeper's minute-by-minute history, which the dashboard charts (sqlite_history.py).

-- name: stats_history_last
SELECT max(h.recorded_at) AS recorded_at FROM stats_history h;

-- name: stats_history_insert
-- The live counts through their partial indexes (as stats), and the deliveries Completed in the
-- window through delivery_settled (its own WHERE repeated, so SQLite can use it).
INSERT INTO stats_history (subscription_id, recorded_at, pending, in_flight, dead_lettered, completed, window_seconds)
SELECT s.id, :now,
       (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0)
     + (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.key_mode = 1 AND d.status = 'Pending')
     + (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.key_mode = 2
          AND d.status IN ('Pending', 'InFlight', 'DeadLettered') AND d.status = 'Pending'),
       (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'InFlight'),
       (SELECT count(*) FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'DeadLettered'),
       coalesce(c.completed, 0),
       :window_seconds
FROM subscription s
LEFT JOIN (
    SELECT d.subscription_id, count(*) AS completed
    FROM delivery d
    WHERE d.status IN ('Completed', 'Discarded') AND d.status = 'Completed'
      AND d.settled_at >= :counted_from AND d.settled_at < :counted_to
    GROUP BY d.subscription_id
) c ON c.subscription_id = s.id;

-- name: stats_history_purge
DELETE FROM stats_history WHERE recorded_at < :before;

-- name: stats_history
SELECT s.name AS subscription, h.recorded_at, h.pending, h.in_flight, h.dead_lettered, h.completed,
       h.window_seconds
FROM stats_history h
JOIN subscription s ON s.id = h.subscription_id
WHERE h.recorded_at >= :since AND (:subscription IS NULL OR s.name = :subscription)
ORDER BY h.recorded_at, s.name;

-- The dashboard's bounded reads of the live work (sqlite_history.py): each count stops at :cap,
-- and the blocked keys are found through delivery_dead_letters and partition_ready.

-- name: live_counts
SELECT s.name AS subscription,
       min((SELECT count(*) FROM (SELECT 1 FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'Pending'
                                    AND d.key_mode = 0 ORDER BY d.visible_at, d.id LIMIT :cap))
         + (SELECT count(*) FROM (SELECT 1 FROM delivery d WHERE d.subscription_id = s.id AND d.key_mode = 1
                                    AND d.status = 'Pending' ORDER BY d.partition_key, d.visible_at, d.id
                                    LIMIT :cap))
         + (SELECT count(*) FROM (SELECT 1 FROM delivery d WHERE d.subscription_id = s.id AND d.key_mode = 2
                                    AND d.status IN ('Pending', 'InFlight', 'DeadLettered') AND d.status = 'Pending'
                                    ORDER BY d.partition_key, d.id LIMIT :cap)),
           :cap) AS pending,
       (SELECT count(*) FROM (SELECT 1 FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'InFlight'
                                LIMIT :cap)) AS in_flight,
       (SELECT count(*) FROM (SELECT 1 FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'DeadLettered'
                                ORDER BY d.id LIMIT :cap)) AS dead_lettered,
       -- Since when the longest-waiting claimable work waits (the heads of delivery_claim and
       -- partition_ready; NULLs left out as PostgreSQL's least does).
       (SELECT min(t) FROM (
           SELECT (SELECT d.visible_at FROM delivery d WHERE d.subscription_id = s.id AND d.status = 'Pending'
                     AND d.key_mode = 0 ORDER BY d.visible_at, d.id LIMIT 1) AS t
           UNION ALL
           SELECT (SELECT p.next_visible_at FROM partition p WHERE p.subscription_id = s.id AND p.holder_id IS NULL
                     AND p.next_id IS NOT NULL ORDER BY p.next_visible_at LIMIT 1))) AS oldest_pending_at,
       CASE WHEN :stuck_before IS NULL THEN 0 ELSE
           (SELECT count(*) FROM (SELECT d.claimed_at FROM delivery d WHERE d.subscription_id = s.id
                                    AND d.status = 'InFlight' LIMIT :cap) x WHERE x.claimed_at < :stuck_before)
       END AS stuck
FROM subscription s
WHERE :subscription IS NULL OR s.name = :subscription
ORDER BY s.name;

-- name: blocked_keys
WITH s AS (
    SELECT s.id FROM subscription s WHERE s.name = :subscription AND s.partition_mode = 'Ordered'
), heads AS (
    SELECT id FROM (SELECT d.id FROM delivery d
                    WHERE d.subscription_id = (SELECT id FROM s) AND d.status = 'DeadLettered' AND d.key_mode = 2
                    ORDER BY d.id LIMIT :limit)
    UNION
    SELECT id FROM (SELECT p.next_id AS id FROM partition p
                    WHERE p.subscription_id = (SELECT id FROM s) AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                      AND p.next_visible_at > :now
                    ORDER BY p.next_visible_at LIMIT :limit)
)
SELECT d.partition_key, d.id AS head_delivery_id, d.status AS head_status, d.attempt AS head_attempt,
       d.visible_at AS head_visible_at, d.reason AS head_reason,
       (SELECT count(*) FROM (SELECT 1 FROM delivery w WHERE w.subscription_id = d.subscription_id
                                AND w.partition_key = d.partition_key AND w.key_mode = 2
                                AND w.status IN ('Pending', 'InFlight', 'DeadLettered') AND w.status = 'Pending'
                                AND w.id > d.id ORDER BY w.id LIMIT :cap)) AS waiting_items
FROM heads h
JOIN delivery d ON d.id = h.id
WHERE d.status = 'DeadLettered' OR d.attempt > 0
ORDER BY d.id
LIMIT :limit;

-- name: process_beat
INSERT INTO process (id, hostname, pid, started_at, version, subscriptions, slots, busy, beat_interval_seconds,
                     last_seen_at, stopped_at)
VALUES (:id, :hostname, :pid, :started_at, :version, :subscriptions, :slots, :busy, :beat_interval_seconds,
        :now, NULL)
ON CONFLICT (id) DO UPDATE
SET version = excluded.version, subscriptions = excluded.subscriptions, slots = excluded.slots, busy = excluded.busy,
    beat_interval_seconds = excluded.beat_interval_seconds, last_seen_at = :now, stopped_at = NULL;

-- name: process_forget
DELETE FROM process WHERE last_seen_at < :before;

-- name: process_stop
UPDATE process SET stopped_at = :now, busy = 0, last_seen_at = :now WHERE id = :id;

-- name: process_list
SELECT p.id AS process_id, p.hostname, p.pid, p.started_at, p.version, p.subscriptions, p.slots, p.busy,
       p.last_seen_at, p.stopped_at,
       CASE WHEN p.stopped_at IS NOT NULL THEN 'Stopped'
            WHEN p.last_seen_at < :now - 3 * p.beat_interval_seconds THEN 'Gone'
            ELSE 'Running' END AS state,
       (SELECT count(*) FROM delivery d WHERE d.status = 'InFlight' AND d.held_by = p.id) AS in_flight
FROM process p
ORDER BY p.stopped_at IS NOT NULL, p.last_seen_at DESC, p.id;

-- name: deliveries_taken_back
-- The leases a sweeper pass took back, with their subscription and the process that held them.
SELECT d.id AS delivery_id, s.name AS subscription, d.attempt, d.held_by AS holder_id, p.hostname AS holder_host,
       p.pid AS holder_pid
FROM delivery d
JOIN subscription s ON s.id = d.subscription_id
LEFT JOIN process p ON p.id = d.held_by
WHERE d.id IN (SELECT value FROM json_each(:ids))
ORDER BY d.id;

-- The AWS layer's outbox and bindings (fastapi_workqueue/aws/outbox_store.py): the same operations
-- as PostgreSQL's aws_* functions, the relay's take under a lease (relay_token, relay_until) instead
-- of row locks, so the file's write lock is never held across an SNS call.

-- name: aws_outbox_write
INSERT INTO aws_outbox (topic, message_id, partition_key, body, attributes, created_at, next_attempt_at)
VALUES (:topic, :message_id, :partition_key, :body, :attributes, :now, :now);

-- name: aws_outbox_candidates
-- The due unsent rows no live lease holds, oldest first.
SELECT id, topic, message_id, partition_key, body, attributes, attempts FROM aws_outbox
WHERE sent_at IS NULL AND next_attempt_at <= :now AND (relay_until IS NULL OR relay_until < :now)
ORDER BY id LIMIT :limit;

-- name: aws_outbox_earlier
-- The unsent rows of a key before the given one (the relay takes a row only when it takes these too).
SELECT id FROM aws_outbox WHERE topic = :topic AND partition_key = :key AND sent_at IS NULL AND id < :id;

-- name: aws_outbox_lease
UPDATE aws_outbox SET relay_token = :token, relay_until = :until
WHERE id = :id AND sent_at IS NULL AND (relay_until IS NULL OR relay_until < :now);

-- name: aws_outbox_mark_sent
UPDATE aws_outbox SET sent_at = :now, attempts = attempts + 1, last_error = NULL, relay_token = NULL,
    relay_until = NULL
WHERE id = :id AND relay_token = :token;

-- name: aws_outbox_defer
UPDATE aws_outbox SET attempts = attempts + 1, last_error = :error, next_attempt_at = :at, relay_token = NULL,
    relay_until = NULL
WHERE id = :id AND relay_token = :token;

-- name: aws_outbox_release
-- The rows a pass took but did not send (behind a failed row of their key): free for the next pass.
UPDATE aws_outbox SET relay_token = NULL, relay_until = NULL WHERE relay_token = :token AND sent_at IS NULL;

-- name: aws_binding_exists
SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'aws_binding';

-- name: aws_binding_list
SELECT kind, name, region, binding FROM aws_binding ORDER BY kind, name;

-- name: aws_binding_clear
DELETE FROM aws_binding;

-- name: aws_binding_insert
INSERT INTO aws_binding (kind, name, region, binding, imported_at) VALUES (:kind, :name, :region, :binding, :at);

-- name: attempt_record
INSERT INTO delivery_attempt (delivery_id, attempt, started_at, ended_at, held_by, outcome, reason, error)
SELECT d.id, coalesce(:attempt, d.attempt), CASE WHEN :outcome = 'Replayed' THEN NULL ELSE d.claimed_at END, :now,
       CASE WHEN :outcome = 'Replayed' THEN NULL ELSE d.held_by END, :outcome, :reason, :error
FROM delivery d WHERE d.id = :id;

-- name: attempt_trim
-- Keeps the newest 50 attempts of the delivery.
DELETE FROM delivery_attempt
WHERE delivery_id = :id AND id <= (SELECT b.id FROM delivery_attempt b WHERE b.delivery_id = :id
                                   ORDER BY b.id DESC LIMIT 1 OFFSET 50);

-- name: delivery_attempts
SELECT a.attempt, a.started_at, a.ended_at, a.outcome, a.reason, a.error,
       a.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid,
       p.started_at AS holder_started_at
FROM delivery_attempt a
LEFT JOIN process p ON p.id = a.held_by
WHERE a.delivery_id = :id
ORDER BY a.id
LIMIT 50;

-- name: search_partition_key
SELECT m.id FROM message m WHERE m.partition_key = :q AND m.partition_key IS NOT NULL
ORDER BY m.published_at DESC LIMIT :limit;

-- name: search_correlation_id
SELECT m.id FROM message m WHERE m.correlation_id = :q AND m.correlation_id IS NOT NULL
ORDER BY m.published_at DESC LIMIT :limit;

-- name: search_job
SELECT m.id FROM message m
WHERE json_extract(m.attributes, '$.job') = :q AND json_extract(m.attributes, '$.job') IS NOT NULL
ORDER BY m.published_at DESC LIMIT :limit;

-- name: search_message_deliveries
SELECT d.id AS delivery_id, s.name AS subscription, d.message_id, m.topic, d.partition_key, d.status,
       d.attempt, d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested, d.progress_percent,
       d.progress_message, d.reason, d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at,
       m.attributes, m.payload, m.correlation_id,
       d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid,
       p.started_at AS holder_started_at
FROM delivery d
JOIN subscription s ON s.id = d.subscription_id
JOIN message m ON m.id = d.message_id
LEFT JOIN process p ON p.id = d.held_by
WHERE d.message_id IN (SELECT value FROM json_each(:ids))
ORDER BY d.id DESC
LIMIT :limit;
