-- fastapi-workqueue: SQL Server topology, version 3: topics and subscriptions. Mirrors
-- sync_topic, sync_subscription, set_subscription_status, list_subscriptions and list_topics of
-- sql/postgresql/0002_operations.sql (conventions: top of 0002_helpers.sql).

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- Creates a topic or updates its settings (the row is only written when something changed).
-- PostgreSQL's "IS DISTINCT FROM" is written as NOT EXISTS (... INTERSECT ...), which treats
-- two NULLs as equal.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.sync_topic
    @p_name nvarchar(200),
    @p_max_payload_bytes int,
    @p_is_fifo bit,
    @p_transport nvarchar(200) = N'database'
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        IF EXISTS (
            SELECT 1 FROM workqueue.topic AS t WITH (UPDLOCK, HOLDLOCK) WHERE t.name = @p_name
        )
            UPDATE t
            SET max_payload_bytes = @p_max_payload_bytes, is_fifo = @p_is_fifo,
                transport = @p_transport, updated_at = SYSDATETIMEOFFSET()
            FROM workqueue.topic AS t
            WHERE t.name = @p_name
              AND NOT EXISTS (
                  SELECT t.max_payload_bytes, t.is_fifo, t.transport
                  INTERSECT
                  SELECT @p_max_payload_bytes, @p_is_fifo, @p_transport
              );
        ELSE
            INSERT INTO workqueue.topic (name, transport, max_payload_bytes, is_fifo)
            VALUES (@p_name, @p_transport, @p_max_payload_bytes, @p_is_fifo);

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
END;
GO

-- Creates or updates a subscription's definition. The status (Active/Paused) is the operators'
-- and is only set when the subscription is created. A partition mode cannot change while the
-- subscription has live work (its deliveries were routed for the old mode). PostgreSQL retries
-- itself when another process created the row concurrently; here UPDLOCK + HOLDLOCK on the name
-- makes the second caller wait for the first and then update the row it created.
-- Error 51002 is PostgreSQL's object_in_use.
-- returns: sync_subscription
CREATE OR ALTER PROCEDURE workqueue.sync_subscription
    @p_name nvarchar(200),
    @p_topic nvarchar(200),
    @p_handler_key nvarchar(max),
    @p_partition_mode nvarchar(20),
    @p_lease_seconds float,
    @p_max_attempts int,
    @p_backoff_base_seconds float,
    @p_backoff_max_seconds float,
    @p_max_processing_seconds float,
    @p_heartbeat_mode nvarchar(20),
    @p_filter nvarchar(max),
    @p_host_type nvarchar(20),
    @p_retention_seconds float,
    @p_status nvarchar(20) = N'Active'
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_id int;
    DECLARE @v_topic nvarchar(200);
    DECLARE @v_partition_mode nvarchar(20);
    DECLARE @v_message nvarchar(2048);
    DECLARE @v_created TABLE (id int NOT NULL);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        SELECT @v_id = s.id, @v_topic = s.topic, @v_partition_mode = s.partition_mode
        FROM workqueue.subscription AS s WITH (UPDLOCK, HOLDLOCK)
        WHERE s.name = @p_name;

        IF @v_id IS NULL
        BEGIN
            INSERT INTO workqueue.subscription (
                name, topic, handler_key, partition_mode, lease_seconds, max_attempts,
                backoff_base_seconds, backoff_max_seconds, max_processing_seconds, heartbeat_mode,
                filter, host_type, retention_seconds, status)
            OUTPUT inserted.id INTO @v_created (id)
            VALUES (@p_name, @p_topic, @p_handler_key, @p_partition_mode, @p_lease_seconds, @p_max_attempts,
                @p_backoff_base_seconds, @p_backoff_max_seconds, @p_max_processing_seconds, @p_heartbeat_mode,
                @p_filter, @p_host_type, @p_retention_seconds, @p_status);
            SELECT @v_id = c.id FROM @v_created AS c;
        END
        ELSE
        BEGIN
            IF @v_topic <> @p_topic COLLATE Latin1_General_100_BIN2 AND EXISTS (
                SELECT 1 FROM workqueue.delivery AS d
                WHERE d.subscription_id = @v_id AND d.status IN (N'Pending', N'InFlight', N'DeadLettered')
            )
            BEGIN
                SET @v_message = CONCAT(N'subscription ', @p_name, N' has live deliveries of topic ', @v_topic,
                    N'; it cannot move to topic ', @p_topic, N' until they are settled or discarded');
                THROW 51002, @v_message, 1;
            END;
            IF @v_partition_mode <> @p_partition_mode COLLATE Latin1_General_100_BIN2 AND EXISTS (
                SELECT 1 FROM workqueue.delivery AS d
                WHERE d.subscription_id = @v_id AND d.status IN (N'Pending', N'InFlight', N'DeadLettered')
            )
            BEGIN
                SET @v_message = CONCAT(N'subscription ', @p_name, N' has live deliveries routed for partition mode ',
                    @v_partition_mode, N'; change it to ', @p_partition_mode,
                    N' once they are settled or discarded, or create a new subscription');
                THROW 51002, @v_message, 1;
            END;
            UPDATE s
            SET topic = @p_topic, handler_key = @p_handler_key, partition_mode = @p_partition_mode,
                lease_seconds = @p_lease_seconds, max_attempts = @p_max_attempts,
                backoff_base_seconds = @p_backoff_base_seconds, backoff_max_seconds = @p_backoff_max_seconds,
                max_processing_seconds = @p_max_processing_seconds, heartbeat_mode = @p_heartbeat_mode,
                filter = @p_filter, host_type = @p_host_type, retention_seconds = @p_retention_seconds,
                updated_at = SYSDATETIMEOFFSET()
            FROM workqueue.subscription AS s
            WHERE s.id = @v_id
              AND NOT EXISTS (
                  SELECT s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
                         s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds,
                         s.heartbeat_mode, s.filter, s.host_type, s.retention_seconds
                  INTERSECT
                  SELECT @p_topic, @p_handler_key, @p_partition_mode, @p_lease_seconds, @p_max_attempts,
                         @p_backoff_base_seconds, @p_backoff_max_seconds, @p_max_processing_seconds,
                         @p_heartbeat_mode, @p_filter, @p_host_type, @p_retention_seconds
              );
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_id AS sync_subscription;
END;
GO

-- Pauses or resumes a subscription. No row when the subscription does not exist.
-- (PostgreSQL notifies the consumers when a subscription becomes Active; here they poll.)
-- returns: subscription, status, changed
CREATE OR ALTER PROCEDURE workqueue.set_subscription_status
    @p_name nvarchar(200),
    @p_status nvarchar(20)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_old nvarchar(20);
    DECLARE @v_result TABLE (
        subscription nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        changed bit NOT NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        SELECT @v_old = s.status
        FROM workqueue.subscription AS s WITH (UPDLOCK, ROWLOCK)
        WHERE s.name = @p_name;
        IF @v_old IS NOT NULL
        BEGIN
            UPDATE s
            SET status = @p_status, updated_at = SYSDATETIMEOFFSET()
            FROM workqueue.subscription AS s
            WHERE s.name = @p_name AND s.status <> @p_status;
            INSERT INTO @v_result (subscription, status, changed)
            VALUES (@p_name, @p_status,
                    CASE WHEN @v_old <> @p_status COLLATE Latin1_General_100_BIN2 THEN 1 ELSE 0 END);
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT r.subscription, r.status, r.changed FROM @v_result AS r;
END;
GO

-- returns: id, name, topic, handler_key, partition_mode, lease_seconds, max_attempts, backoff_base_seconds, backoff_max_seconds, max_processing_seconds, heartbeat_mode, filter, status, host_type, retention_seconds, topic_status, transport, is_fifo, max_payload_bytes
CREATE OR ALTER PROCEDURE workqueue.list_subscriptions
AS
BEGIN
    SET NOCOUNT ON;
    SELECT s.id, s.name, s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
           s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds,
           s.heartbeat_mode, s.filter, s.status, s.host_type, s.retention_seconds,
           t.status AS topic_status, t.transport, t.is_fifo, t.max_payload_bytes
    FROM workqueue.subscription AS s
    INNER JOIN workqueue.topic AS t ON t.name = s.topic
    ORDER BY s.name;
END;
GO

-- returns: name, transport, max_payload_bytes, is_fifo, status
CREATE OR ALTER PROCEDURE workqueue.list_topics
AS
BEGIN
    SET NOCOUNT ON;
    SELECT t.name, t.transport, t.max_payload_bytes, t.is_fifo, t.status
    FROM workqueue.topic AS t
    ORDER BY t.name;
END;
GO
