-- fastapi-workqueue: SQL Server, version 21: a minute-by-minute history of each subscription's
-- counts, which the dashboard charts. Mirrors sql/postgresql/0028 (whose header says why and how):
-- record_stats_history, called by the transport after a sweeper pass that ran, writes at most once
-- a minute across all processes (an application lock taken without waiting, then a look at the
-- last row) one row per subscription with stats' Pending, InFlight and DeadLettered counts and the
-- deliveries Completed since the previous row (over delivery_settled, up to 30 seconds ago), and
-- deletes the rows older than @p_keep_seconds; stats_history reads them back. Conventions: top of
-- 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

CREATE TABLE workqueue.stats_history (
    subscription_id  int NOT NULL,
    recorded_at      datetimeoffset(6) NOT NULL,
    pending          bigint NOT NULL,
    in_flight        bigint NOT NULL,
    dead_lettered    bigint NOT NULL,
    completed        bigint NOT NULL,
    window_seconds   float NOT NULL,
    CONSTRAINT stats_history_pk PRIMARY KEY CLUSTERED (subscription_id, recorded_at)
);
-- The last row, the last hour of every subscription, and the rows past keeping.
CREATE INDEX stats_history_recorded_at ON workqueue.stats_history (recorded_at);
GO

-- Writes this minute's row of every subscription unless a row of this minute exists (or another
-- transaction holds the lock); answers how many it wrote. @p_now stands in for the clock (tests).
-- The minute starts are counted in UTC, as datetimeoffset compares.
-- returns: record_stats_history
CREATE OR ALTER PROCEDURE workqueue.record_stats_history
    @p_keep_seconds float = 86400,
    @p_now datetimeoffset(6) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_epoch datetimeoffset(6) = CAST(N'2000-01-01T00:00:00+00:00' AS datetimeoffset(6));
    DECLARE @v_now datetimeoffset(6) = COALESCE(@p_now, SYSDATETIMEOFFSET());
    DECLARE @v_minute datetimeoffset(6);
    DECLARE @v_to datetimeoffset(6);
    DECLARE @v_from datetimeoffset(6);
    DECLARE @v_last datetimeoffset(6);
    DECLARE @v_lock int;
    DECLARE @v_rows int = 0;
    DECLARE @v_stats TABLE (
        subscription nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY,
        topic nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
        subscription_status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        partition_mode nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        pending bigint NOT NULL,
        claimable bigint NOT NULL,
        in_flight bigint NOT NULL,
        dead_lettered bigint NOT NULL,
        completed bigint NOT NULL,
        discarded bigint NOT NULL,
        oldest_pending_at datetimeoffset(6) NULL
    );
    SET @v_minute = DATEADD(minute, DATEDIFF(minute, @v_epoch, @v_now), @v_epoch);
    SET @v_to = DATEADD(second, -30, @v_now);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        EXEC @v_lock = sp_getapplock
            @Resource = N'workqueue.stats_history',
            @LockMode = N'Exclusive',
            @LockOwner = N'Transaction',
            @LockTimeout = 0;

        IF @v_lock >= 0
        BEGIN
            SELECT @v_last = MAX(h.recorded_at) FROM workqueue.stats_history AS h;
            IF @v_last IS NULL OR @v_last < @v_minute
            BEGIN
                SET @v_from = CASE WHEN @v_last > DATEADD(hour, -1, @v_now) THEN DATEADD(second, -30, @v_last)
                                   ELSE DATEADD(minute, -1, @v_to) END;
                INSERT INTO @v_stats (subscription, topic, subscription_status, partition_mode, pending, claimable,
                                      in_flight, dead_lettered, completed, discarded, oldest_pending_at)
                EXEC workqueue.stats @p_subscription = NULL;

                INSERT INTO workqueue.stats_history
                    (subscription_id, recorded_at, pending, in_flight, dead_lettered, completed, window_seconds)
                SELECT s.id, @v_now, st.pending, st.in_flight, st.dead_lettered, COALESCE(c.completed, 0),
                       CAST(DATEDIFF(millisecond, @v_from, @v_to) AS float) / 1000
                FROM @v_stats AS st
                INNER JOIN workqueue.subscription AS s ON s.name = st.subscription
                LEFT JOIN (
                    SELECT d.subscription_id, COUNT_BIG(*) AS completed
                    FROM workqueue.delivery AS d
                    WHERE d.status = N'Completed' AND d.settled_at >= @v_from AND d.settled_at < @v_to
                    GROUP BY d.subscription_id
                ) AS c ON c.subscription_id = s.id;
                SET @v_rows = @@ROWCOUNT;

                DELETE FROM workqueue.stats_history
                WHERE recorded_at < DATEADD(second, -CAST(@p_keep_seconds AS int), @v_now);
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
    SELECT @v_rows AS record_stats_history;
END;
GO

-- The rows recorded since @p_since (at most a day back: no more is kept), of one subscription or
-- of all, oldest first.
-- returns: subscription, recorded_at, pending, in_flight, dead_lettered, completed, window_seconds
CREATE OR ALTER PROCEDURE workqueue.stats_history
    @p_since datetimeoffset(6),
    @p_subscription nvarchar(200) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_since datetimeoffset(6) = DATEADD(day, -1, SYSDATETIMEOFFSET());
    IF @p_since > @v_since
        SET @v_since = @p_since;
    SELECT s.name AS subscription, h.recorded_at, h.pending, h.in_flight, h.dead_lettered, h.completed,
           h.window_seconds
    FROM workqueue.stats_history AS h
    INNER JOIN workqueue.subscription AS s ON s.id = h.subscription_id
    WHERE h.recorded_at >= @v_since AND (@p_subscription IS NULL OR s.name = @p_subscription)
    ORDER BY h.recorded_at, s.name;
END;
GO
