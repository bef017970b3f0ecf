-- fastapi-workqueue: SQL Server sweeper, version 6: lease expiry and retention, one pass at a time
-- across every process. Mirrors expire_leases (sql/postgresql/0007_release_keys.sql), purge
-- (0002_operations.sql) and sweep (as 0004 leaves it); conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- InFlight deliveries whose lease ran out: Discarded when a cancel was requested, DeadLettered
-- when the attempt was the last, otherwise Pending again after backoff (the attempt counts).
-- The locking read takes the backoff columns, which the delivery_lease index does not cover, so
-- it locks the delivery rows themselves (see the top of 0005_consume.sql).
--
-- PostgreSQL (0007) frees the keys of the expired deliveries with release_keys. Here each key is
-- re-derived with refresh_partition, in key order, which gives the same result (0007 says so):
-- sweep reads this procedure's result with INSERT ... EXEC, and SQL Server does not allow a
-- procedure run that way to read release_keys the same way (INSERT ... EXEC cannot nest).
-- returns: delivery_id, result
CREATE OR ALTER PROCEDURE workqueue.expire_leases
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_k int;
    DECLARE @v_k_count int;
    DECLARE @v_key_subscription int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_mode smallint;
    DECLARE @v_expired TABLE (
        id bigint NOT NULL PRIMARY KEY,
        attempt int NOT NULL,
        max_attempts int NOT NULL,
        cancel_requested bit NOT NULL,
        backoff_base_seconds float NOT NULL,
        backoff_max_seconds float NOT NULL,
        backoff_schedule nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        wait_seconds float NULL
    );
    DECLARE @v_u TABLE (
        id bigint NOT NULL PRIMARY KEY,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL
    );
    DECLARE @v_keys TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        INSERT INTO @v_expired (
            id, attempt, max_attempts, cancel_requested, backoff_base_seconds, backoff_max_seconds,
            backoff_schedule)
        SELECT TOP (@p_limit) d.id, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds,
               d.backoff_max_seconds, d.backoff_schedule
        FROM workqueue.delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
        WHERE d.status = N'InFlight' AND d.lease_expires_at < @v_now
        ORDER BY d.lease_expires_at;

        IF @@ROWCOUNT > 0
        BEGIN
            -- The backoff of the deliveries that go back to Pending, drawn once per delivery.
            UPDATE @v_expired
            SET wait_seconds = workqueue.backoff_seconds(
                attempt, backoff_base_seconds, backoff_max_seconds, backoff_schedule)
            WHERE cancel_requested = 0 AND attempt < max_attempts;

            UPDATE d
            SET status = CASE WHEN d.cancel_requested = 1 THEN N'Discarded'
                              WHEN d.attempt >= d.max_attempts THEN N'DeadLettered'
                              ELSE N'Pending' END,
                visible_at = CASE
                    WHEN d.cancel_requested = 1 OR d.attempt >= d.max_attempts THEN d.visible_at
                    ELSE DATEADD(
                        microsecond, CAST((e.wait_seconds - FLOOR(e.wait_seconds)) * 1000000 AS int),
                        DATEADD(second, CAST(FLOOR(e.wait_seconds) AS int), @v_now))
                END,
                reason = CASE WHEN d.cancel_requested = 1 THEN d.reason
                              WHEN d.attempt >= d.max_attempts THEN N'lease expired on the final attempt'
                              ELSE N'lease expired' END,
                last_error = CASE WHEN d.cancel_requested = 1 THEN d.last_error
                                  ELSE N'lease expired: the holder stopped renewing it' END,
                lease_token = NULL,
                lease_expires_at = NULL,
                settled_at = CASE WHEN d.cancel_requested = 1 OR d.attempt >= d.max_attempts THEN @v_now END
            OUTPUT inserted.id, inserted.status, inserted.key_mode, inserted.subscription_id, inserted.partition_key
            INTO @v_u (id, status, key_mode, subscription_id, partition_key)
            FROM workqueue.delivery AS d
            INNER JOIN @v_expired AS e ON e.id = d.id;

            INSERT INTO @v_keys (subscription_id, partition_key, key_mode)
            SELECT DISTINCT u.subscription_id, u.partition_key, u.key_mode
            FROM @v_u AS u
            WHERE u.key_mode > 0
            ORDER BY u.subscription_id, u.partition_key;
            SET @v_k_count = @@ROWCOUNT;
            SET @v_k = 1;
            WHILE @v_k <= @v_k_count
            BEGIN
                SELECT @v_key_subscription = k.subscription_id, @v_key = k.partition_key, @v_key_mode = k.key_mode
                FROM @v_keys AS k
                WHERE k.ord = @v_k;
                -- (PostgreSQL notifies when the key became claimable; consumers poll here.)
                EXEC workqueue.refresh_partition
                    @p_subscription_id = @v_key_subscription, @p_key = @v_key, @p_mode = @v_key_mode;
                SET @v_k = @v_k + 1;
            END;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT u.id AS delivery_id, u.status AS result
    FROM @v_u AS u
    ORDER BY u.id;
END;
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

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        DELETE FROM workqueue.delivery
        WHERE id IN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.delivery AS x
            INNER JOIN workqueue.subscription AS s ON s.id = x.subscription_id
            WHERE x.status IN (N'Completed', N'Discarded')
              AND x.settled_at < DATEADD(
                  microsecond, -CAST((s.retention_seconds - FLOOR(s.retention_seconds)) * 1000000 AS int),
                  DATEADD(second, -CAST(FLOOR(s.retention_seconds) AS int), @v_now))
            ORDER BY x.settled_at
        );
        SET @v_deliveries = @@ROWCOUNT;

        DELETE FROM workqueue.message
        WHERE id IN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.message AS x
            CROSS APPLY (
                SELECT COALESCE(MAX(s.retention_seconds), 604800) AS seconds
                FROM workqueue.subscription AS s
                WHERE s.topic = x.topic
            ) AS r
            WHERE x.published_at < DATEADD(
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

-- One sweeper pass. A transaction-owned application lock lets only one pass run at a time across
-- every process; a pass that finds the lock taken returns ran = 0 and does nothing. The lock is
-- released when the pass's transaction ends (PostgreSQL: pg_try_advisory_xact_lock). Expiry and
-- purge run as the procedures above (their one result set each is read with INSERT ... EXEC),
-- then expired once markers are dropped (not counted).
-- returns: ran, retried, dead_lettered, discarded, purged_deliveries, purged_messages, purged_deduplication
CREATE OR ALTER PROCEDURE workqueue.sweep
    @p_limit int = 1000
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6);
    DECLARE @v_lock int;
    DECLARE @v_ran bit = 0;
    DECLARE @v_retried int = 0;
    DECLARE @v_dead int = 0;
    DECLARE @v_discarded int = 0;
    DECLARE @v_purged_deliveries int = 0;
    DECLARE @v_purged_messages int = 0;
    DECLARE @v_purged_deduplication int = 0;
    DECLARE @v_expired TABLE (
        delivery_id bigint NOT NULL,
        result nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
    );
    DECLARE @v_purged TABLE (
        purged_deliveries int NOT NULL,
        purged_messages int NOT NULL,
        purged_deduplication int NOT NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        EXEC @v_lock = sp_getapplock
            @Resource = N'workqueue.sweep',
            @LockMode = N'Exclusive',
            @LockOwner = N'Transaction',
            @LockTimeout = 0;

        IF @v_lock >= 0
        BEGIN
            SET @v_ran = 1;
            INSERT INTO @v_expired (delivery_id, result)
            EXEC workqueue.expire_leases @p_limit = @p_limit;
            SELECT @v_retried = COALESCE(SUM(CASE WHEN e.result = N'Pending' THEN 1 ELSE 0 END), 0),
                   @v_dead = COALESCE(SUM(CASE WHEN e.result = N'DeadLettered' THEN 1 ELSE 0 END), 0),
                   @v_discarded = COALESCE(SUM(CASE WHEN e.result = N'Discarded' THEN 1 ELSE 0 END), 0)
            FROM @v_expired AS e;

            INSERT INTO @v_purged (purged_deliveries, purged_messages, purged_deduplication)
            EXEC workqueue.purge @p_limit = @p_limit;
            SELECT @v_purged_deliveries = p.purged_deliveries, @v_purged_messages = p.purged_messages,
                   @v_purged_deduplication = p.purged_deduplication
            FROM @v_purged AS p;

            SET @v_now = SYSDATETIMEOFFSET();
            WITH expired AS (
                SELECT TOP (@p_limit) o.[key]
                FROM workqueue.once_marker AS o
                WHERE o.expires_at <= @v_now
                ORDER BY o.expires_at
            )
            DELETE FROM expired;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_ran AS ran, @v_retried AS retried, @v_dead AS dead_lettered, @v_discarded AS discarded,
           @v_purged_deliveries AS purged_deliveries, @v_purged_messages AS purged_messages,
           @v_purged_deduplication AS purged_deduplication;
END;
GO
