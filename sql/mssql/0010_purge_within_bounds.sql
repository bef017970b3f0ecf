-- fastapi-workqueue: SQL Server purge, version 10. Mirrors purge as sql/postgresql/0013 leaves it:
-- the same rows deleted, and each scan bounded by the shortest retention that applies to any row,
-- so a sweeper pass does not read every settled delivery and message still within retention.
-- Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- Terminal deliveries past their subscription's retention, then messages that no delivery
-- references any more (kept as long as the longest retention of their topic, for duplicate
-- detection), then expired deduplication keys. Pending, InFlight and DeadLettered are never purged.
-- returns: purged_deliveries, purged_messages, purged_deduplication
CREATE OR ALTER PROCEDURE workqueue.purge
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_deliveries int = 0;
    DECLARE @v_messages int = 0;
    DECLARE @v_dedup int = 0;
    DECLARE @v_seconds float;
    DECLARE @v_settled_before datetimeoffset(6);
    DECLARE @v_published_before datetimeoffset(6);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- None settled after now minus the shortest retention of any subscription can go yet.
        SELECT @v_seconds = MIN(s.retention_seconds) FROM workqueue.subscription AS s;
        IF @v_seconds IS NOT NULL
        BEGIN
            SET @v_settled_before = DATEADD(
                microsecond, -CAST((@v_seconds - FLOOR(@v_seconds)) * 1000000 AS int),
                DATEADD(second, -CAST(FLOOR(@v_seconds) AS int), @v_now));
            DELETE FROM workqueue.delivery
            WHERE id IN (
                SELECT TOP (@p_limit) x.id
                FROM workqueue.delivery AS x
                INNER JOIN workqueue.subscription AS s ON s.id = x.subscription_id
                WHERE x.status IN (N'Completed', N'Discarded')
                  AND x.settled_at < @v_settled_before
                  AND x.settled_at < DATEADD(
                      microsecond, -CAST((s.retention_seconds - FLOOR(s.retention_seconds)) * 1000000 AS int),
                      DATEADD(second, -CAST(FLOOR(s.retention_seconds) AS int), @v_now))
                ORDER BY x.settled_at
            );
            SET @v_deliveries = @@ROWCOUNT;
        END;

        -- None published after now minus the shortest topic retention (a week at the most) can.
        SELECT @v_seconds = MIN(r.seconds)
        FROM (SELECT MAX(s.retention_seconds) AS seconds FROM workqueue.subscription AS s GROUP BY s.topic) AS r;
        IF @v_seconds IS NULL OR @v_seconds > 604800
            SET @v_seconds = 604800;
        SET @v_published_before = DATEADD(
            microsecond, -CAST((@v_seconds - FLOOR(@v_seconds)) * 1000000 AS int),
            DATEADD(second, -CAST(FLOOR(@v_seconds) AS int), @v_now));

        DELETE FROM workqueue.message
        WHERE id IN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.message AS x
            CROSS APPLY (
                SELECT COALESCE(MAX(s.retention_seconds), 604800) AS seconds
                FROM workqueue.subscription AS s
                WHERE s.topic = x.topic
            ) AS r
            WHERE x.published_at < @v_published_before
              AND x.published_at < DATEADD(
                      microsecond, -CAST((r.seconds - FLOOR(r.seconds)) * 1000000 AS int),
                      DATEADD(second, -CAST(FLOOR(r.seconds) AS int), @v_now))
              AND NOT EXISTS (SELECT 1 FROM workqueue.delivery AS d WHERE d.message_id = x.id)
            ORDER BY x.published_at
        );
        SET @v_messages = @@ROWCOUNT;

        WITH expired AS (
            SELECT TOP (@p_limit) dd.topic, dd.deduplication_key
            FROM workqueue.deduplication AS dd
            WHERE dd.expires_at <= @v_now
            ORDER BY dd.expires_at
        )
        DELETE FROM expired;
        SET @v_dedup = @@ROWCOUNT;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_deliveries AS purged_deliveries, @v_messages AS purged_messages,
           @v_dedup AS purged_deduplication;
END;
GO
