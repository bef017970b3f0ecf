-- fastapi-workqueue: SQL Server, version 21: a minute-by-minute history of each subscription's
-- counts, which the dashboard charts. Mirrors sql/postgresql/0028 (whose header says why and how):
-- record_stats_history, called by the transport after a sweeper pass that ran, writes at most once
-- a minute across all processes (an application lock taken without waiting, then a look at the
-- last row) one row per subscription with stats' Pending, InFlight and DeadLettered counts and the
-- deliveries Completed since the previous row (over delivery_settled, up to 30 seconds ago), and
-- deletes the rows older than @p_keep_seconds; stats_history reads them back. The dashboard's
-- bounded reads of the live work, live_counts and blocked_keys, are PostgreSQL's too, and so is
-- list_deliveries naming DeadLettered and InFlight literally (0016 named the state with a parameter,
-- and a filtered index serves no such predicate). Conventions: top of 0002_helpers.sql.

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

-- Each subscription's live counts, each stopping at @p_cap (a page shows "@p_cap or more"): at most
-- @p_cap index entries a state, whatever the backlog (stats counts every live row).
-- returns: subscription, pending, in_flight, dead_lettered
CREATE OR ALTER PROCEDURE workqueue.live_counts
    @p_subscription nvarchar(200) = NULL,
    @p_cap int = 1000
AS
BEGIN
    SET NOCOUNT ON;
    SELECT c.subscription,
           CASE WHEN c.pending > @p_cap THEN CAST(@p_cap AS bigint) ELSE c.pending END AS pending,
           c.in_flight, c.dead_lettered
    FROM (
        SELECT s.name AS subscription,
               (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'Pending'
                                            AND d.key_mode = 0 ORDER BY d.visible_at, d.id) AS x)
             + (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'Pending'
                                            AND d.key_mode = 1
                                          ORDER BY d.partition_key, d.visible_at, d.id) AS x)
             + (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'Pending'
                                            AND d.key_mode = 2 ORDER BY d.partition_key, d.id) AS x) AS pending,
               (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'InFlight') AS x)
                   AS in_flight,
               (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) d.id FROM workqueue.delivery AS d
                                          WHERE d.subscription_id = s.id AND d.status = N'DeadLettered'
                                          ORDER BY d.id) AS x)
                   AS dead_lettered
        FROM workqueue.subscription AS s
        WHERE @p_subscription IS NULL OR s.name = @p_subscription
    ) AS c
    ORDER BY c.subscription;
END;
GO

-- The heads that block keys of an Ordered subscription, oldest first, at most @p_limit: a
-- dead-lettered head (through delivery_dead_letters) or a head waiting to be retried (through
-- partition_ready); waiting_items counts the key's deliveries behind it, up to @p_cap.
-- returns: partition_key, head_delivery_id, head_status, head_attempt, head_visible_at, head_reason, waiting_items
CREATE OR ALTER PROCEDURE workqueue.blocked_keys
    @p_subscription nvarchar(200),
    @p_limit int,
    @p_cap int = 1000
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_subscription_id int;
    DECLARE @v_heads TABLE (id bigint NOT NULL PRIMARY KEY);
    SELECT @v_subscription_id = s.id
    FROM workqueue.subscription AS s
    WHERE s.name = @p_subscription AND s.partition_mode = N'Ordered';

    INSERT INTO @v_heads (id)
    SELECT TOP (@p_limit) d.id FROM workqueue.delivery AS d
    WHERE d.subscription_id = @v_subscription_id AND d.status = N'DeadLettered' AND d.key_mode = 2
    ORDER BY d.id;
    INSERT INTO @v_heads (id)
    SELECT w.next_id FROM (
        SELECT TOP (@p_limit) p.next_id FROM workqueue.partition AS p
        WHERE p.subscription_id = @v_subscription_id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
          AND p.next_visible_at > @v_now
        ORDER BY p.next_visible_at
    ) AS w
    WHERE NOT EXISTS (SELECT 1 FROM @v_heads AS h WHERE h.id = w.next_id);

    SELECT TOP (@p_limit) d.partition_key, d.id AS head_delivery_id, d.status AS head_status,
           d.attempt AS head_attempt, d.visible_at AS head_visible_at, d.reason AS head_reason,
           (SELECT COUNT_BIG(*) FROM (SELECT TOP (@p_cap) w.id FROM workqueue.delivery AS w
                                      WHERE w.subscription_id = d.subscription_id
                                        AND w.partition_key = d.partition_key AND w.key_mode = 2
                                        AND w.status = N'Pending' AND w.id > d.id ORDER BY w.id) AS x)
               AS waiting_items
    FROM @v_heads AS h
    INNER JOIN workqueue.delivery AS d ON d.id = h.id
    WHERE d.status = N'DeadLettered' OR d.attempt > 0
    ORDER BY d.id;
END;
GO

-- Deliveries of one subscription in one state, oldest first, paged by id. DeadLettered and InFlight
-- are named literally, so their pages read their filtered indexes (a state given as a parameter can
-- use none); the page's ids come first, then their rows.
-- returns: delivery_id, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id
CREATE OR ALTER PROCEDURE workqueue.list_deliveries
    @p_subscription nvarchar(200),
    @p_status nvarchar(20),
    @p_limit int,
    @p_after_id bigint = 0
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_subscription int;
    DECLARE @v_after bigint = COALESCE(@p_after_id, 0);
    DECLARE @v_page TABLE (id bigint NOT NULL PRIMARY KEY);
    SELECT @v_subscription = s.id FROM workqueue.subscription AS s WHERE s.name = @p_subscription;
    IF @p_status = N'DeadLettered'
        INSERT INTO @v_page (id)
        SELECT TOP (@p_limit) d.id FROM workqueue.delivery AS d
        WHERE d.subscription_id = @v_subscription AND d.status = N'DeadLettered' AND d.id > @v_after
        ORDER BY d.id;
    ELSE IF @p_status = N'InFlight'
        INSERT INTO @v_page (id)
        SELECT TOP (@p_limit) d.id FROM workqueue.delivery AS d
        WHERE d.subscription_id = @v_subscription AND d.status = N'InFlight' AND d.id > @v_after
        ORDER BY d.id;
    ELSE
        INSERT INTO @v_page (id)
        SELECT TOP (@p_limit) d.id FROM workqueue.delivery AS d
        WHERE d.subscription_id = @v_subscription AND d.status = @p_status AND d.id > @v_after
        ORDER BY d.id;
    SELECT d.id AS delivery_id, d.message_id, m.topic, d.partition_key, d.status, d.attempt, d.max_attempts,
           d.visible_at, d.lease_expires_at, d.cancel_requested, d.progress_percent, d.progress_message,
           d.reason, d.last_error, d.note, d.created_at, d.claimed_at, d.settled_at, m.attributes, m.payload,
           m.correlation_id
    FROM @v_page AS v
    INNER JOIN workqueue.delivery AS d ON d.id = v.id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    ORDER BY d.id;
END;
GO
