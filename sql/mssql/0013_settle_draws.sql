-- fastapi-workqueue: SQL Server, version 13: the jitter of a retry is drawn by the caller. Mirrors
-- sql/postgresql/0020 (whose header says why): backoff_seconds takes the draw @p_draw (NULL: a
-- draw of RAND() through random_draw, as before) and settle the draws of its items, @p_draws (a
-- JSON array of fractions in [0, 1); NULL when left out). expire_leases (of 0012, unchanged
-- otherwise) passes NULL: lease expiry keeps drawing here. Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- Full-jitter exponential backoff with the fraction @p_draw (a draw of RAND() when it is NULL), or
-- the fixed schedule a delivery was published with (a JSON array of seconds). INLINE = OFF: an
-- inlined call would read the view once per statement and give every row of a statement the same delay. The exponent is capped at 64, far above any
-- backoff_max_seconds, so a very high attempt number cannot overflow the float.
-- returns: backoff_seconds
CREATE OR ALTER FUNCTION workqueue.backoff_seconds (
    @p_attempt int,
    @p_base float,
    @p_max float,
    @p_schedule nvarchar(max),
    @p_draw float = NULL
)
RETURNS float
WITH INLINE = OFF
AS
BEGIN
    DECLARE @v_steps int = 0;
    DECLARE @v_step int;
    DECLARE @v_draw float;
    DECLARE @v_exponent int;
    DECLARE @v_cap float;

    IF @p_schedule IS NOT NULL AND ISJSON(@p_schedule) = 1
        SELECT @v_steps = COUNT(*) FROM OPENJSON(@p_schedule);
    IF @v_steps > 0
    BEGIN
        SET @v_step = CASE
            WHEN @p_attempt < 1 THEN 1
            WHEN @p_attempt > @v_steps THEN @v_steps
            ELSE @p_attempt
        END;
        RETURN (
            SELECT CAST(s.value AS float)
            FROM OPENJSON(@p_schedule) AS s
            WHERE s.[key] = CAST(@v_step - 1 AS nvarchar(10))
        );
    END;

    SET @v_draw = @p_draw;
    IF @v_draw IS NULL
        SELECT @v_draw = r.value FROM workqueue.random_draw AS r;
    SET @v_exponent = CASE WHEN @p_attempt > 1 THEN @p_attempt - 1 ELSE 0 END;
    IF @v_exponent > 64
        SET @v_exponent = 64;
    SET @v_cap = @p_base * POWER(CAST(2 AS float), @v_exponent);
    RETURN @v_draw * CASE WHEN @p_max < @v_cap THEN @p_max ELSE @v_cap END;
END;
GO

-- Settles deliveries with their current lease token. Outcomes: Complete, Retry (explicit, with a
-- reason and optional delay), Fail (an error), DeadLetter, Release (shutdown, or a busy once key:
-- back to Pending after the optional delay without consuming the attempt). A cancel-requested
-- delivery becomes Discarded whatever the outcome. A stale token changes nothing and answers
-- LeaseLost. (An id given twice is settled once, by its first item.)
-- returns: delivery_id, result
CREATE OR ALTER PROCEDURE workqueue.settle
    @p_ids nvarchar(max),
    @p_tokens nvarchar(max),
    @p_outcomes nvarchar(max),
    @p_delays nvarchar(max),
    @p_reasons nvarchar(max),
    @p_errors nvarchar(max),
    @p_draws nvarchar(max) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_settled nvarchar(max);
    DECLARE @v_claimable TABLE (subscription_id int NOT NULL);
    DECLARE @v_i TABLE (
        ord int NOT NULL PRIMARY KEY,
        id bigint NULL,
        token uniqueidentifier NULL,
        outcome nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
        delay float NULL,
        reason nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        error nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        draw float NULL
    );
    DECLARE @v_locked TABLE (
        id bigint NOT NULL PRIMARY KEY,
        lease_token uniqueidentifier NOT NULL,
        attempt int NOT NULL,
        max_attempts int NOT NULL,
        cancel_requested bit NOT NULL,
        backoff_base_seconds float NOT NULL,
        backoff_max_seconds float NOT NULL,
        backoff_schedule nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
    );
    DECLARE @v_plan TABLE (
        id bigint NOT NULL PRIMARY KEY,
        outcome nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
        delay float NULL,
        reason nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        error nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        draw float NULL,
        cancel_requested bit NOT NULL,
        new_status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        wait_seconds float NULL
    );
    DECLARE @v_u TABLE (
        id bigint NOT NULL PRIMARY KEY,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL
    );

    INSERT INTO @v_i (ord, id, token, outcome, delay, reason, error, draw)
    SELECT CAST(a.[key] AS int), CAST(a.value AS bigint), TRY_CAST(b.value AS uniqueidentifier),
           c.value, CAST(e.value AS float), f.value, g.value, CAST(h.value AS float)
    FROM OPENJSON(@p_ids) AS a
    LEFT JOIN OPENJSON(@p_tokens) AS b ON b.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_outcomes) AS c ON c.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_delays) AS e ON e.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_reasons) AS f ON f.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_errors) AS g ON g.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_draws) AS h ON h.[key] = a.[key];

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- Lock the InFlight deliveries that still carry a given token, in id order.
        INSERT INTO @v_locked (
            id, lease_token, attempt, max_attempts, cancel_requested, backoff_base_seconds,
            backoff_max_seconds, backoff_schedule)
        SELECT d.id, d.lease_token, d.attempt, d.max_attempts, d.cancel_requested, d.backoff_base_seconds,
               d.backoff_max_seconds, d.backoff_schedule
        FROM workqueue.delivery AS d WITH (UPDLOCK, ROWLOCK)
        WHERE d.id IN (SELECT i.id FROM @v_i AS i) AND d.status = N'InFlight'
          AND d.lease_token IN (SELECT i.token FROM @v_i AS i)
        ORDER BY d.id;

        INSERT INTO @v_plan (id, outcome, delay, reason, error, draw, cancel_requested, new_status)
        SELECT l.id, i.outcome, i.delay, i.reason, i.error, i.draw, l.cancel_requested,
               CASE WHEN l.cancel_requested = 1 THEN N'Discarded'
                    WHEN i.outcome = N'Complete' THEN N'Completed'
                    WHEN i.outcome = N'Release' THEN N'Pending'
                    WHEN i.outcome = N'DeadLetter' THEN N'DeadLettered'
                    WHEN l.attempt >= l.max_attempts THEN N'DeadLettered'
                    ELSE N'Pending' END
        FROM @v_locked AS l
        CROSS APPLY (
            SELECT TOP (1) x.outcome, x.delay, x.reason, x.error, x.draw
            FROM @v_i AS x
            WHERE x.id = l.id AND x.token = l.lease_token
            ORDER BY x.ord
        ) AS i;

        -- The wait before a Pending delivery is visible again: the caller's draw of the item, or
        -- (none given) one drawn here per delivery.
        UPDATE p
        SET wait_seconds = CASE
                WHEN p.new_status <> N'Pending' THEN NULL
                WHEN p.outcome = N'Release' THEN COALESCE(p.delay, 0)
                WHEN p.delay IS NOT NULL THEN p.delay
                ELSE workqueue.backoff_seconds(l.attempt, l.backoff_base_seconds, l.backoff_max_seconds,
                                               l.backoff_schedule, p.draw)
            END
        FROM @v_plan AS p
        INNER JOIN @v_locked AS l ON l.id = p.id;

        UPDATE d
        SET status = p.new_status,
            attempt = CASE
                WHEN p.outcome = N'Release' AND p.new_status = N'Pending'
                    THEN CASE WHEN d.attempt > 1 THEN d.attempt - 1 ELSE 0 END
                ELSE d.attempt
            END,
            visible_at = CASE
                WHEN p.new_status <> N'Pending' THEN d.visible_at
                ELSE DATEADD(
                    microsecond, CAST((p.wait_seconds - FLOOR(p.wait_seconds)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(p.wait_seconds) AS int), @v_now))
            END,
            lease_token = NULL,
            lease_expires_at = NULL,
            reason = CASE
                WHEN p.cancel_requested = 1 THEN d.reason
                WHEN p.outcome = N'Complete' THEN NULL
                WHEN p.new_status = N'DeadLettered' AND p.outcome <> N'DeadLetter'
                    THEN COALESCE(N'max attempts reached: ' + COALESCE(p.reason, p.error), N'max attempts reached')
                ELSE COALESCE(p.reason, d.reason)
            END,
            last_error = COALESCE(p.error, d.last_error),
            settled_at = CASE WHEN p.new_status IN (N'Completed', N'Discarded', N'DeadLettered') THEN @v_now END
        OUTPUT inserted.id, inserted.status, inserted.key_mode, inserted.subscription_id, inserted.partition_key
        INTO @v_u (id, status, key_mode, subscription_id, partition_key)
        FROM workqueue.delivery AS d
        INNER JOIN @v_plan AS p ON p.id = d.id;

        -- Free the keys of the settled deliveries, all at once (release_keys takes those nobody
        -- else holds, in key order, and marks the others stale). Its result, the subscriptions
        -- with a key claimable now, is what PostgreSQL notifies; consumers poll here, so it is only
        -- read to keep it from the client.
        IF EXISTS (SELECT 1 FROM @v_u AS u WHERE u.key_mode > 0)
        BEGIN
            SELECT @v_settled = N'[' + STRING_AGG(CAST(u.id AS nvarchar(max)), N',') + N']'
            FROM @v_u AS u;
            INSERT INTO @v_claimable (subscription_id)
            EXEC workqueue.release_keys @p_ids = @v_settled;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT i.id AS delivery_id, COALESCE(u.status, N'LeaseLost') AS result
    FROM @v_i AS i
    LEFT JOIN @v_u AS u ON u.id = i.id
    ORDER BY i.ord;
END;
GO

-- InFlight deliveries whose lease ran out: Discarded when a cancel was requested, DeadLettered
-- when the attempt was the last, otherwise Pending again after backoff (the attempt counts).
-- The locking read takes the backoff columns, which no index of the InFlight rows covers, so
-- it locks the delivery rows themselves (see the top of 0005_consume.sql).
--
-- PostgreSQL frees the keys of the expired deliveries with release_keys. Here each key is
-- re-derived with refresh_partition, in key order (the same result): sweep reads this procedure's
-- result with INSERT ... EXEC, and SQL Server does not allow a procedure run that way to read
-- release_keys the same way (INSERT ... EXEC cannot nest). As in release_keys (PostgreSQL 0019), a
-- key another transaction holds is not waited for: it is marked stale and re-derived later.
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
    DECLARE @v_key_found bit;
    DECLARE @v_key_holder bigint;
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
                attempt, backoff_base_seconds, backoff_max_seconds, backoff_schedule, NULL)
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
                -- A key another transaction holds (a producer) is marked stale instead of waited for,
                -- as release_keys does; a key without a row is re-derived (refresh_partition creates
                -- its row). (PostgreSQL notifies when the key became claimable; consumers poll here.)
                SET @v_key_found = 0;
                SELECT @v_key_found = 1, @v_key_holder = p.holder_id
                FROM workqueue.partition AS p WITH (UPDLOCK, READPAST, ROWLOCK)
                WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key;
                IF @v_key_found = 1 OR NOT EXISTS (
                    SELECT 1 FROM workqueue.partition AS p
                    WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key
                )
                    EXEC workqueue.refresh_partition
                        @p_subscription_id = @v_key_subscription, @p_key = @v_key, @p_mode = @v_key_mode;
                ELSE
                BEGIN
                    -- Reading key_mode locks an existing marker's row (see release_keys).
                    SET @v_key_found = 0;
                    SELECT @v_key_found = 1, @v_key_holder = ps.key_mode
                    FROM workqueue.partition_stale AS ps WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                    WHERE ps.subscription_id = @v_key_subscription AND ps.partition_key = @v_key;
                    IF @v_key_found = 0
                        INSERT INTO workqueue.partition_stale (subscription_id, partition_key, key_mode)
                        VALUES (@v_key_subscription, @v_key, @v_key_mode);
                END;
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
