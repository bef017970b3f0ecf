-- fastapi-workqueue: SQL Server consume, version 5: claim, heartbeat, settle (release is a settle
-- with the outcome 'Release'). Mirrors the current PostgreSQL definitions: claim and heartbeat of
-- sql/postgresql/0004_hot_paths.sql, settle of 0007_release_keys.sql (same parameters and result
-- columns; conventions: top of 0002_helpers.sql).
--
-- Lock order, as on PostgreSQL: a partition row before a Pending or DeadLettered delivery of its
-- key. Settle locks its InFlight deliveries first (in id order) and then the partition rows (in
-- key order); a claim never waits for an InFlight delivery, so no cycle forms.
--
-- PostgreSQL's FOR UPDATE SKIP LOCKED is WITH (UPDLOCK, READPAST, ROWLOCK). SQL Server locks index
-- entries rather than logical rows, so every locking read here also reads a column that its
-- index does not cover: the read then locks the row itself, which is where settle, discard,
-- publish and the sweeper take their locks (see partition_ready in 0001).

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- Claims up to @p_limit visible deliveries of an Active subscription: attempt + 1, a fresh lease
-- token, the lease from the subscription's current lease_seconds. Keys of Exclusive and Ordered
-- subscriptions are claimed through their partition row, one delivery per key; deliveries
-- without a key share the claim with the keys, so neither side can take every slot.
-- returns: delivery_id, lease_token, attempt, max_attempts, lease_expires_at, message_id, topic, partition_key, attributes, payload, payload_ref, correlation_id, published_at
CREATE OR ALTER PROCEDURE workqueue.claim
    @p_subscription nvarchar(200),
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_subscription_id int;
    DECLARE @v_partition_mode nvarchar(20);
    DECLARE @v_lease_seconds float;
    DECLARE @v_lease_expires_at datetimeoffset(6);
    DECLARE @v_mode smallint;
    DECLARE @v_keyed_count int = 0;
    DECLARE @v_unkeyed_count int = 0;
    DECLARE @v_share int;
    DECLARE @v_wanted int;
    DECLARE @v_got int = 0;
    DECLARE @v_ord int = 0;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_keyed TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        next_id bigint NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL
    );
    DECLARE @v_unkeyed TABLE (id bigint NOT NULL PRIMARY KEY, message_id uniqueidentifier NOT NULL);
    DECLARE @v_ids TABLE (id bigint NOT NULL PRIMARY KEY);
    DECLARE @v_claimed TABLE (
        id bigint NOT NULL PRIMARY KEY,
        lease_token uniqueidentifier NOT NULL,
        attempt int NOT NULL,
        max_attempts int NOT NULL,
        lease_expires_at datetimeoffset(6) NOT NULL,
        message_id uniqueidentifier NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        key_mode smallint NOT NULL
    );

    SELECT @v_subscription_id = s.id, @v_partition_mode = s.partition_mode, @v_lease_seconds = s.lease_seconds
    FROM workqueue.subscription AS s
    INNER JOIN workqueue.topic AS t ON t.name = s.topic
    WHERE s.name = @p_subscription AND s.status = N'Active' AND t.status = N'Active';

    BEGIN TRY
        IF @v_subscription_id IS NOT NULL AND @p_limit >= 1
        BEGIN
            IF @v_own_transaction = 1
                BEGIN TRANSACTION;
            SET @v_lease_expires_at = DATEADD(
                microsecond, CAST((@v_lease_seconds - FLOOR(@v_lease_seconds)) * 1000000 AS int),
                DATEADD(second, CAST(FLOOR(@v_lease_seconds) AS int), @v_now));
            SET @v_mode = CASE WHEN @v_partition_mode = N'Exclusive' COLLATE Latin1_General_100_BIN2 THEN 1 ELSE 2 END;

            IF @v_partition_mode <> N'None' COLLATE Latin1_General_100_BIN2
            BEGIN
                -- Keys that can run now: their partition row is the lock.
                INSERT INTO @v_keyed (next_id, partition_key)
                SELECT TOP (@p_limit) pt.next_id, pt.partition_key
                FROM workqueue.partition AS pt WITH (UPDLOCK, READPAST, ROWLOCK)
                WHERE pt.subscription_id = @v_subscription_id AND pt.holder_id IS NULL
                  AND pt.next_id IS NOT NULL AND pt.next_visible_at <= @v_now
                ORDER BY pt.next_visible_at;
                SET @v_keyed_count = @@ROWCOUNT;
            END;

            -- Deliveries without a key lock (None mode, or no partition key).
            SET @v_share = CASE
                WHEN @v_keyed_count = 0 THEN @p_limit
                WHEN @p_limit - @v_keyed_count > @p_limit / 2 THEN @p_limit - @v_keyed_count
                ELSE @p_limit / 2
            END;
            INSERT INTO @v_unkeyed (id, message_id)
            SELECT TOP (@v_share) d.id, d.message_id
            FROM workqueue.delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
            WHERE d.subscription_id = @v_subscription_id AND d.status = N'Pending' AND d.key_mode = 0
              AND d.visible_at <= @v_now
            ORDER BY d.visible_at, d.id;
            SET @v_unkeyed_count = @@ROWCOUNT;

            IF @v_keyed_count > 0 AND @v_unkeyed_count > 0 AND @v_keyed_count + @v_unkeyed_count > @p_limit
            BEGIN
                DELETE FROM @v_keyed WHERE ord > @p_limit - @v_unkeyed_count;
                SET @v_keyed_count = @p_limit - @v_unkeyed_count;
            END;

            INSERT INTO @v_ids (id)
            SELECT k.next_id FROM @v_keyed AS k
            UNION
            SELECT u.id FROM @v_unkeyed AS u;
            SET @v_wanted = @@ROWCOUNT;

            IF @v_wanted > 0
            BEGIN
                UPDATE d
                SET status = N'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
                    lease_token = NEWID(), lease_expires_at = @v_lease_expires_at, claimed_at = @v_now,
                    progress_percent = NULL, progress_message = NULL
                OUTPUT inserted.id, inserted.lease_token, inserted.attempt, inserted.max_attempts,
                       inserted.lease_expires_at, inserted.message_id, inserted.partition_key, inserted.key_mode
                INTO @v_claimed (id, lease_token, attempt, max_attempts, lease_expires_at, message_id,
                                 partition_key, key_mode)
                FROM workqueue.delivery AS d
                INNER JOIN @v_ids AS x ON x.id = d.id
                WHERE d.status = N'Pending';
                SET @v_got = @@ROWCOUNT;

                UPDATE pt
                SET holder_id = c.id, next_id = NULL, next_visible_at = NULL
                FROM workqueue.partition AS pt
                INNER JOIN @v_claimed AS c
                    ON pt.subscription_id = @v_subscription_id AND pt.partition_key = c.partition_key
                WHERE c.key_mode > 0
                  AND pt.partition_key IN (SELECT k.partition_key FROM @v_keyed AS k);

                IF @v_got < @v_wanted AND @v_keyed_count > 0
                BEGIN
                    -- A key pointed at a delivery that was no longer Pending: re-derive those keys.
                    WHILE 1 = 1
                    BEGIN
                        SET @v_key = NULL;
                        SELECT TOP (1) @v_ord = k.ord, @v_key = k.partition_key
                        FROM @v_keyed AS k
                        WHERE k.ord > @v_ord
                        ORDER BY k.ord;
                        IF @v_key IS NULL
                            BREAK;
                        IF EXISTS (
                            SELECT 1 FROM workqueue.partition AS pt
                            WHERE pt.subscription_id = @v_subscription_id AND pt.partition_key = @v_key
                              AND pt.holder_id IS NULL
                        )
                            EXEC workqueue.refresh_partition
                                @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_mode;
                    END;
                END;
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
    SELECT c.id AS delivery_id, c.lease_token, c.attempt, c.max_attempts, c.lease_expires_at,
           m.id AS message_id, m.topic, m.partition_key, m.attributes, m.payload, m.payload_ref,
           m.correlation_id, m.published_at
    FROM @v_claimed AS c
    INNER JOIN workqueue.message AS m ON m.id = c.message_id
    ORDER BY c.id;
END;
GO

-- Renews the leases of the given deliveries and stores their progress. alive is false once the
-- token is stale (the lease was lost) or an operator asked to cancel; a cancelled delivery's
-- lease is not renewed, so a holder that ignores the cancel loses it.
-- returns: delivery_id, alive, cancel_requested, lease_expires_at
CREATE OR ALTER PROCEDURE workqueue.heartbeat
    @p_ids nvarchar(max),
    @p_tokens nvarchar(max),
    @p_percents nvarchar(max),
    @p_messages nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_i TABLE (
        ord int NOT NULL PRIMARY KEY,
        id bigint NULL,
        token uniqueidentifier NULL,
        pct smallint NULL,
        msg nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
    );
    DECLARE @v_u TABLE (
        id bigint NOT NULL PRIMARY KEY,
        cancel_requested bit NOT NULL,
        lease_expires_at datetimeoffset(6) NULL
    );

    INSERT INTO @v_i (ord, id, token, pct, msg)
    SELECT CAST(a.[key] AS int), CAST(a.value AS bigint), TRY_CAST(b.value AS uniqueidentifier),
           CAST(c.value AS smallint), e.value
    FROM OPENJSON(@p_ids) AS a
    LEFT JOIN OPENJSON(@p_tokens) AS b ON b.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_percents) AS c ON c.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_messages) AS e ON e.[key] = a.[key];

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        UPDATE d
        SET lease_expires_at = CASE
                WHEN d.cancel_requested = 1 THEN d.lease_expires_at
                ELSE DATEADD(
                    microsecond, CAST((s.lease_seconds - FLOOR(s.lease_seconds)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(s.lease_seconds) AS int), @v_now))
            END,
            progress_percent = COALESCE(i.pct, d.progress_percent),
            progress_message = COALESCE(i.msg, d.progress_message)
        OUTPUT inserted.id, inserted.cancel_requested, inserted.lease_expires_at
        INTO @v_u (id, cancel_requested, lease_expires_at)
        FROM workqueue.delivery AS d
        INNER JOIN @v_i AS i ON i.id = d.id AND i.token = d.lease_token
        INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
        WHERE d.status = N'InFlight';
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT i.id AS delivery_id,
           CAST(CASE WHEN u.id IS NOT NULL AND u.cancel_requested = 0 THEN 1 ELSE 0 END AS bit) AS alive,
           CAST(COALESCE(u.cancel_requested, 0) AS bit) AS cancel_requested,
           u.lease_expires_at
    FROM @v_i AS i
    LEFT JOIN @v_u AS u ON u.id = i.id
    ORDER BY i.ord;
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
    @p_errors nvarchar(max)
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
        error nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
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

    INSERT INTO @v_i (ord, id, token, outcome, delay, reason, error)
    SELECT CAST(a.[key] AS int), CAST(a.value AS bigint), TRY_CAST(b.value AS uniqueidentifier),
           c.value, CAST(e.value AS float), f.value, g.value
    FROM OPENJSON(@p_ids) AS a
    LEFT JOIN OPENJSON(@p_tokens) AS b ON b.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_outcomes) AS c ON c.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_delays) AS e ON e.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_reasons) AS f ON f.[key] = a.[key]
    LEFT JOIN OPENJSON(@p_errors) AS g ON g.[key] = a.[key];

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

        INSERT INTO @v_plan (id, outcome, delay, reason, error, cancel_requested, new_status)
        SELECT l.id, i.outcome, i.delay, i.reason, i.error, l.cancel_requested,
               CASE WHEN l.cancel_requested = 1 THEN N'Discarded'
                    WHEN i.outcome = N'Complete' THEN N'Completed'
                    WHEN i.outcome = N'Release' THEN N'Pending'
                    WHEN i.outcome = N'DeadLetter' THEN N'DeadLettered'
                    WHEN l.attempt >= l.max_attempts THEN N'DeadLettered'
                    ELSE N'Pending' END
        FROM @v_locked AS l
        CROSS APPLY (
            SELECT TOP (1) x.outcome, x.delay, x.reason, x.error
            FROM @v_i AS x
            WHERE x.id = l.id AND x.token = l.lease_token
            ORDER BY x.ord
        ) AS i;

        -- The wait before a Pending delivery is visible again, drawn once per delivery.
        UPDATE p
        SET wait_seconds = CASE
                WHEN p.new_status <> N'Pending' THEN NULL
                WHEN p.outcome = N'Release' THEN COALESCE(p.delay, 0)
                WHEN p.delay IS NOT NULL THEN p.delay
                ELSE workqueue.backoff_seconds(l.attempt, l.backoff_base_seconds, l.backoff_max_seconds,
                                               l.backoff_schedule)
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

        -- Free the keys of the settled deliveries, all at once (release_keys locks them in key
        -- order). Its result, the subscriptions with a key claimable now, is what PostgreSQL
        -- notifies; consumers poll here, so it is only read to keep it from the client.
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
