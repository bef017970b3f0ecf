-- fastapi-workqueue: SQL Server, version 16: listings answer with every field of a delivery.
-- Mirrors sql/postgresql/0023: list_deliveries returns get_delivery's columns (less the
-- subscription, which the caller names), in the same order. Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- Deliveries of one subscription in one state, oldest first, paged by id.
-- returns: delivery_id, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id
CREATE OR ALTER PROCEDURE workqueue.list_deliveries
    @p_subscription nvarchar(200),
    @p_status nvarchar(20),
    @p_limit int,
    @p_after_id bigint = 0
AS
BEGIN
    SET NOCOUNT ON;
    SELECT TOP (@p_limit)
           d.id AS delivery_id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts,
           d.visible_at, d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message,
           d.reason, d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload,
           m.correlation_id
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    WHERE s.name = @p_subscription AND d.status = @p_status AND d.id > COALESCE(@p_after_id, 0)
    ORDER BY d.id;
END;
GO
