-- fastapi-workqueue: SQL Server, version 24: which process holds a delivery (as PostgreSQL 0033,
-- whose header says why and how): the process registry, delivery.held_by written by claim and
-- claim_many (@p_holder), and the holder's host, pid and start in the delivery listings.

-- The processes that run a host; delivery.held_by names the one that claimed it (PostgreSQL's
-- schema.sql says more).
CREATE TABLE workqueue.process (
    id                     uniqueidentifier NOT NULL,
    hostname               nvarchar(255) COLLATE Latin1_General_100_BIN2 NOT NULL,
    pid                    int NOT NULL,
    started_at             datetimeoffset(6) NOT NULL,
    version                nvarchar(64) COLLATE Latin1_General_100_BIN2 NOT NULL,
    subscriptions          nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL
                           CONSTRAINT process_subscriptions_json CHECK (ISJSON(subscriptions) = 1),
    slots                  int NOT NULL,
    busy                   int NOT NULL,
    beat_interval_seconds  float NOT NULL,
    last_seen_at           datetimeoffset(6) NOT NULL,
    stopped_at             datetimeoffset(6) NULL,
    CONSTRAINT process_pk PRIMARY KEY CLUSTERED (id)
);

ALTER TABLE workqueue.delivery ADD held_by uniqueidentifier NULL;
GO

-- Claims up to @p_limit visible deliveries of an Active subscription: attempt + 1, a fresh lease
-- token, the lease from the subscription's current lease_seconds. Keys of Exclusive and Ordered
-- subscriptions are claimed through their partition row, one delivery per key; deliveries
-- without a key share the claim with the keys, so neither side can take every slot.
-- returns: delivery_id, lease_token, attempt, max_attempts, lease_expires_at, message_id, topic, partition_key, attributes, payload, payload_ref, correlation_id, published_at
CREATE OR ALTER PROCEDURE workqueue.claim
    @p_subscription nvarchar(200),
    @p_limit int,
    @p_holder uniqueidentifier = NULL
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
                    held_by = @p_holder, progress_percent = NULL, progress_message = NULL
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

-- Claims up to @p_limit visible deliveries across several None-mode subscriptions (a JSON array
-- of names), the oldest due first (visible_at, then id) whatever their subscription, each leased
-- for its own subscription's lease_seconds and answered with that subscription's name. Paused
-- subscriptions (or topics) and unknown names give nothing; an Exclusive or Ordered one is
-- refused (THROW 51005; claim takes those). Each subscription's claim index gives at most
-- @p_limit candidates; the first @p_limit of them all set each subscription's share, which is
-- locked from the same index UPDLOCK, READPAST, ROWLOCK, as claim locks (reading message_id,
-- which the index does not cover, so the row itself is locked: see the top of 0005_consume.sql).
-- returns: subscription, delivery_id, lease_token, attempt, max_attempts, lease_expires_at, message_id, topic, partition_key, attributes, payload, payload_ref, correlation_id, published_at
CREATE OR ALTER PROCEDURE workqueue.claim_many
    @p_subscriptions nvarchar(max),
    @p_limit int,
    @p_holder uniqueidentifier = NULL
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_keyed nvarchar(max);
    DECLARE @v_message nvarchar(2048);
    DECLARE @v_names TABLE (name nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY);
    DECLARE @v_subs TABLE (
        id int NOT NULL PRIMARY KEY,
        name nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
        lease_seconds float NOT NULL
    );
    DECLARE @v_shares TABLE (subscription_id int NOT NULL PRIMARY KEY, n int NOT NULL);
    DECLARE @v_ids TABLE (id bigint NOT NULL PRIMARY KEY);
    DECLARE @v_claimed TABLE (
        id bigint NOT NULL PRIMARY KEY,
        subscription_id int NOT NULL,
        lease_token uniqueidentifier NOT NULL,
        attempt int NOT NULL,
        max_attempts int NOT NULL,
        lease_expires_at datetimeoffset(6) NOT NULL,
        message_id uniqueidentifier NOT NULL,
        visible_at datetimeoffset(6) NOT NULL
    );

    -- Names compare in binary, as everywhere (not in the database's default collation), and a name
    -- longer than a subscription's can be is no subscription's (not cut to one that is).
    INSERT INTO @v_names (name)
    SELECT DISTINCT CAST(j.value AS nvarchar(200)) COLLATE Latin1_General_100_BIN2
    FROM OPENJSON(@p_subscriptions) AS j
    WHERE j.value IS NOT NULL AND LEN(j.value) <= 200;
    SELECT @v_keyed = MIN(CONCAT(s.name, N' is ', s.partition_mode))
    FROM workqueue.subscription AS s
    INNER JOIN @v_names AS n ON n.name = s.name
    WHERE s.partition_mode <> N'None';
    IF @v_keyed IS NOT NULL
    BEGIN
        SET @v_message = CONCAT(
            N'claim_many takes None-mode subscriptions only (', @v_keyed,
            N'); claim an Exclusive or Ordered subscription with claim');
        THROW 51005, @v_message, 1;
    END;

    BEGIN TRY
        IF @p_limit >= 1
        BEGIN
            INSERT INTO @v_subs (id, name, lease_seconds)
            SELECT s.id, s.name, s.lease_seconds
            FROM workqueue.subscription AS s
            INNER JOIN @v_names AS n ON n.name = s.name
            INNER JOIN workqueue.topic AS t ON t.name = s.topic
            WHERE s.status = N'Active' AND t.status = N'Active';

            IF @v_own_transaction = 1
                BEGIN TRANSACTION;

            -- Each subscription's share of the @p_limit oldest due deliveries of them all.
            INSERT INTO @v_shares (subscription_id, n)
            SELECT c.subscription_id, COUNT(*)
            FROM (
                SELECT TOP (@p_limit) s.id AS subscription_id
                FROM @v_subs AS s
                CROSS APPLY (
                    SELECT TOP (@p_limit) d.id, d.visible_at
                    FROM workqueue.delivery AS d
                    WHERE d.subscription_id = s.id AND d.status = N'Pending' AND d.key_mode = 0
                      AND d.visible_at <= @v_now
                    ORDER BY d.visible_at, d.id
                ) AS d
                ORDER BY d.visible_at, d.id
            ) AS c
            GROUP BY c.subscription_id;

            -- Each share, locked from its subscription's index past the rows other claimers hold.
            INSERT INTO @v_ids (id)
            SELECT l.id
            FROM @v_shares AS k
            CROSS APPLY (
                SELECT TOP (k.n) d.id, d.message_id
                FROM workqueue.delivery AS d WITH (UPDLOCK, READPAST, ROWLOCK)
                WHERE d.subscription_id = k.subscription_id AND d.status = N'Pending' AND d.key_mode = 0
                  AND d.visible_at <= @v_now
                ORDER BY d.visible_at, d.id
            ) AS l;

            UPDATE d
            SET status = N'InFlight', attempt = d.attempt + 1, claim_count = d.claim_count + 1,
                lease_token = NEWID(),
                lease_expires_at = DATEADD(
                    microsecond, CAST((s.lease_seconds - FLOOR(s.lease_seconds)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(s.lease_seconds) AS int), @v_now)),
                claimed_at = @v_now, held_by = @p_holder, progress_percent = NULL, progress_message = NULL
            OUTPUT inserted.id, inserted.subscription_id, inserted.lease_token, inserted.attempt,
                   inserted.max_attempts, inserted.lease_expires_at, inserted.message_id, inserted.visible_at
            INTO @v_claimed (id, subscription_id, lease_token, attempt, max_attempts, lease_expires_at,
                             message_id, visible_at)
            FROM workqueue.delivery AS d
            INNER JOIN @v_ids AS x ON x.id = d.id
            INNER JOIN @v_subs AS s ON s.id = d.subscription_id
            WHERE d.status = N'Pending';

            IF @v_own_transaction = 1
                COMMIT TRANSACTION;
        END;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT s.name AS subscription, c.id AS delivery_id, c.lease_token, c.attempt, c.max_attempts,
           c.lease_expires_at, m.id AS message_id, m.topic, m.partition_key, m.attributes, m.payload,
           m.payload_ref, m.correlation_id, m.published_at
    FROM @v_claimed AS c
    INNER JOIN @v_subs AS s ON s.id = c.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = c.message_id
    ORDER BY c.visible_at, c.id;
END;
GO

-- returns: delivery_id, subscription, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id, holder_id, holder_host, holder_pid, holder_started_at
CREATE OR ALTER PROCEDURE workqueue.get_delivery
    @p_delivery_id bigint
AS
BEGIN
    SET NOCOUNT ON;
    SELECT d.id AS delivery_id, s.name AS subscription, d.message_id, m.topic, d.partition_key,
           d.status, d.attempt, d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id,
           d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid, p.started_at AS holder_started_at
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    LEFT JOIN workqueue.process AS p ON p.id = d.held_by
    WHERE d.id = @p_delivery_id;
END;
GO

-- Every delivery of one message, each with its subscription, as get_delivery answers, by id.
-- returns: delivery_id, subscription, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id, holder_id, holder_host, holder_pid, holder_started_at
CREATE OR ALTER PROCEDURE workqueue.message_deliveries
    @p_message_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SELECT d.id AS delivery_id, s.name AS subscription, d.message_id, m.topic, d.partition_key,
           d.status, d.attempt, d.max_attempts, d.visible_at, d.lease_expires_at, d.cancel_requested,
           d.progress_percent, d.progress_message, d.reason, d.last_error, d.note, d.created_at,
           d.claimed_at, d.settled_at, m.attributes, m.payload, m.correlation_id,
           d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid, p.started_at AS holder_started_at
    FROM workqueue.delivery AS d
    INNER JOIN workqueue.subscription AS s ON s.id = d.subscription_id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    LEFT JOIN workqueue.process AS p ON p.id = d.held_by
    WHERE d.message_id = @p_message_id
    ORDER BY d.id;
END;
GO

-- Deliveries of one subscription in one state, oldest first, paged by id. DeadLettered and InFlight
-- are named literally, so their pages read their filtered indexes (a state given as a parameter can
-- use none); the page's ids come first, then their rows.
-- returns: delivery_id, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id, holder_id, holder_host, holder_pid, holder_started_at
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
           m.correlation_id, d.held_by AS holder_id, p.hostname AS holder_host, p.pid AS holder_pid,
           p.started_at AS holder_started_at
    FROM @v_page AS v
    INNER JOIN workqueue.delivery AS d ON d.id = v.id
    INNER JOIN workqueue.message AS m ON m.id = d.message_id
    LEFT JOIN workqueue.process AS p ON p.id = d.held_by
    ORDER BY d.id;
END;
GO

-- A process's beat: its row written (or renewed) with what it serves now; rows unseen for a
-- week are deleted.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.process_beat
    @p_id uniqueidentifier,
    @p_hostname nvarchar(255),
    @p_pid int,
    @p_started_at datetimeoffset(6),
    @p_version nvarchar(64),
    @p_subscriptions nvarchar(max),
    @p_slots int,
    @p_busy int,
    @p_beat_interval_seconds float
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        UPDATE workqueue.process WITH (UPDLOCK, SERIALIZABLE)
        SET version = @p_version, subscriptions = @p_subscriptions, slots = @p_slots, busy = @p_busy,
            beat_interval_seconds = @p_beat_interval_seconds, last_seen_at = @v_now, stopped_at = NULL
        WHERE id = @p_id;
        IF @@ROWCOUNT = 0
            INSERT INTO workqueue.process (
                id, hostname, pid, started_at, version, subscriptions, slots, busy, beat_interval_seconds,
                last_seen_at, stopped_at
            ) VALUES (
                @p_id, @p_hostname, @p_pid, @p_started_at, @p_version, @p_subscriptions, @p_slots, @p_busy,
                @p_beat_interval_seconds, @v_now, NULL
            );
        DELETE FROM workqueue.process WHERE last_seen_at < DATEADD(day, -7, @v_now);
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

-- A process's host stopped: its row stays (the deliveries it held name it) with stopped_at set.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.process_stop
    @p_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    BEGIN TRY
        UPDATE workqueue.process
        SET stopped_at = @v_now, busy = 0, last_seen_at = @v_now
        WHERE id = @p_id;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO

-- The processes known, live ones first, each with its state (Running, Stopped, Gone: not seen
-- within three beat intervals) and the deliveries it holds InFlight now.
-- returns: process_id, hostname, pid, started_at, version, subscriptions, slots, busy, last_seen_at, stopped_at, state, in_flight
CREATE OR ALTER PROCEDURE workqueue.list_processes
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT p.id AS process_id, p.hostname, p.pid, p.started_at, p.version, p.subscriptions, p.slots, p.busy,
           p.last_seen_at, p.stopped_at,
           CASE WHEN p.stopped_at IS NOT NULL THEN N'Stopped'
                WHEN p.last_seen_at < DATEADD(millisecond, CAST(-3000 * p.beat_interval_seconds AS int), @v_now)
                    THEN N'Gone'
                ELSE N'Running' END AS state,
           (SELECT CAST(COUNT(*) AS bigint) FROM workqueue.delivery AS d
            WHERE d.status = N'InFlight' AND d.held_by = p.id) AS in_flight
    FROM workqueue.process AS p
    ORDER BY CASE WHEN p.stopped_at IS NULL THEN 0 ELSE 1 END, p.last_seen_at DESC, p.id;
END;
GO
