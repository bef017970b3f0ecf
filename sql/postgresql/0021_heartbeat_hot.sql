-- fastapi-workqueue: PostgreSQL, version 21: heartbeats update their rows in place.
--
-- A heartbeat (0015) writes lease_expires_at, progress_percent and progress_message of InFlight
-- deliveries. PostgreSQL can update a row on its own page without touching any index (a HOT
-- update, which also leaves no dead index entries behind for vacuum) only when no index names a
-- changed column, in its key or in its predicate. delivery_lease (0001) was an index on
-- lease_expires_at: each of the thousands of heartbeats a busy worker sends per minute wrote a new
-- entry into it and into every other index of the table (3,000 heartbeats, 0 HOT updates).
--
-- The sweeper's lookup of expired leases goes to delivery_in_flight instead, an index of the
-- InFlight rows on a column a heartbeat never changes: expire_leases (0007) then reads the InFlight
-- rows, a set bounded by the workers' concurrency, and filters them on lease_expires_at; backlog
-- and the scaler query count a subscription's InFlight deliveries from it. No other index of
-- delivery names a column a heartbeat writes (delivery_claim, delivery_ordered_head and
-- delivery_exclusive_next: subscription_id, partition_key, visible_at, id, status and key_mode;
-- delivery_dead_letters and delivery_settled: status, settled_at; delivery_message: message_id).
--
-- The new index is built inside the migration's transaction (not CONCURRENTLY): writes to
-- delivery wait while PostgreSQL reads the table once to build it.

DROP INDEX IF EXISTS workqueue.delivery_lease;
CREATE INDEX delivery_in_flight ON workqueue.delivery (subscription_id) WHERE status = 'InFlight';
