-- fastapi-workqueue: SQL Server operator actions and reads, version 7. Mirrors replay, discard,
-- stats, backlog, get_delivery, list_deliveries and partitions of
-- sql/postgresql/0002_operations.sql (conventions: top of 0002_helpers.sql). The reads run under
-- READ_COMMITTED_SNAPSHOT (see validate-bindings): they read the last committed rows and never
-- wait for a claim or a publish.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- DeadLettered -> Pending with the same MessageID and the same place in its Ordered key,
-- attempts reset, the operator's note kept.
-- returns: result, delivery_status
CREATE OR ALTER PROCEDURE workqueue.replay
    @p_subscription nvarchar(200),
    @p_delivery_id bigint,
    @p_note nvarchar(max)
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
    DECLARE @v_key_found bit = 0;
    DECLARE @v_key_holder bigint;
    DECLARE @v_result nvarchar(20) = N'NotFound';
    DECLARE @v_status nvarchar(20);

    SELECT @v_found = 1, @v_key_mode = d.key_mode, @v_subscription_id = d.subscription_id,
           @v_key = d.partition_key
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    WHERE d.id = @p_delivery_id AND s.name = @p_subscription;

    BEGIN TRY
        IF @v_found = 1
        BEGIN
            IF @v_own_transaction = 1
                BEGIN TRANSACTION;
            IF @v_key_mode > 0
            BEGIN
                -- The key's row first (lock order), created where needed.
                SELECT @v_key_found = 1, @v_key_holder = p.holder_id
                FROM workqueue.partition AS p WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                WHERE p.subscription_id = @v_subscription_id AND p.partition_key = @v_key;
                IF @v_key_found = 0
                    INSERT INTO workqueue.partition (subscription_id, partition_key)
                    VALUES (@v_subscription_id, @v_key);
            END;

            UPDATE workqueue.delivery
            SET status = N'Pending', attempt = 0, visible_at = @v_now, note = @p_note, reason = NULL,
                settled_at = NULL, cancel_requested = 0
            WHERE id = @p_delivery_id AND status = N'DeadLettered';

            IF @@ROWCOUNT = 0
            BEGIN
                IF @v_key_mode > 0
                    EXEC workqueue.refresh_partition
                        @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_key_mode;
                SELECT @v_status = d.status FROM workqueue.delivery AS d WHERE d.id = @p_delivery_id;
                SET @v_result = N'NotDeadLettered';
            END
            ELSE
            BEGIN
                -- (PostgreSQL notifies when the delivery is claimable now; consumers poll here.)
                IF @v_key_mode > 0
                    EXEC workqueue.refresh_partition
                        @p_subscription_id = @v_subscription_id, @p_key = @v_key, @p_mode = @v_key_mode;
                SET @v_result = N'Replayed';
                SET @v_status = N'Pending';
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
    SELECT @v_result AS result, @v_status AS delivery_status;
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

-- returns: subscription, topic, subscription_status, partition_mode, pending, claimable, in_flight, dead_lettered, completed, discarded, oldest_pending_at
CREATE OR ALTER PROCEDURE workqueue.stats
    @p_subscription nvarchar(200) = NULL
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT s.name AS subscription, s.topic, s.status AS subscription_status, s.partition_mode,
           COALESCE(c.pending, 0) AS pending, COALESCE(cl.claimable, 0) AS claimable,
           COALESCE(c.in_flight, 0) AS in_flight, COALESCE(c.dead_lettered, 0) AS dead_lettered,
           COALESCE(c.completed, 0) AS completed, COALESCE(c.discarded, 0) AS discarded,
           c.oldest_pending_at
    FROM workqueue.subscription AS s
    OUTER APPLY (
        SELECT SUM(CASE WHEN d.status = N'Pending' THEN CAST(1 AS bigint) ELSE 0 END) AS pending,
               SUM(CASE WHEN d.status = N'InFlight' THEN CAST(1 AS bigint) ELSE 0 END) AS in_flight,
               SUM(CASE WHEN d.status = N'DeadLettered' THEN CAST(1 AS bigint) ELSE 0 END) AS dead_lettered,
               SUM(CASE WHEN d.status = N'Completed' THEN CAST(1 AS bigint) ELSE 0 END) AS completed,
               SUM(CASE WHEN d.status = N'Discarded' THEN CAST(1 AS bigint) ELSE 0 END) AS discarded,
               (SELECT MIN(o.created_at) FROM workqueue.delivery AS o
                WHERE o.subscription_id = s.id AND o.status = N'Pending') AS oldest_pending_at
        FROM workqueue.delivery AS d
        WHERE d.subscription_id = s.id
    ) AS c
    OUTER APPLY (
        SELECT (SELECT COUNT_BIG(*) FROM workqueue.delivery AS d
                WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.visible_at <= @v_now)
             + (SELECT COUNT_BIG(*) FROM workqueue.partition AS p
                WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                  AND p.next_visible_at <= @v_now) AS claimable
    ) AS cl
    WHERE @p_subscription IS NULL OR s.name = @p_subscription
    ORDER BY s.name;
END;
GO

-- Backlog for autoscalers: claimable Pending (single flight per key applied) plus InFlight. A
-- paused subscription has nothing claimable.
-- returns: subscription, claimable, in_flight, backlog
CREATE OR ALTER PROCEDURE workqueue.backlog
    @p_subscription nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    WITH s AS (
        SELECT s.id, s.name,
               CASE WHEN s.status = N'Active' AND t.status = N'Active' THEN 1 ELSE 0 END AS active
        FROM workqueue.subscription AS s
        INNER JOIN workqueue.topic AS t ON t.name = s.topic
        WHERE s.name = @p_subscription
    ), n AS (
        SELECT s.name,
               CASE WHEN s.active = 1 THEN
                   (SELECT COUNT_BIG(*) FROM workqueue.delivery AS d
                    WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
                      AND d.visible_at <= @v_now)
                 + (SELECT COUNT_BIG(*) FROM workqueue.partition AS p
                    WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                      AND p.next_visible_at <= @v_now)
               ELSE CAST(0 AS bigint) END AS claimable,
               (SELECT COUNT_BIG(*) FROM workqueue.delivery AS d
                WHERE d.subscription_id = s.id AND d.status = N'InFlight') AS in_flight
        FROM s
    )
    SELECT n.name AS subscription, n.claimable, n.in_flight, n.claimable + n.in_flight AS backlog
    FROM n;
END;
GO

-- returns: delivery_id, subscription, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id
CREATE OR ALTER PROCEDURE workqueue.get_delivery
    @p_delivery_id bigint
AS
BEGIN
    SET NOCOUNT ON;
    SELECT d.id AS delivery_id, s.name AS subscription, d.message_id, m.topic, d.partition_key,
           d.status, d.attempt, d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    WHERE d.id = @p_delivery_id;
END;
GO

-- Deliveries of one subscription in one state, oldest first, paged by id.
-- returns: delivery_id, message_id, partition_key, status, attempt, max_attempts, reason, last_error, note, created_at, settled_at, attributes, payload, correlation_id
CREATE OR ALTER PROCEDURE workqueue.list_deliveries
    @p_subscription nvarchar(200),
    @p_status nvarchar(20),
    @p_limit int,
    @p_after_id bigint = 0
AS
BEGIN
    SET NOCOUNT ON;
    SELECT TOP (@p_limit)
           d.id AS delivery_id, d.message_id, d.partition_key, d.status, d.attempt, d.max_attempts,
           d.reason, d.last_error, d.note, d.created_at, d.settled_at, m.attributes, m.payload,
           m.correlation_id
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    WHERE s.name = @p_subscription AND d.status = @p_status AND d.id > COALESCE(@p_after_id, 0)
    ORDER BY d.id;
END;
GO

-- Keys of an Exclusive or Ordered subscription with live work. condition: InFlight (a delivery
-- of the key is running), Blocked (Ordered: the head is dead-lettered, or waiting to be retried),
-- Idle (waiting work, nothing running, not blocked). Keys sort in binary (code point) order.
-- returns: partition_key, condition, head_delivery_id, head_status, head_attempt, head_visible_at, waiting_items
CREATE OR ALTER PROCEDURE workqueue.partitions
    @p_subscription nvarchar(200),
    @p_condition nvarchar(20),
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    WITH s AS (
        SELECT s.id, s.partition_mode FROM workqueue.subscription AS s WHERE s.name = @p_subscription
    ), k AS (
        SELECT p.partition_key,
               CASE WHEN p.holder_id IS NOT NULL THEN N'InFlight'
                    WHEN p.blocked_id IS NOT NULL THEN N'Blocked'
                    WHEN s.partition_mode = N'Ordered' AND h.attempt > 0 AND p.next_visible_at > @v_now
                        THEN N'Blocked'
                    ELSE N'Idle' END AS condition,
               COALESCE(p.holder_id, p.blocked_id, p.next_id) AS head_id
        FROM workqueue.partition AS p
        INNER JOIN s ON s.id = p.subscription_id
        LEFT JOIN workqueue.delivery AS h ON h.id = COALESCE(p.holder_id, p.blocked_id, p.next_id)
    )
    SELECT TOP (@p_limit)
           k.partition_key, k.condition, k.head_id AS head_delivery_id, h.status AS head_status,
           h.attempt AS head_attempt, h.visible_at AS head_visible_at,
           (SELECT COUNT_BIG(*) FROM workqueue.delivery AS w CROSS JOIN s
            WHERE w.subscription_id = s.id AND w.partition_key = k.partition_key
              AND w.status = N'Pending' AND w.id <> k.head_id) AS waiting_items
    FROM k
    LEFT JOIN workqueue.delivery AS h ON h.id = k.head_id
    WHERE @p_condition IS NULL OR k.condition = @p_condition COLLATE Latin1_General_100_BIN2
    ORDER BY k.partition_key;
END;
GO
