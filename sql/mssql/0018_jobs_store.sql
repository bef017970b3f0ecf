-- fastapi-workqueue: SQL Server, version 18: what the jobs layer needs from the store. Mirrors
-- sql/postgresql/0025 (whose header says what each part is for): settle takes the Discard outcome;
-- release_deduplication_key frees a unique job's key; step_result, step_get and step_put keep a
-- job's durable step results, removed with their message (ON DELETE CASCADE); claim_many claims
-- across several None-mode subscriptions, the oldest due first, reading each one's claim index for
-- at most the limit and locking each share UPDLOCK, READPAST, ROWLOCK, as claim does;
-- known_messages and message_deliveries read; discard_dead_letters prunes dead letters in bounded
-- batches; rewrite_payload replaces a payload while no delivery of it runs or has ended. Redefines
-- settle (0015) with the same parameters and result columns. Conventions: top of 0002_helpers.sql.
--
-- Errors PostgreSQL raises with a SQLSTATE are THROWn here: 51005 for claim_many given an
-- Exclusive or Ordered subscription (PostgreSQL: invalid_parameter_value), 51006 for a step of a
-- message that is not stored (foreign_key_violation), 51007 for a step name over 400 characters
-- (the primary key's limit; PostgreSQL has none), 51008 for a rewritten envelope over the topic's
-- cap (program_limit_exceeded).

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- The JSON result of each named step of a message's work (the jobs layer's durable steps), the
-- first write winning; removed with the message (ON DELETE CASCADE). A step name is at most 400
-- characters here (a primary key holds 1700 bytes). The table clusters on created_at, as message
-- on published_at, so random uniqueidentifier values do not split its pages.
CREATE TABLE workqueue.step_result (
    message_id  uniqueidentifier NOT NULL
                CONSTRAINT step_result_message_fk REFERENCES workqueue.message (id) ON DELETE CASCADE,
    name        nvarchar(400) COLLATE Latin1_General_100_BIN2 NOT NULL,
    value       nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL,  -- JSON text, kept as sent
    created_at  datetimeoffset(6) NOT NULL CONSTRAINT step_result_created_at_default DEFAULT SYSDATETIMEOFFSET(),
    CONSTRAINT step_result_pk PRIMARY KEY NONCLUSTERED (message_id, name)
);
CREATE CLUSTERED INDEX step_result_created_at ON workqueue.step_result (created_at);
GO

-- Settles deliveries with their current lease token. Outcomes: Complete, Retry (explicit, with a
-- reason and optional delay), Fail (an error), DeadLetter, Discard (Discarded with the reason,
-- never retried), Release (shutdown, or a busy once key: back to Pending after the optional delay
-- without consuming the attempt). A cancel-requested delivery becomes Discarded whatever the
-- outcome. A stale token changes nothing and answers LeaseLost. (An id given twice is settled
-- once, by its first item.) @p_draws are the caller's jitter draws (PostgreSQL 0020); the batch's
-- terminal settles are counted in settled_count (0022).
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
                    WHEN i.outcome = N'Discard' THEN N'Discarded'
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

-- Frees a topic's deduplication key if the given message holds it; 1 when it held it live (a key
-- of that message that had expired already goes too, and answers 0).
-- returns: release_deduplication_key
CREATE OR ALTER PROCEDURE workqueue.release_deduplication_key
    @p_topic nvarchar(200),
    @p_key nvarchar(max),
    @p_message_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_gone TABLE (expires_at datetimeoffset(6) NOT NULL);
    BEGIN TRY
        DELETE FROM workqueue.deduplication
        OUTPUT deleted.expires_at INTO @v_gone (expires_at)
        WHERE topic = @p_topic AND deduplication_key = @p_key AND message_id = @p_message_id;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
    SELECT CAST(CASE WHEN EXISTS (SELECT 1 FROM @v_gone AS g WHERE g.expires_at > @v_now) THEN 1 ELSE 0 END AS bit)
        AS release_deduplication_key;
END;
GO

-- The stored result of one step (no row when none is stored).
-- returns: value
CREATE OR ALTER PROCEDURE workqueue.step_get
    @p_message_id uniqueidentifier,
    @p_name nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SELECT r.value
    FROM workqueue.step_result AS r
    WHERE r.message_id = @p_message_id AND r.name = @p_name;
END;
GO

-- Stores the result of one step; the first write wins (a second put keeps the first value). The
-- message must be stored (THROW 51006); a step name is at most 400 characters (THROW 51007).
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.step_put
    @p_message_id uniqueidentifier,
    @p_name nvarchar(max),
    @p_value nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_message nvarchar(2048);
    BEGIN TRY
        IF DATALENGTH(@p_name) > 800
            THROW 51007, N'a step name is at most 400 characters on SQL Server; use a shorter name', 1;
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF NOT EXISTS (SELECT 1 FROM workqueue.message AS m WHERE m.id = @p_message_id)
        BEGIN
            SET @v_message = CONCAT(
                N'message ', LOWER(CAST(@p_message_id AS nvarchar(36))),
                N' is not stored (never published, or purged): a step result belongs to a stored message');
            THROW 51006, @v_message, 1;
        END;
        INSERT INTO workqueue.step_result (message_id, name, value)
        SELECT @p_message_id, @p_name, @p_value
        WHERE NOT EXISTS (
            SELECT 1 FROM workqueue.step_result AS r WITH (UPDLOCK, HOLDLOCK)
            WHERE r.message_id = @p_message_id AND r.name = @p_name
        );
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
    @p_limit int
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
                claimed_at = @v_now, progress_percent = NULL, progress_message = NULL
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

-- Which of the given MessageIDs (a JSON array) the store has.
-- returns: message_id
CREATE OR ALTER PROCEDURE workqueue.known_messages
    @p_ids nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SELECT m.id AS message_id
    FROM workqueue.message AS m
    WHERE m.id IN (SELECT TRY_CAST(j.value AS uniqueidentifier) FROM OPENJSON(@p_ids) AS j);
END;
GO

-- Every delivery of one message, each with its subscription, as get_delivery answers, by id.
-- returns: delivery_id, subscription, message_id, topic, partition_key, status, attempt, max_attempts, visible_at, lease_expires_at, cancel_requested, progress_percent, progress_message, reason, last_error, note, created_at, claimed_at, settled_at, attributes, payload, correlation_id
CREATE OR ALTER PROCEDURE workqueue.message_deliveries
    @p_message_id uniqueidentifier
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
    WHERE d.message_id = @p_message_id
    ORDER BY d.id;
END;
GO

-- Discards up to @p_limit DeadLettered deliveries of a subscription settled before
-- @p_settled_before (reason 'pruned'), oldest id first, counted in settled_count, their keys
-- handed over by release_keys as a settle hands them; answers how many it discarded. A dead letter
-- another transaction holds (a replay) is skipped (READPAST).
-- returns: discard_dead_letters
CREATE OR ALTER PROCEDURE workqueue.discard_dead_letters
    @p_subscription nvarchar(200),
    @p_settled_before datetimeoffset(6),
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_count int = 0;
    DECLARE @v_settled nvarchar(max);
    DECLARE @v_claimable TABLE (subscription_id int NOT NULL);
    DECLARE @v_u TABLE (id bigint NOT NULL PRIMARY KEY, subscription_id int NOT NULL, key_mode smallint NOT NULL);

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        UPDATE d
        SET status = N'Discarded', reason = N'pruned', settled_at = @v_now, lease_token = NULL,
            lease_expires_at = NULL
        OUTPUT inserted.id, inserted.subscription_id, inserted.key_mode INTO @v_u (id, subscription_id, key_mode)
        FROM workqueue.delivery AS d
        INNER JOIN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.delivery AS x WITH (UPDLOCK, READPAST, ROWLOCK)
            INNER JOIN workqueue.subscription AS s ON s.id = x.subscription_id
            WHERE s.name = @p_subscription AND x.status = N'DeadLettered' AND x.settled_at < @p_settled_before
            ORDER BY x.id
        ) AS c ON c.id = d.id;
        SET @v_count = @@ROWCOUNT;

        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, 0, COUNT_BIG(*)
        FROM @v_u AS u
        GROUP BY u.subscription_id;

        -- (PostgreSQL notifies the subscriptions whose key became claimable; consumers poll here.)
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
    SELECT @v_count AS discard_dead_letters;
END;
GO

-- Replaces a stored message's payload and content hash (re-encryption with a new key) while none
-- of its deliveries is InFlight or ended Completed or Discarded; 1 when it rewrote, 0 when the
-- message is not stored or a delivery forbids it. Its deliveries are locked first (UPDLOCK,
-- HOLDLOCK), so none is claimed meanwhile. An envelope over the topic's cap is refused (THROW
-- 51008).
-- returns: rewrite_payload
CREATE OR ALTER PROCEDURE workqueue.rewrite_payload
    @p_message_id uniqueidentifier,
    @p_payload nvarchar(max),
    @p_content_hash nvarchar(128),
    @p_envelope_bytes int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_found bit = 0;
    DECLARE @v_topic nvarchar(200);
    DECLARE @v_cap int;
    DECLARE @v_done bit = 0;
    DECLARE @v_message nvarchar(2048);
    DECLARE @v_statuses TABLE (status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL);

    SELECT @v_found = 1, @v_topic = m.topic, @v_cap = t.max_payload_bytes
    FROM workqueue.message AS m
    LEFT JOIN workqueue.topic AS t ON t.name = m.topic
    WHERE m.id = @p_message_id;
    IF @v_found = 1 AND @v_cap IS NOT NULL AND @p_envelope_bytes > @v_cap
    BEGIN
        SET @v_message = CONCAT(
            N'the rewritten envelope is ', @p_envelope_bytes, N' bytes; topic ''', @v_topic,
            N''' accepts at most ', @v_cap, N' bytes (max_payload_bytes)');
        THROW 51008, @v_message, 1;
    END;

    BEGIN TRY
        IF @v_found = 1
        BEGIN
            IF @v_own_transaction = 1
                BEGIN TRANSACTION;
            INSERT INTO @v_statuses (status)
            SELECT d.status
            FROM workqueue.delivery AS d WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
            WHERE d.message_id = @p_message_id;
            IF NOT EXISTS (
                SELECT 1 FROM @v_statuses AS x WHERE x.status IN (N'InFlight', N'Completed', N'Discarded')
            )
            BEGIN
                UPDATE workqueue.message
                SET payload = @p_payload, content_hash = @p_content_hash
                WHERE id = @p_message_id;
                IF @@ROWCOUNT > 0
                    SET @v_done = 1;
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
    SELECT @v_done AS rewrite_payload;
END;
GO
