-- fastapi-workqueue: SQL Server helpers, version 2: backoff, the filter evaluator, and the
-- re-derivation of keys' partition rows. Mirrors backoff_seconds, filter_matches and
-- refresh_partition of sql/postgresql/0002_operations.sql and release_keys of
-- 0007_release_keys.sql: same names, same parameters.
--
-- Conventions of every procedure in 0002-0008:
--   * SET NOCOUNT ON (no row-count messages reach the client) and, where it writes,
--     SET XACT_ABORT ON with TRY/CATCH/THROW: any error rolls the whole call back.
--   * A procedure opens its own transaction only when none is open (@@TRANCOUNT = 0). Called
--     inside a caller's transaction (publish in the application's own transaction, or one
--     procedure calling another) it joins that transaction, as a PostgreSQL function does.
--   * One result set per call for the routines that return rows, also when it is empty; its
--     columns are named as PostgreSQL's RETURNS TABLE (the "-- returns:" line above each
--     procedure). A scalar function's value comes back as one row with one column named after
--     the routine, as "SELECT * FROM workqueue.<routine>(...)" answers on PostgreSQL.
--   * Arrays are JSON arrays in nvarchar(max); "[key]" of OPENJSON is the 0-based position.
--   * Text comparisons between variables use COLLATE Latin1_General_100_BIN2 (case-sensitive,
--     as on PostgreSQL); comparisons with a column use the column's binary collation.
--   * No LISTEN/NOTIFY: where PostgreSQL calls pg_notify, consumers on SQL Server poll.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- One uniform draw in [0, 1) per query. A function may not call RAND() itself (a side-effecting
-- operator); reading it through a view gives every call of backoff_seconds a draw of its own.
CREATE OR ALTER VIEW workqueue.random_draw
AS
SELECT RAND() AS value;
GO

-- Full-jitter exponential backoff, or the fixed schedule a delivery was published with (a JSON
-- array of seconds). INLINE = OFF: an inlined call would read the view once per statement and
-- give every row of a settle the same delay. The exponent is capped at 64, far above any
-- backoff_max_seconds, so a very high attempt number cannot overflow the float.
-- returns: backoff_seconds
CREATE OR ALTER FUNCTION workqueue.backoff_seconds (
    @p_attempt int,
    @p_base float,
    @p_max float,
    @p_schedule nvarchar(max)
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

    SELECT @v_draw = r.value FROM workqueue.random_draw AS r;
    SET @v_exponent = CASE WHEN @p_attempt > 1 THEN @p_attempt - 1 ELSE 0 END;
    IF @v_exponent > 64
        SET @v_exponent = 64;
    SET @v_cap = @p_base * POWER(CAST(2 AS float), @v_exponent);
    RETURN @v_draw * CASE WHEN @p_max < @v_cap THEN @p_max ELSE @v_cap END;
END;
GO

-- The filter subset: {"field","operator","value"} leaves with eq, neq, startswith, isnull,
-- isnotnull, combined by {"logic": "and"|"or", "filters": [...]}. Case-sensitive, and exact: two
-- strings that differ only by trailing spaces differ here too (DATALENGTH is compared, since
-- SQL Server's = ignores trailing spaces). An attribute that is absent matches only isnull.
-- Validation of the allowed shape happens when a subscription is saved; this only evaluates.
-- returns: filter_matches
CREATE OR ALTER FUNCTION workqueue.filter_matches (
    @p_filter nvarchar(max),
    @p_attributes nvarchar(max)
)
RETURNS bit
AS
BEGIN
    DECLARE @v_has_filters int = 0;
    DECLARE @v_logic nvarchar(max);
    DECLARE @v_field nvarchar(max);
    DECLARE @v_operator nvarchar(max);
    DECLARE @v_expected nvarchar(max);
    DECLARE @v_value nvarchar(max);
    DECLARE @v_prefix nvarchar(max);

    IF @p_filter IS NULL OR LTRIM(RTRIM(@p_filter)) = N'null'
        RETURN 1;

    -- The members of the filter object (OPENJSON's [key] compares in a binary collation).
    SELECT @v_has_filters = 1 FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'filters';
    SELECT @v_logic = f.value FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'logic';
    SELECT @v_field = f.value FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'field';
    SELECT @v_operator = f.value FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'operator';
    SELECT @v_expected = f.value FROM OPENJSON(@p_filter) AS f WHERE f.[key] = N'value';

    IF @v_has_filters = 1
    BEGIN
        SET @v_logic = COALESCE(@v_logic, N'and');
        IF @v_logic = N'or' COLLATE Latin1_General_100_BIN2
            RETURN CASE
                WHEN EXISTS (
                    SELECT 1 FROM OPENJSON(@p_filter, N'$.filters') AS c
                    WHERE workqueue.filter_matches(c.value, @p_attributes) = 1
                ) THEN 1
                ELSE 0
            END;
        IF @v_logic = N'and' COLLATE Latin1_General_100_BIN2
            RETURN CASE
                WHEN EXISTS (
                    SELECT 1 FROM OPENJSON(@p_filter, N'$.filters') AS c
                    WHERE workqueue.filter_matches(c.value, @p_attributes) = 0
                ) THEN 0
                ELSE 1
            END;
        RETURN 0;
    END;

    SELECT @v_value = a.value
    FROM OPENJSON(COALESCE(@p_attributes, N'{}')) AS a
    WHERE a.[key] = @v_field COLLATE Latin1_General_100_BIN2
      AND DATALENGTH(a.[key]) = DATALENGTH(@v_field);

    SET @v_prefix = LEFT(@v_value, LEN(@v_expected + N'.') - 1);
    RETURN CASE @v_operator COLLATE Latin1_General_100_BIN2
        WHEN N'eq' THEN CASE
            WHEN @v_value IS NOT NULL AND @v_expected IS NOT NULL
                 AND @v_value = @v_expected COLLATE Latin1_General_100_BIN2
                 AND DATALENGTH(@v_value) = DATALENGTH(@v_expected) THEN 1
            ELSE 0
        END
        WHEN N'neq' THEN CASE
            WHEN @v_value IS NOT NULL AND @v_expected IS NOT NULL
                 AND NOT (@v_value = @v_expected COLLATE Latin1_General_100_BIN2
                          AND DATALENGTH(@v_value) = DATALENGTH(@v_expected)) THEN 1
            ELSE 0
        END
        WHEN N'startswith' THEN CASE
            WHEN @v_value IS NOT NULL AND @v_expected IS NOT NULL
                 AND @v_prefix = @v_expected COLLATE Latin1_General_100_BIN2
                 AND DATALENGTH(@v_prefix) = DATALENGTH(@v_expected) THEN 1
            ELSE 0
        END
        WHEN N'isnull' THEN CASE WHEN @v_value IS NULL THEN 1 ELSE 0 END
        WHEN N'isnotnull' THEN CASE WHEN @v_value IS NOT NULL THEN 1 ELSE 0 END
        ELSE 0
    END;
END;
GO

-- Re-derives the state of one key from its deliveries: the holder, the next delivery to claim
-- and (Ordered) the dead-lettered head that blocks it. Deletes the row of a key with no live work.
-- The caller must already hold the locks of the deliveries it changed.
--
-- PostgreSQL returns a boolean (true when the key can be claimed right now). Here it is the
-- procedure's return status (1 or 0) and no result set: the procedures that call it
-- (expire_leases, replay, discard, claim) would otherwise send that result set to their client.
-- returns: return status
CREATE OR ALTER PROCEDURE workqueue.refresh_partition
    @p_subscription_id int,
    @p_key nvarchar(512),
    @p_mode smallint
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_found bit = 0;
    DECLARE @v_holder bigint;
    DECLARE @v_next bigint;
    DECLARE @v_next_visible datetimeoffset(6);
    DECLARE @v_blocked bigint;
    DECLARE @v_head_id bigint;
    DECLARE @v_head_status nvarchar(20);
    DECLARE @v_head_visible datetimeoffset(6);
    DECLARE @v_claimable int = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- Lock the key's row, creating it where needed (HOLDLOCK also locks an absent key).
        SELECT @v_found = 1, @v_holder = p.holder_id
        FROM workqueue.partition AS p WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
        WHERE p.subscription_id = @p_subscription_id AND p.partition_key = @p_key;
        IF @v_found = 0
            INSERT INTO workqueue.partition (subscription_id, partition_key)
            VALUES (@p_subscription_id, @p_key);

        IF @v_holder IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM workqueue.delivery AS d WHERE d.id = @v_holder AND d.status = N'InFlight'
        )
            SET @v_holder = NULL;

        IF @p_mode = 2
        BEGIN
            SELECT TOP (1) @v_head_id = d.id, @v_head_status = d.status, @v_head_visible = d.visible_at
            FROM workqueue.delivery AS d
            WHERE d.subscription_id = @p_subscription_id AND d.partition_key = @p_key AND d.key_mode = 2
              AND d.status IN (N'Pending', N'InFlight', N'DeadLettered')
            ORDER BY d.id;
            IF @v_head_id IS NOT NULL
            BEGIN
                IF @v_head_status = N'InFlight' COLLATE Latin1_General_100_BIN2
                    SET @v_holder = @v_head_id;
                ELSE IF @v_head_status = N'DeadLettered' COLLATE Latin1_General_100_BIN2
                    SET @v_blocked = @v_head_id;
                ELSE IF @v_holder IS NULL
                BEGIN
                    SET @v_next = @v_head_id;
                    SET @v_next_visible = @v_head_visible;
                END;
            END;
        END
        ELSE IF @v_holder IS NULL
            SELECT TOP (1) @v_next = d.id, @v_next_visible = d.visible_at
            FROM workqueue.delivery AS d
            WHERE d.subscription_id = @p_subscription_id AND d.partition_key = @p_key AND d.key_mode = 1
              AND d.status = N'Pending'
            ORDER BY d.visible_at, d.id;

        IF @v_holder IS NULL AND @v_next IS NULL AND @v_blocked IS NULL
            DELETE FROM workqueue.partition
            WHERE subscription_id = @p_subscription_id AND partition_key = @p_key;
        ELSE
        BEGIN
            UPDATE workqueue.partition
            SET holder_id = @v_holder, next_id = @v_next, next_visible_at = @v_next_visible,
                blocked_id = @v_blocked
            WHERE subscription_id = @p_subscription_id AND partition_key = @p_key;
            IF @v_holder IS NULL AND @v_next IS NOT NULL AND @v_next_visible <= @v_now
                SET @v_claimable = 1;
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

-- The keys of a batch of just-settled (or expired) deliveries, freed at once (PostgreSQL 0007):
-- the deliveries in @p_ids (a JSON array of ids) give up their hold, and each of their keys gets
-- its next delivery (Exclusive: the earliest visible Pending one; Ordered: the head, or the
-- dead-lettered head that blocks it) in one UPDATE, after the keys are locked one at a time in key
-- order; keys left with nothing are deleted. Same results as refresh_partition, key by key.
-- Returns the subscriptions with a key that can be claimed now (PostgreSQL notifies them).
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
    DECLARE @v_ids TABLE (id bigint NOT NULL PRIMARY KEY);
    DECLARE @v_keys TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_mode smallint NOT NULL
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

        -- Lock the keys first, in key order (reading holder_id locks the row itself); the next
        -- statement then reads their deliveries after every publish that touched them committed.
        SET @v_k = 1;
        WHILE @v_k <= @v_k_count
        BEGIN
            SELECT @v_key_subscription = k.subscription_id, @v_key = k.partition_key
            FROM @v_keys AS k
            WHERE k.ord = @v_k;
            SELECT @v_key_holder = p.holder_id
            FROM workqueue.partition AS p WITH (UPDLOCK, ROWLOCK)
            WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key;
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
