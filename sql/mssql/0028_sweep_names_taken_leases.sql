-- fastapi-workqueue: SQL Server, version 28: a sweeper pass says which leases it took back (as
-- PostgreSQL 0037, whose header says why): sweep also answers taken_back, a JSON array.

-- One sweeper pass. A transaction-owned application lock lets only one pass run at a time across
-- every process; a pass that finds the lock taken returns ran = 0 and does nothing. The lock is
-- released when the pass's transaction ends (PostgreSQL: pg_try_advisory_xact_lock). Expiry and
-- purge run as the procedures above (their one result set each is read with INSERT ... EXEC),
-- then the keys left stale are re-derived (PostgreSQL 0019), settled_count is folded (0022) and
-- expired once markers are dropped (not counted).
-- returns: ran, retried, dead_lettered, discarded, purged_deliveries, purged_messages, purged_deduplication, taken_back
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
    DECLARE @v_taken_back nvarchar(max) = N'[]';
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
            -- Each lease taken back, with its subscription and the process that held it (for the log).
            SET @v_taken_back = COALESCE((
                SELECT e.delivery_id, s.name AS subscription, e.result, d.attempt, d.held_by AS holder_id,
                       p.hostname AS holder_host, p.pid AS holder_pid
                FROM @v_expired AS e
                INNER JOIN workqueue.delivery AS d ON d.id = e.delivery_id
                INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
                LEFT JOIN workqueue.process AS p ON p.id = d.held_by
                ORDER BY e.delivery_id
                FOR JSON PATH, INCLUDE_NULL_VALUES), N'[]');

            -- Keys left stale by settles and by the expiry above, where nobody holds them now.
            EXEC workqueue.rederive_stale @p_subscription_ids = NULL, @p_limit = @p_limit;

            INSERT INTO @v_purged (purged_deliveries, purged_messages, purged_deduplication)
            EXEC workqueue.purge @p_limit = @p_limit;
            SELECT @v_purged_deliveries = p.purged_deliveries, @v_purged_messages = p.purged_messages,
                   @v_purged_deduplication = p.purged_deduplication
            FROM @v_purged AS p;

            EXEC workqueue.fold_settled_counts;

            SET @v_now = SYSDATETIMEOFFSET();
            WITH expired AS (
                SELECT TOP (@p_limit) o.[key]
                FROM workqueue.once_marker AS o WITH (UPDLOCK, READPAST, ROWLOCK)
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
           @v_purged_deduplication AS purged_deduplication, @v_taken_back AS taken_back;
END;
GO
