-- fastapi-workqueue: SQL Server, version 15: stats read no history. Mirrors sql/postgresql/0022
-- (whose header says why and how): settled_count holds deltas of each subscription's Completed and
-- Discarded deliveries, appended by settle, expire_leases and discard, taken away by purge and
-- prune, folded by fold_settled_counts (from sweep and prune); stats sums them and reads the other
-- states through filtered indexes. Redefines settle and expire_leases (0013), discard and stats
-- (0007), prune (0008, which now runs in a transaction of its own), purge and sweep (0012), with
-- the same parameters and result columns. Conventions: top of 0002_helpers.sql.
--
-- The counts start from the deliveries that exist when this migration runs (delivery is locked
-- against writes meanwhile, TABLOCK and HOLDLOCK); a settle already running under the old
-- definition when the migration commits is not counted.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- A heap without a key: rows are only appended, summed all at once by stats, and folded.
CREATE TABLE workqueue.settled_count (
    subscription_id  int NOT NULL,
    completed        bigint NOT NULL,
    discarded        bigint NOT NULL
);

INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
SELECT d.subscription_id, SUM(CASE WHEN d.status = N'Completed' THEN CAST(1 AS bigint) ELSE 0 END),
       SUM(CASE WHEN d.status = N'Discarded' THEN CAST(1 AS bigint) ELSE 0 END)
FROM workqueue.delivery AS d WITH (TABLOCK, HOLDLOCK)
WHERE d.status IN (N'Completed', N'Discarded')
GROUP BY d.subscription_id;
GO

-- Replaces the rows of each subscription that has more than one by their sum (dropping sums of
-- zero). Rows another transaction is still appending are skipped (READPAST) and stay for the next
-- fold. PostgreSQL returns void: no result set here.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.fold_settled_counts
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_folded TABLE (
        subscription_id int NOT NULL,
        completed bigint NOT NULL,
        discarded bigint NOT NULL
    );
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        DELETE c
        OUTPUT deleted.subscription_id, deleted.completed, deleted.discarded
        INTO @v_folded (subscription_id, completed, discarded)
        FROM workqueue.settled_count AS c WITH (READPAST)
        WHERE c.subscription_id IN (
            SELECT x.subscription_id FROM workqueue.settled_count AS x
            GROUP BY x.subscription_id
            HAVING COUNT(*) > 1 OR (SUM(x.completed) = 0 AND SUM(x.discarded) = 0)
        );
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT f.subscription_id, SUM(f.completed), SUM(f.discarded)
        FROM @v_folded AS f
        GROUP BY f.subscription_id
        HAVING SUM(f.completed) <> 0 OR SUM(f.discarded) <> 0;
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

-- Each count reads the rows of its state through a filtered index: Pending in three parts (by key
-- mode, the indexes claims use), InFlight (delivery_in_flight), DeadLettered; Completed and
-- Discarded, the states history accumulates in, are the sums of settled_count (PostgreSQL 0022).
-- returns: subscription, topic, subscription_status, partition_mode, pending, claimable, in_flight, dead_lettered, completed, discarded, oldest_pending_at
CREATE OR ALTER PROCEDURE workqueue.stats
    @p_subscription nvarchar(200) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT s.name AS subscription, s.topic, s.status AS subscription_status, s.partition_mode,
           p.pending, COALESCE(cl.claimable, 0) AS claimable, f.in_flight, dl.dead_lettered,
           COALESCE(t.completed, 0) AS completed, COALESCE(t.discarded, 0) AS discarded,
           p.oldest_pending_at
    FROM workqueue.subscription AS s
    LEFT JOIN (
        SELECT c.subscription_id, SUM(c.completed) AS completed, SUM(c.discarded) AS discarded
        FROM workqueue.settled_count AS c
        GROUP BY c.subscription_id
    ) AS t ON t.subscription_id = s.id
    OUTER APPLY (
        SELECT COUNT_BIG(*) AS pending, MIN(w.created_at) AS oldest_pending_at
        FROM (
            SELECT d.created_at FROM workqueue.delivery AS d
            WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
            UNION ALL
            SELECT d.created_at FROM workqueue.delivery AS d
            WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 1
            UNION ALL
            SELECT d.created_at FROM workqueue.delivery AS d
            WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 2
        ) AS w
    ) AS p
    OUTER APPLY (
        SELECT COUNT_BIG(*) AS in_flight FROM workqueue.delivery AS d
        WHERE d.subscription_id = s.id AND d.status = N'InFlight'
    ) AS f
    OUTER APPLY (
        SELECT COUNT_BIG(*) AS dead_lettered FROM workqueue.delivery AS d
        WHERE d.subscription_id = s.id AND d.status = N'DeadLettered'
    ) AS dl
    OUTER APPLY (
        SELECT (SELECT COUNT_BIG(*) FROM workqueue.delivery AS d
                WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.visible_at <= @v_now)
             + (SELECT COUNT_BIG(*) FROM workqueue.partition AS pt
                WHERE pt.subscription_id = s.id AND pt.holder_id IS NULL AND pt.next_id IS NOT NULL
                  AND pt.next_visible_at <= @v_now) AS claimable
    ) AS cl
    WHERE @p_subscription IS NULL OR s.name = @p_subscription
    ORDER BY s.name;
END;
GO

-- Settles deliveries with their current lease token. Outcomes: Complete, Retry (explicit, with a
-- reason and optional delay), Fail (an error), DeadLetter, Release (shutdown, or a busy once key:
-- back to Pending after the optional delay without consuming the attempt). A cancel-requested
-- delivery becomes Discarded whatever the outcome. A stale token changes nothing and answers
-- LeaseLost. (An id given twice is settled once, by its first item.) @p_draws are the caller's
-- jitter draws (PostgreSQL 0020); the batch's terminal settles are counted in settled_count (0022).
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

        -- The batch's terminal settles, one row per subscription (settled_count).
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, SUM(CASE WHEN u.status = N'Completed' THEN CAST(1 AS bigint) ELSE 0 END),
               SUM(CASE WHEN u.status = N'Discarded' THEN CAST(1 AS bigint) ELSE 0 END)
        FROM @v_u AS u
        WHERE u.status IN (N'Completed', N'Discarded')
        GROUP BY u.subscription_id;

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

            INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
            SELECT u.subscription_id, 0, COUNT_BIG(*)
            FROM @v_u AS u
            WHERE u.status = N'Discarded'
            GROUP BY u.subscription_id;

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

-- Pending or DeadLettered -> Discarded with the reason. InFlight -> cancel requested: the
-- holder's next heartbeat reports it and the delivery becomes Discarded when the holder settles
-- (or at lease expiry if the holder died). It is never retried. Error 51001 is PostgreSQL's
-- serialization_failure (the transport retries it).
-- returns: result, cancel_requested, delivery_status
CREATE OR ALTER PROCEDURE workqueue.discard
    @p_subscription nvarchar(200),
    @p_delivery_id bigint,
    @p_reason nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_found bit = 0;
    DECLARE @v_key_mode smallint;
    DECLARE @v_subscription_id int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_found bit;
    DECLARE @v_key_holder bigint;
    DECLARE @v_try int = 1;
    DECLARE @v_result nvarchar(20);
    DECLARE @v_cancel_requested bit = 0;
    DECLARE @v_status nvarchar(20);
    DECLARE @v_message nvarchar(2048);

    SELECT @v_found = 1, @v_key_mode = d.key_mode, @v_subscription_id = d.subscription_id,
           @v_key = d.partition_key
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    WHERE d.id = @p_delivery_id AND s.name = @p_subscription;
    IF @v_found = 0
        SET @v_result = N'NotFound';

    BEGIN TRY
        IF @v_found = 1
        BEGIN
            IF @v_own_transaction = 1
                BEGIN TRANSACTION;
            WHILE @v_result IS NULL AND @v_try <= 3
            BEGIN
                -- An InFlight delivery is only flagged: that needs no key lock.
                UPDATE workqueue.delivery
                SET cancel_requested = 1, reason = @p_reason
                WHERE id = @p_delivery_id AND status = N'InFlight';
                IF @@ROWCOUNT > 0
                BEGIN
                    SET @v_result = N'CancelRequested';
                    SET @v_cancel_requested = 1;
                    SET @v_status = N'InFlight';
                END
                ELSE
                BEGIN
                    IF @v_key_mode > 0
                    BEGIN
                        SET @v_key_found = 0;
                        SELECT @v_key_found = 1, @v_key_holder = p.holder_id
                        FROM workqueue.partition AS p WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                        WHERE p.subscription_id = @v_subscription_id AND p.partition_key = @v_key;
                        IF @v_key_found = 0
                            INSERT INTO workqueue.partition (subscription_id, partition_key)
                            VALUES (@v_subscription_id, @v_key);
                    END;
                    UPDATE workqueue.delivery
                    SET status = N'Discarded', reason = @p_reason, settled_at = @v_now, lease_token = NULL,
                        lease_expires_at = NULL
                    WHERE id = @p_delivery_id AND status IN (N'Pending', N'DeadLettered');
                    IF @@ROWCOUNT > 0
                    BEGIN
                        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
                        VALUES (@v_subscription_id, 0, 1);
                        -- (PostgreSQL notifies when the key became claimable; consumers poll here.)
                        IF @v_key_mode > 0
                            EXEC workqueue.refresh_partition
                                @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_key_mode;
                        SET @v_result = N'Discarded';
                        SET @v_status = N'Discarded';
                    END
                    ELSE
                    BEGIN
                        SELECT @v_status = d.status FROM workqueue.delivery AS d WHERE d.id = @p_delivery_id;
                        IF @v_status IN (N'Completed', N'Discarded')
                        BEGIN
                            IF @v_key_mode > 0
                                EXEC workqueue.refresh_partition
                                    @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_key_mode;
                            SET @v_result = N'AlreadyTerminal';
                        END;
                        -- Otherwise it was claimed between the two updates: go round again.
                    END;
                END;
                SET @v_try = @v_try + 1;
            END;
            IF @v_result IS NULL
            BEGIN
                SET @v_message = CONCAT(N'delivery ', @p_delivery_id, N' changed state while being discarded; retry');
                THROW 51001, @v_message, 1;
            END;
            IF @v_own_transaction = 1
                COMMIT TRANSACTION;
        END;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_result AS result, @v_cancel_requested AS cancel_requested, @v_status AS delivery_status;
END;
GO

-- Terminal deliveries past their subscription's retention, then messages that no delivery
-- references any more (kept as long as the longest retention of their topic, for duplicate
-- detection), then expired deduplication keys (READPAST: a producer taking an expired key over
-- holds its row until it commits; PostgreSQL 0019). Pending, InFlight and DeadLettered are never
-- purged.
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
    DECLARE @v_gone TABLE (
        subscription_id int NOT NULL,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
    );

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
            OUTPUT deleted.subscription_id, deleted.status INTO @v_gone (subscription_id, status)
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
            INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
            SELECT g.subscription_id, -SUM(CASE WHEN g.status = N'Completed' THEN CAST(1 AS bigint) ELSE 0 END),
                   -SUM(CASE WHEN g.status = N'Discarded' THEN CAST(1 AS bigint) ELSE 0 END)
            FROM @v_gone AS g
            GROUP BY g.subscription_id;
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
            FROM workqueue.deduplication AS dd WITH (UPDLOCK, READPAST, ROWLOCK)
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

-- Purges terminal deliveries (Completed, Discarded) settled more than @p_older_than_seconds ago,
-- whatever their subscription's retention, in batches; returns how many it removed. Used by
-- `workqueue prune`; the sweeper keeps applying each subscription's retention by itself. What it
-- removes is counted out of settled_count, whose rows it then folds (as the sweeper does).
-- returns: prune
CREATE OR ALTER PROCEDURE workqueue.prune
    @p_older_than_seconds float,
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_cutoff datetimeoffset(6);
    DECLARE @v_count int = 0;
    DECLARE @v_gone TABLE (
        subscription_id int NOT NULL,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL
    );
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SET @v_cutoff = DATEADD(
            microsecond, -CAST((@p_older_than_seconds - FLOOR(@p_older_than_seconds)) * 1000000 AS int),
            DATEADD(second, -CAST(FLOOR(@p_older_than_seconds) AS int), @v_now));
        DELETE FROM workqueue.delivery
        OUTPUT deleted.subscription_id, deleted.status INTO @v_gone (subscription_id, status)
        WHERE id IN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.delivery AS x
            WHERE x.status IN (N'Completed', N'Discarded') AND x.settled_at < @v_cutoff
            ORDER BY x.settled_at
        );
        SET @v_count = @@ROWCOUNT;
        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT g.subscription_id, -SUM(CASE WHEN g.status = N'Completed' THEN CAST(1 AS bigint) ELSE 0 END),
               -SUM(CASE WHEN g.status = N'Discarded' THEN CAST(1 AS bigint) ELSE 0 END)
        FROM @v_gone AS g
        GROUP BY g.subscription_id;
        EXEC workqueue.fold_settled_counts;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_count AS prune;
END;
GO

-- One sweeper pass. A transaction-owned application lock lets only one pass run at a time across
-- every process; a pass that finds the lock taken returns ran = 0 and does nothing. The lock is
-- released when the pass's transaction ends (PostgreSQL: pg_try_advisory_xact_lock). Expiry and
-- purge run as the procedures above (their one result set each is read with INSERT ... EXEC),
-- then the keys left stale are re-derived (PostgreSQL 0019), settled_count is folded (0022) and
-- expired once markers are dropped (not counted).
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
           @v_purged_deduplication AS purged_deduplication;
END;
GO
