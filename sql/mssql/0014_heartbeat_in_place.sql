-- fastapi-workqueue: SQL Server, version 14: no index on the column a heartbeat renews. Mirrors
-- sql/postgresql/0021 (whose header says why): delivery_lease (0001), a filtered index on
-- lease_expires_at, made every heartbeat move an index entry; delivery_in_flight indexes the
-- InFlight rows on subscription_id, which a heartbeat never changes. The sweeper (expire_leases)
-- reads the InFlight rows from it and filters them on lease_expires_at; backlog counts a
-- subscription's InFlight deliveries from it. Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

DROP INDEX IF EXISTS delivery_lease ON workqueue.delivery;
CREATE INDEX delivery_in_flight ON workqueue.delivery (subscription_id) WHERE status = N'InFlight';
GO
