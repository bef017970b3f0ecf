-- fastapi-workqueue: SQL Server, version 12: settles and sweeps never wait for a producer.
-- Mirrors sql/postgresql/0019 (whose header says why): release_keys and expire_leases lock the
-- keys' partition rows WITH (UPDLOCK, READPAST, ROWLOCK), SQL Server's SKIP LOCKED; a key another
-- transaction holds goes to the new table partition_stale, and rederive_stale re-derives it later,
-- called by the next claim of its subscription, the next settle of one of its keys and every
-- sweeper pass; purge and sweep skip the deduplication keys and once markers another transaction
-- holds. Redefines release_keys (0002), claim (0005), expire_leases and sweep (0006) and purge
-- (0010), with the same parameters and result columns. Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- Keys whose partition row a settle or lease expiry could not lock (another transaction held it):
-- their row may still name a settled holder until rederive_stale re-derives it. A heap with a
-- nonclustered primary key, as partition (0001): the key is too wide to cluster on.
CREATE TABLE workqueue.partition_stale (
    subscription_id  int NOT NULL,
    partition_key    nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
    key_mode         smallint NOT NULL,
    CONSTRAINT partition_stale_pk PRIMARY KEY NONCLUSTERED (subscription_id, partition_key)
);
GO

-- Re-derives (refresh_partition) up to @p_limit keys marked stale, of the subscriptions in
-- @p_subscription_ids (a JSON array; all when NULL), whose marker and partition row nobody else
-- holds (READPAST). A marker whose key has no row any more is dropped: a producer that creates
-- the row hands the key over itself. PostgreSQL returns the subscriptions that got a key claimable
-- now (to notify them); here the return status is the number of such keys, and no result set
-- (release_keys, claim and sweep call it; a result set would reach their client).
-- returns: return status
CREATE OR ALTER PROCEDURE workqueue.rederive_stale
    @p_subscription_ids nvarchar(max),
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_k int;
    DECLARE @v_k_count int;
    DECLARE @v_key_subscription int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_mode smallint;
    DECLARE @v_key_found bit;
    DECLARE @v_key_holder bigint;
    DECLARE @v_claimable int = 0;
    DECLARE @v_status int;
    DECLARE @v_marked TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL,
        free bit NOT NULL DEFAULT 0
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- The markers nobody else is writing or re-deriving (reading key_mode locks the row).
        INSERT INTO @v_marked (subscription_id, partition_key, key_mode)
        SELECT TOP (@p_limit) ps.subscription_id, ps.partition_key, ps.key_mode
        FROM workqueue.partition_stale AS ps WITH (UPDLOCK, READPAST, ROWLOCK)
        WHERE @p_subscription_ids IS NULL
           OR ps.subscription_id IN (SELECT CAST(a.value AS int) FROM OPENJSON(@p_subscription_ids) AS a)
        ORDER BY ps.subscription_id, ps.partition_key;
        SET @v_k_count = @@ROWCOUNT;

        -- Their partition rows, where no producer holds them, in key order.
        SET @v_k = 1;
        WHILE @v_k <= @v_k_count
        BEGIN
            SELECT @v_key_subscription = m.subscription_id, @v_key = m.partition_key
            FROM @v_marked AS m
            WHERE m.ord = @v_k;
            SET @v_key_found = 0;
            SELECT @v_key_found = 1, @v_key_holder = p.holder_id
            FROM workqueue.partition AS p WITH (UPDLOCK, READPAST, ROWLOCK)
            WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key;
            IF @v_key_found = 1
                UPDATE @v_marked SET free = 1 WHERE ord = @v_k;
            SET @v_k = @v_k + 1;
        END;

        -- Forget the markers before re-deriving: one written meanwhile waits for this transaction.
        DELETE ps
        FROM workqueue.partition_stale AS ps
        INNER JOIN @v_marked AS m
            ON m.subscription_id = ps.subscription_id AND m.partition_key = ps.partition_key
        WHERE m.free = 1 OR NOT EXISTS (
            SELECT 1 FROM workqueue.partition AS p
            WHERE p.subscription_id = m.subscription_id AND p.partition_key = m.partition_key
        );

        SET @v_k = 1;
        WHILE @v_k <= @v_k_count
        BEGIN
            SET @v_key = NULL;
            SELECT @v_key_subscription = m.subscription_id, @v_key = m.partition_key, @v_key_mode = m.key_mode
            FROM @v_marked AS m
            WHERE m.ord = @v_k AND m.free = 1;
            IF @v_key IS NOT NULL
            BEGIN
                EXEC @v_status = workqueue.refresh_partition
                    @p_subscription_id = @v_key_subscription, @p_key = @v_key, @p_mode = @v_key_mode;
                SET @v_claimable = @v_claimable + @v_status;
            END;
            SET @v_k = @v_k + 1;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    RETURN @v_claimable;
END;
GO

-- The keys of a batch of just-settled (or expired) deliveries (PostgreSQL 0019): the deliveries in
-- @p_ids (a JSON array of ids) give up their hold, and each key this call can lock without waiting
-- (READPAST) gets its next delivery (Exclusive: the earliest visible Pending one; Ordered: the
-- head, or the dead-lettered head that blocks it) in one UPDATE; keys left with nothing are
-- deleted. A key another transaction holds (a producer, most likely) is written to
-- partition_stale and re-derived later by rederive_stale. Then the stale keys of the same
-- subscriptions are re-derived where nobody holds them. Returns the subscriptions with a key that
-- can be claimed now (PostgreSQL notifies them).
-- returns: subscription_id
CREATE OR ALTER PROCEDURE workqueue.release_keys
    @p_ids nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6);
    DECLARE @v_k int;
    DECLARE @v_k_count int;
    DECLARE @v_key_subscription int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_holder bigint;
    DECLARE @v_key_found bit;
    DECLARE @v_key_mode smallint;
    DECLARE @v_subscriptions nvarchar(max);
    DECLARE @v_ids TABLE (id bigint NOT NULL PRIMARY KEY);
    DECLARE @v_keys TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL,
        held bit NOT NULL DEFAULT 0
    );
    DECLARE @v_updated TABLE (
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
        holder_id bigint NULL,
        next_id bigint NULL,
        next_visible_at datetimeoffset(6) NULL,
        blocked_id bigint NULL
    );

    INSERT INTO @v_ids (id)
    SELECT DISTINCT CAST(a.value AS bigint)
    FROM OPENJSON(@p_ids) AS a
    WHERE a.value IS NOT NULL;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        INSERT INTO @v_keys (subscription_id, partition_key, key_mode)
        SELECT DISTINCT d.subscription_id, d.partition_key, d.key_mode
        FROM workqueue.delivery AS d
        INNER JOIN @v_ids AS i ON i.id = d.id
        WHERE d.key_mode > 0
        ORDER BY d.subscription_id, d.partition_key;
        SET @v_k_count = @@ROWCOUNT;

        -- Lock the keys nobody else holds, in key order (reading holder_id locks the row itself;
        -- READPAST skips a row another transaction holds); the next statement then reads their
        -- deliveries after every publish that touched them committed. A key held elsewhere is
        -- marked stale: reading key_mode with UPDLOCK, HOLDLOCK locks an existing marker's row,
        -- where rederive_stale takes it, so a marker written while the key is being re-derived
        -- waits for that re-derivation and then stays.
        SET @v_k = 1;
        WHILE @v_k <= @v_k_count
        BEGIN
            SELECT @v_key_subscription = k.subscription_id, @v_key = k.partition_key, @v_key_mode = k.key_mode
            FROM @v_keys AS k
            WHERE k.ord = @v_k;
            SET @v_key_found = 0;
            SELECT @v_key_found = 1, @v_key_holder = p.holder_id
            FROM workqueue.partition AS p WITH (UPDLOCK, READPAST, ROWLOCK)
            WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key;
            IF @v_key_found = 1
                UPDATE @v_keys SET held = 1 WHERE ord = @v_k;
            ELSE
            BEGIN
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

        SET @v_now = SYSDATETIMEOFFSET();
        WITH state AS (
            SELECT k.subscription_id, k.partition_key, k.key_mode,
                   o.id AS head_id, o.status AS head_status, o.visible_at AS head_visible_at,
                   e.id AS next_pending_id, e.visible_at AS next_pending_visible_at
            FROM @v_keys AS k
            OUTER APPLY (
                SELECT TOP (1) d.id, d.status, d.visible_at
                FROM workqueue.delivery AS d
                WHERE k.key_mode = 2 AND d.subscription_id = k.subscription_id
                  AND d.partition_key = k.partition_key AND d.key_mode = 2
                  AND d.status IN (N'Pending', N'InFlight', N'DeadLettered')
                ORDER BY d.id
            ) AS o
            OUTER APPLY (
                SELECT TOP (1) d.id, d.visible_at
                FROM workqueue.delivery AS d
                WHERE k.key_mode = 1 AND d.subscription_id = k.subscription_id
                  AND d.partition_key = k.partition_key AND d.key_mode = 1 AND d.status = N'Pending'
                ORDER BY d.visible_at, d.id
            ) AS e
            WHERE k.held = 1
        ), n AS (
            SELECT s.subscription_id, s.partition_key, x.holder_id,
                   CASE WHEN x.holder_id IS NOT NULL THEN NULL
                        WHEN s.key_mode = 1 THEN s.next_pending_id
                        WHEN s.head_status = N'Pending' THEN s.head_id END AS next_id,
                   CASE WHEN x.holder_id IS NOT NULL THEN NULL
                        WHEN s.key_mode = 1 THEN s.next_pending_visible_at
                        WHEN s.head_status = N'Pending' THEN s.head_visible_at END AS next_visible_at,
                   CASE WHEN s.key_mode = 2 AND s.head_status = N'DeadLettered' THEN s.head_id END AS blocked_id
            FROM state AS s
            INNER JOIN workqueue.partition AS cur
                ON cur.subscription_id = s.subscription_id AND cur.partition_key = s.partition_key
            CROSS APPLY (
                SELECT CASE WHEN s.key_mode = 2 AND s.head_status = N'InFlight' THEN s.head_id
                            WHEN EXISTS (SELECT 1 FROM @v_ids AS i WHERE i.id = cur.holder_id) THEN NULL
                            ELSE cur.holder_id END AS holder_id
            ) AS x
        )
        UPDATE p
        SET holder_id = n.holder_id, next_id = n.next_id, next_visible_at = n.next_visible_at,
            blocked_id = n.blocked_id
        OUTPUT inserted.subscription_id, inserted.partition_key, inserted.holder_id, inserted.next_id,
               inserted.next_visible_at, inserted.blocked_id
        INTO @v_updated (subscription_id, partition_key, holder_id, next_id, next_visible_at, blocked_id)
        FROM workqueue.partition AS p
        INNER JOIN n ON p.subscription_id = n.subscription_id AND p.partition_key = n.partition_key;

        DELETE p
        FROM workqueue.partition AS p
        INNER JOIN @v_updated AS u ON p.subscription_id = u.subscription_id AND p.partition_key = u.partition_key
        WHERE u.holder_id IS NULL AND u.next_id IS NULL AND u.blocked_id IS NULL;

        -- The next settle of a subscription also re-derives its keys that earlier ones left stale.
        IF EXISTS (
            SELECT 1 FROM workqueue.partition_stale AS ps
            WHERE ps.subscription_id IN (SELECT k.subscription_id FROM @v_keys AS k)
        )
        BEGIN
            SELECT @v_subscriptions = N'[' + STRING_AGG(CAST(s.subscription_id AS nvarchar(max)), N',') + N']'
            FROM (SELECT DISTINCT k.subscription_id FROM @v_keys AS k) AS s;
            EXEC workqueue.rederive_stale @p_subscription_ids = @v_subscriptions, @p_limit = 100;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT DISTINCT u.subscription_id
    FROM @v_updated AS u
    WHERE u.holder_id IS NULL AND u.next_id IS NOT NULL AND u.next_visible_at <= @v_now;
END;
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
    DECLARE @v_subscriptions nvarchar(max);
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
                -- Keys a settle or the sweeper could not hand over (their producer held them) are
                -- re-derived first, where nobody holds them now (PostgreSQL 0019).
                IF EXISTS (SELECT 1 FROM workqueue.partition_stale AS ps WHERE ps.subscription_id = @v_subscription_id)
                BEGIN
                    SET @v_subscriptions = N'[' + CAST(@v_subscription_id AS nvarchar(20)) + N']';
                    EXEC workqueue.rederive_stale @p_subscription_ids = @v_subscriptions, @p_limit = @p_limit;
                END;
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

-- One sweeper pass. A transaction-owned application lock lets only one pass run at a time across
-- every process; a pass that finds the lock taken returns ran = 0 and does nothing. The lock is
-- released when the pass's transaction ends (PostgreSQL: pg_try_advisory_xact_lock). Expiry and
-- purge run as the procedures above (their one result set each is read with INSERT ... EXEC),
-- then the keys left stale are re-derived (PostgreSQL 0019) and expired once markers are dropped
-- (not counted).
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
