-- fastapi-workqueue: SQLite, version 2: no index on the column a heartbeat renews (as PostgreSQL
-- 0021). delivery_lease, an index on lease_expires_at, made every heartbeat rewrite an index
-- entry; delivery_in_flight indexes the InFlight rows on subscription_id, which a heartbeat never
-- changes. The sweeper reads the InFlight rows from it and filters them on lease_expires_at.

DROP INDEX IF EXISTS delivery_lease;
CREATE INDEX delivery_in_flight ON delivery (subscription_id) WHERE status = 'InFlight';
