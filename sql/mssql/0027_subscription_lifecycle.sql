-- fastapi-workqueue: SQL Server, version 27: a subscription or a topic can be retired, then deleted
-- (as PostgreSQL 0036, whose header says why and how).

ALTER TABLE workqueue.topic ADD retired_at datetimeoffset(6) NULL;
ALTER TABLE workqueue.subscription ADD retired_at datetimeoffset(6) NULL;
GO

-- returns: idx, status, message_id, error_code, error_message
CREATE OR ALTER PROCEDURE workqueue.publish
    @p_topic nvarchar(200),
    @p_message_ids nvarchar(max),
    @p_partition_keys nvarchar(max),
    @p_attributes nvarchar(max),
    @p_payloads nvarchar(max),
    @p_payload_refs nvarchar(max),
    @p_correlation_ids nvarchar(max),
    @p_content_hashes nvarchar(max),
    @p_deduplication_keys nvarchar(max),
    @p_deduplication_ttls nvarchar(max),
    @p_delays nvarchar(max),
    @p_not_befores nvarchar(max),
    @p_max_attempts nvarchar(max),
    @p_backoff_schedules nvarchar(max),
    @p_envelope_bytes nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_n int;
    DECLARE @v_topic_found bit = 0;
    DECLARE @v_topic_retired bit = 0;
    DECLARE @v_quoted_topic nvarchar(max) = N'''' + REPLACE(@p_topic, N'''', N'''''') + N'''';
    DECLARE @v_cap int;
    DECLARE @v_has_keyed bit = 0;
    DECLARE @v_has_dedup bit = 0;
    DECLARE @v_failed int;
    DECLARE @v_failed_code nvarchar(40);
    DECLARE @v_accepted int = 0;
    DECLARE @v_count int;
    DECLARE @v_k int;
    DECLARE @v_k_count int;
    DECLARE @v_key_subscription int;
    DECLARE @v_key nvarchar(512);
    DECLARE @v_key_found bit;
    DECLARE @v_key_holder bigint;
    DECLARE @v_item TABLE (
        i int NOT NULL PRIMARY KEY,     -- 1-based, as PostgreSQL's WITH ORDINALITY
        mid uniqueidentifier NULL,
        pkey nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        attrs nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        payload nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        ref nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        corr nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        hash nvarchar(128) COLLATE Latin1_General_100_BIN2 NULL,
        dkey nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        ttl float NULL,
        delay float NULL,
        not_before datetimeoffset(6) NULL,
        max_attempts int NULL,
        backoff nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        bytes int NULL,
        visible_at datetimeoffset(6) NULL,
        dedup_expires_at datetimeoffset(6) NULL,
        st nvarchar(20) COLLATE Latin1_General_100_BIN2 NULL,
        result_id uniqueidentifier NULL,
        ok bit NOT NULL DEFAULT 0
    );
    DECLARE @v_inserted TABLE (id uniqueidentifier NOT NULL PRIMARY KEY);
    DECLARE @v_keys TABLE (
        ord int IDENTITY(1, 1) PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NOT NULL
    );
    DECLARE @v_sub TABLE (
        id int NOT NULL PRIMARY KEY,
        partition_mode nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        filter nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL,
        max_attempts int NOT NULL,
        backoff_base_seconds float NOT NULL,
        backoff_max_seconds float NOT NULL
    );
    DECLARE @v_new TABLE (
        id bigint NOT NULL PRIMARY KEY,
        subscription_id int NOT NULL,
        partition_key nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
        key_mode smallint NOT NULL,
        visible_at datetimeoffset(6) NOT NULL
    );
    DECLARE @v_result TABLE (
        idx int NOT NULL PRIMARY KEY,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        message_id uniqueidentifier NULL,
        error_code nvarchar(40) COLLATE Latin1_General_100_BIN2 NULL,
        error_message nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- The parallel arrays as one row per item (PostgreSQL: unnest(...) WITH ORDINALITY).
        INSERT INTO @v_item (
            i, mid, pkey, attrs, payload, ref, corr, hash, dkey, ttl, delay, not_before,
            max_attempts, backoff, bytes)
        SELECT CAST(m.[key] AS int) + 1, CAST(m.value AS uniqueidentifier), pk.value, ats.value,
               pl.value, pr.value, co.value, ch.value, dk.value, CAST(dt.value AS float),
               CAST(de.value AS float), CAST(nb.value AS datetimeoffset(6)), CAST(ma.value AS int),
               bs.value, CAST(eb.value AS int)
        FROM OPENJSON(@p_message_ids) AS m
        LEFT JOIN OPENJSON(@p_partition_keys) AS pk ON pk.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_attributes) AS ats ON ats.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_payloads) AS pl ON pl.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_payload_refs) AS pr ON pr.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_correlation_ids) AS co ON co.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_content_hashes) AS ch ON ch.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_deduplication_keys) AS dk ON dk.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_deduplication_ttls) AS dt ON dt.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_delays) AS de ON de.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_not_befores) AS nb ON nb.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_max_attempts) AS ma ON ma.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_backoff_schedules) AS bs ON bs.[key] = m.[key]
        LEFT JOIN OPENJSON(@p_envelope_bytes) AS eb ON eb.[key] = m.[key];
        SET @v_n = @@ROWCOUNT;

        IF @v_n > 0
        BEGIN
            SELECT @v_topic_found = 1, @v_cap = t.max_payload_bytes,
                   @v_topic_retired = CASE WHEN t.retired_at IS NULL THEN 0 ELSE 1 END
            FROM workqueue.topic AS t
            WHERE t.name = @p_topic;
        END;

        IF @v_n > 0 AND @v_topic_found = 0
            INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
            SELECT it.i, N'Rejected', it.mid, N'UnknownTopic',
                   CONCAT(N'topic ', @v_quoted_topic,
                          N' does not exist; declare it in the WorkQueue topics or create it first')
            FROM @v_item AS it;
        ELSE IF @v_n > 0 AND @v_topic_retired = 1
            INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
            SELECT it.i, N'Rejected', it.mid, N'TopicRetired',
                   CONCAT(N'topic ', @v_quoted_topic,
                          N' is retired and takes no new messages; publish to the topic that replaced it, ',
                          N'or take it back with `workqueue topics resume ', @p_topic, N'`')
            FROM @v_item AS it;
        ELSE IF @v_n > 0
        BEGIN
            -- visible_at = greatest(now, coalesce(not_before, now + delay)); the deduplication
            -- key lives coalesce(ttl, 300) seconds. Fractional seconds: whole seconds, then
            -- microseconds (DATEADD takes an int).
            UPDATE it
            SET visible_at = CASE WHEN w.wanted > @v_now THEN w.wanted ELSE @v_now END,
                dedup_expires_at = DATEADD(
                    microsecond, CAST((w.ttl - FLOOR(w.ttl)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(w.ttl) AS int), @v_now))
            FROM @v_item AS it
            CROSS APPLY (
                SELECT COALESCE(it.not_before, DATEADD(
                           microsecond,
                           CAST((COALESCE(it.delay, 0) - FLOOR(COALESCE(it.delay, 0))) * 1000000 AS int),
                           DATEADD(second, CAST(FLOOR(COALESCE(it.delay, 0)) AS int), @v_now))) AS wanted,
                       COALESCE(it.ttl, 300) AS ttl
            ) AS w;

            IF EXISTS (SELECT 1 FROM @v_item AS it WHERE it.dkey IS NOT NULL)
                SET @v_has_dedup = 1;

            IF @v_has_dedup = 0
               AND (@v_cap IS NULL OR NOT EXISTS (SELECT 1 FROM @v_item AS it WHERE it.bytes > @v_cap))
            BEGIN
                -- Fast path: write, then look at the items that clashed with a stored message.
                INSERT INTO workqueue.message (
                    id, topic, partition_key, attributes, payload, payload_ref, correlation_id,
                    deduplication_key, content_hash)
                OUTPUT inserted.id INTO @v_inserted (id)
                SELECT it.mid, @p_topic, it.pkey, COALESCE(it.attrs, N'{}'), it.payload, it.ref, it.corr,
                       NULL, it.hash
                FROM @v_item AS it
                WHERE it.i = (SELECT MIN(x.i) FROM @v_item AS x WHERE x.mid = it.mid)
                  AND NOT EXISTS (
                      SELECT 1 FROM workqueue.message AS m WITH (UPDLOCK, HOLDLOCK) WHERE m.id = it.mid
                  )
                ORDER BY it.i;
                SET @v_count = @@ROWCOUNT;

                IF @v_count = @v_n
                    UPDATE @v_item SET st = N'Accepted', result_id = mid, ok = 1;
                ELSE
                BEGIN
                    -- An item is accepted when this call inserted it and it is the first with its
                    -- id; the others repeat a stored message (or an earlier item): same content,
                    -- Duplicate.
                    UPDATE it
                    SET st = CASE
                            WHEN it.i = f.first_by_id AND ins.id IS NOT NULL THEN N'Accepted'
                            WHEN s.content_hash = it.hash THEN N'Duplicate'
                            ELSE N'MessageIDConflict'
                        END,
                        result_id = it.mid
                    FROM @v_item AS it
                    CROSS APPLY (SELECT MIN(x.i) AS first_by_id FROM @v_item AS x WHERE x.mid = it.mid) AS f
                    LEFT JOIN @v_inserted AS ins ON ins.id = it.mid
                    LEFT JOIN workqueue.message AS s ON s.id = it.mid;
                    UPDATE @v_item SET ok = CASE WHEN st = N'Accepted' THEN 1 ELSE 0 END;

                    SELECT @v_failed = MIN(it.i) FROM @v_item AS it WHERE it.st = N'MessageIDConflict';
                    IF @v_failed IS NOT NULL
                    BEGIN
                        DELETE FROM workqueue.message WHERE id IN (SELECT ins.id FROM @v_inserted AS ins);
                        INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
                        SELECT it.i,
                               CASE WHEN it.st = N'MessageIDConflict' THEN it.st ELSE N'Rejected' END,
                               it.mid,
                               CASE WHEN it.st = N'MessageIDConflict' THEN it.st ELSE N'BatchAborted' END,
                               CASE WHEN it.st = N'MessageIDConflict'
                                    THEN N'a message with this MessageID and different content was already published; use a new MessageID for new content'
                                    ELSE CONCAT(N'not published: item ', @v_failed - 1,
                                                N' of this call was refused (MessageIDConflict) and a publish call is all-or-nothing')
                               END
                        FROM @v_item AS it;
                    END;
                END;
                SET @v_accepted = @v_count;
            END
            ELSE
            BEGIN
                -- Classify every item before writing anything: refused (too large), a repeat of an
                -- earlier item or of a stored message (Duplicate or MessageIDConflict), a live
                -- deduplication key.
                WITH item AS (
                    SELECT it.i, it.mid, it.hash, it.dkey, it.bytes,
                           MIN(it.i) OVER (PARTITION BY it.mid) AS first_by_id,
                           FIRST_VALUE(it.hash) OVER (PARTITION BY it.mid ORDER BY it.i) AS first_hash,
                           CASE WHEN it.dkey IS NULL THEN NULL
                                ELSE MIN(it.i) OVER (PARTITION BY it.dkey) END AS first_by_dkey,
                           FIRST_VALUE(it.mid) OVER (PARTITION BY it.dkey ORDER BY it.i) AS first_mid_by_dkey
                    FROM @v_item AS it
                )
                UPDATE target
                SET st = CASE
                        WHEN @v_cap IS NOT NULL AND item.bytes > @v_cap THEN N'Rejected'
                        WHEN item.first_by_id < item.i AND item.first_hash = item.hash THEN N'Duplicate'
                        WHEN item.first_by_id < item.i THEN N'MessageIDConflict'
                        WHEN s.id IS NOT NULL AND s.content_hash = item.hash THEN N'Duplicate'
                        WHEN s.id IS NOT NULL THEN N'MessageIDConflict'
                        WHEN lk.message_id IS NOT NULL THEN N'Duplicate'
                        WHEN item.first_by_dkey < item.i THEN N'Duplicate'
                        ELSE N'Accepted'
                    END,
                    result_id = CASE
                        WHEN @v_cap IS NOT NULL AND item.bytes > @v_cap THEN item.mid
                        WHEN item.first_by_id < item.i OR s.id IS NOT NULL THEN item.mid
                        WHEN lk.message_id IS NOT NULL THEN lk.message_id
                        WHEN item.first_by_dkey < item.i THEN item.first_mid_by_dkey
                        ELSE item.mid
                    END
                FROM @v_item AS target
                INNER JOIN item ON item.i = target.i
                LEFT JOIN workqueue.message AS s ON s.id = item.mid
                LEFT JOIN workqueue.deduplication AS lk
                    ON @v_has_dedup = 1 AND lk.topic = @p_topic AND lk.deduplication_key = item.dkey
                   AND lk.expires_at > @v_now;
                UPDATE @v_item SET ok = CASE WHEN st = N'Accepted' THEN 1 ELSE 0 END;

                SELECT @v_failed = MIN(it.i) FROM @v_item AS it WHERE it.st IN (N'Rejected', N'MessageIDConflict');
                SELECT @v_accepted = COUNT(*) FROM @v_item AS it WHERE it.ok = 1;

                IF @v_failed IS NOT NULL
                BEGIN
                    SELECT @v_failed_code = CASE it.st WHEN N'Rejected' THEN N'EnvelopeTooLarge'
                                                       ELSE N'MessageIDConflict' END
                    FROM @v_item AS it
                    WHERE it.i = @v_failed;
                    INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
                    SELECT it.i,
                           CASE WHEN it.st IN (N'Rejected', N'MessageIDConflict') THEN it.st ELSE N'Rejected' END,
                           it.result_id,
                           CASE it.st WHEN N'Rejected' THEN N'EnvelopeTooLarge'
                                      WHEN N'MessageIDConflict' THEN N'MessageIDConflict'
                                      ELSE N'BatchAborted' END,
                           CASE it.st
                               WHEN N'Rejected' THEN CONCAT(
                                   N'the envelope is ', it.bytes, N' bytes; topic ', @v_quoted_topic,
                                   N' accepts at most ', @v_cap,
                                   N' bytes (max_payload_bytes); send a PayloadRef to the data instead')
                               WHEN N'MessageIDConflict'
                                   THEN N'a message with this MessageID and different content was already published; use a new MessageID for new content'
                               ELSE CONCAT(N'not published: item ', @v_failed - 1, N' of this call was refused (',
                                           @v_failed_code, N') and a publish call is all-or-nothing')
                           END
                    FROM @v_item AS it;
                END
                ELSE IF @v_accepted > 0
                BEGIN
                    INSERT INTO workqueue.message (
                        id, topic, partition_key, attributes, payload, payload_ref, correlation_id,
                        deduplication_key, content_hash)
                    SELECT it.mid, @p_topic, it.pkey, COALESCE(it.attrs, N'{}'), it.payload, it.ref, it.corr,
                           it.dkey, it.hash
                    FROM @v_item AS it
                    WHERE it.ok = 1
                      AND NOT EXISTS (
                          SELECT 1 FROM workqueue.message AS m WITH (UPDLOCK, HOLDLOCK) WHERE m.id = it.mid
                      )
                    ORDER BY it.i;
                    IF @@ROWCOUNT <> @v_accepted
                        THROW 51001, N'a message with the same MessageID was published concurrently; retry the publish', 1;

                    -- ON CONFLICT (topic, deduplication_key) DO UPDATE ... WHERE expired: take over
                    -- the expired keys, insert the absent ones.
                    UPDATE dd
                    SET message_id = it.mid, expires_at = it.dedup_expires_at
                    FROM workqueue.deduplication AS dd WITH (UPDLOCK, HOLDLOCK)
                    INNER JOIN @v_item AS it ON dd.topic = @p_topic AND dd.deduplication_key = it.dkey
                    WHERE it.ok = 1 AND dd.expires_at <= @v_now;
                    SET @v_count = @@ROWCOUNT;
                    INSERT INTO workqueue.deduplication (topic, deduplication_key, message_id, expires_at)
                    SELECT @p_topic, it.dkey, it.mid, it.dedup_expires_at
                    FROM @v_item AS it
                    WHERE it.ok = 1 AND it.dkey IS NOT NULL
                      AND NOT EXISTS (
                          SELECT 1 FROM workqueue.deduplication AS dd WITH (UPDLOCK, HOLDLOCK)
                          WHERE dd.topic = @p_topic AND dd.deduplication_key = it.dkey
                      )
                    ORDER BY it.dkey;
                    SET @v_count = @v_count + @@ROWCOUNT;
                    IF @v_count <> (SELECT COUNT(*) FROM @v_item AS it WHERE it.ok = 1 AND it.dkey IS NOT NULL)
                        THROW 51001, N'a message with the same DeduplicationKey was published concurrently; retry the publish', 1;
                END;
            END;

            -- The subscriptions as the deliveries are written: read once, here, after whatever the
            -- classification waited for; the key modes, the keys and the deliveries follow this read.
            IF @v_failed IS NULL AND @v_accepted > 0
            BEGIN
                INSERT INTO @v_sub (id, partition_mode, filter, max_attempts, backoff_base_seconds, backoff_max_seconds)
                SELECT s.id, s.partition_mode, s.filter, s.max_attempts, s.backoff_base_seconds, s.backoff_max_seconds
                FROM workqueue.subscription AS s
                WHERE s.topic = @p_topic AND s.retired_at IS NULL;
                IF EXISTS (SELECT 1 FROM @v_sub AS s WHERE s.partition_mode <> N'None')
                    SET @v_has_keyed = 1;
            END;

            IF @v_failed IS NULL AND @v_accepted > 0 AND @v_has_keyed = 0
                INSERT INTO workqueue.delivery (
                    subscription_id, message_id, partition_key, key_mode, max_attempts,
                    backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at)
                SELECT s.id, it.mid, it.pkey, 0, COALESCE(it.max_attempts, s.max_attempts),
                       s.backoff_base_seconds, s.backoff_max_seconds, it.backoff, it.visible_at
                FROM @v_item AS it
                CROSS JOIN @v_sub AS s
                WHERE it.ok = 1 AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, it.attrs) = 1)
                ORDER BY it.i, s.id;
                -- (PostgreSQL notifies the subscriptions that got visible work; consumers poll here.)
            ELSE IF @v_failed IS NULL AND @v_accepted > 0
            BEGIN
                -- Lock (creating where needed) the keys of Exclusive and Ordered subscriptions, in
                -- key order, before any delivery gets its id: ids then follow commit order within
                -- a key.
                INSERT INTO @v_keys (subscription_id, partition_key)
                SELECT DISTINCT s.id, it.pkey
                FROM @v_item AS it
                INNER JOIN @v_sub AS s ON s.partition_mode <> N'None'
                WHERE it.ok = 1 AND it.pkey IS NOT NULL
                  AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, it.attrs) = 1)
                ORDER BY s.id, it.pkey;
                SET @v_k_count = @@ROWCOUNT;
                SET @v_k = 1;
                WHILE @v_k <= @v_k_count
                BEGIN
                    SELECT @v_key_subscription = k.subscription_id, @v_key = k.partition_key
                    FROM @v_keys AS k
                    WHERE k.ord = @v_k;
                    -- Reading holder_id (not in the primary key) locks the row itself, the
                    -- lock a claim meets (0001, partition_ready); HOLDLOCK covers an absent key.
                    SET @v_key_found = 0;
                    SELECT @v_key_found = 1, @v_key_holder = p.holder_id
                    FROM workqueue.partition AS p WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
                    WHERE p.subscription_id = @v_key_subscription AND p.partition_key = @v_key;
                    IF @v_key_found = 0
                        INSERT INTO workqueue.partition (subscription_id, partition_key)
                        VALUES (@v_key_subscription, @v_key);
                    SET @v_k = @v_k + 1;
                END;

                INSERT INTO workqueue.delivery (
                    subscription_id, message_id, partition_key, key_mode, max_attempts,
                    backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at)
                OUTPUT inserted.id, inserted.subscription_id, inserted.partition_key, inserted.key_mode,
                       inserted.visible_at
                INTO @v_new (id, subscription_id, partition_key, key_mode, visible_at)
                SELECT s.id, it.mid, it.pkey,
                       CASE WHEN it.pkey IS NULL OR s.partition_mode = N'None' THEN 0
                            WHEN s.partition_mode = N'Exclusive' THEN 1 ELSE 2 END,
                       COALESCE(it.max_attempts, s.max_attempts), s.backoff_base_seconds,
                       s.backoff_max_seconds, it.backoff, it.visible_at
                FROM @v_item AS it
                CROSS JOIN @v_sub AS s
                WHERE it.ok = 1 AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, it.attrs) = 1)
                ORDER BY it.i, s.id;

                -- Each key that got work: its first new delivery (Ordered) or its earliest
                -- (Exclusive) becomes the next one to claim, unless the key is held or blocked.
                WITH first_new AS (
                    SELECT nd.id, nd.subscription_id, nd.partition_key, nd.key_mode, nd.visible_at,
                           ROW_NUMBER() OVER (
                               PARTITION BY nd.subscription_id, nd.partition_key
                               ORDER BY CASE WHEN nd.key_mode = 1 THEN nd.visible_at END, nd.id
                           ) AS rn
                    FROM @v_new AS nd
                    WHERE nd.key_mode > 0
                )
                UPDATE p
                SET next_id = f.id, next_visible_at = f.visible_at
                FROM workqueue.partition AS p
                INNER JOIN first_new AS f
                    ON f.rn = 1 AND p.subscription_id = f.subscription_id AND p.partition_key = f.partition_key
                WHERE p.holder_id IS NULL
                  AND ((f.key_mode = 2 AND p.next_id IS NULL AND p.blocked_id IS NULL)
                       OR (f.key_mode = 1 AND (p.next_id IS NULL OR f.visible_at < p.next_visible_at)));
                -- (PostgreSQL notifies the subscriptions whose keys became claimable; consumers poll.)
            END;

            IF @v_failed IS NULL
                INSERT INTO @v_result (idx, status, message_id, error_code, error_message)
                SELECT it.i, it.st, it.result_id, NULL, NULL
                FROM @v_item AS it;
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT r.idx, r.status, r.message_id, r.error_code, r.error_message
    FROM @v_result AS r
    WHERE EXISTS (SELECT 1 FROM @v_result AS other WHERE other.status <> N'Accepted')
    ORDER BY r.idx;
END;
GO

-- returns: id, name, topic, handler_key, partition_mode, lease_seconds, max_attempts, backoff_base_seconds, backoff_max_seconds, max_processing_seconds, heartbeat_mode, filter, status, host_type, retention_seconds, topic_status, transport, is_fifo, max_payload_bytes
CREATE OR ALTER PROCEDURE workqueue.list_subscriptions
AS
BEGIN
    SET NOCOUNT ON;
    SELECT s.id, s.name, s.topic, s.handler_key, s.partition_mode, s.lease_seconds, s.max_attempts,
           s.backoff_base_seconds, s.backoff_max_seconds, s.max_processing_seconds,
           s.heartbeat_mode, s.filter, CASE WHEN s.status = N'Active' AND s.retired_at IS NOT NULL THEN N'Retired' ELSE s.status END AS status,
           s.host_type, s.retention_seconds,
           CASE WHEN t.status = N'Active' AND t.retired_at IS NOT NULL THEN N'Retired' ELSE t.status END AS topic_status,
           t.transport, t.is_fifo, t.max_payload_bytes
    FROM workqueue.subscription AS s
    INNER JOIN workqueue.topic AS t ON t.name = s.topic
    ORDER BY s.name;
END;
GO

-- returns: name, transport, max_payload_bytes, is_fifo, status
CREATE OR ALTER PROCEDURE workqueue.list_topics
AS
BEGIN
    SET NOCOUNT ON;
    SELECT t.name, t.transport, t.max_payload_bytes, t.is_fifo,
           CASE WHEN t.status = N'Active' AND t.retired_at IS NOT NULL THEN N'Retired' ELSE t.status END AS status
    FROM workqueue.topic AS t
    ORDER BY t.name;
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
    SELECT s.name AS subscription, s.topic,
           CASE WHEN s.status = N'Active' AND s.retired_at IS NOT NULL THEN N'Retired' ELSE s.status END AS subscription_status,
           s.partition_mode,
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

-- Pauses or resumes a subscription. No row when the subscription does not exist.
-- (PostgreSQL notifies the consumers when a subscription becomes Active; here they poll.)
-- returns: subscription, status, changed
CREATE OR ALTER PROCEDURE workqueue.set_subscription_status
    @p_name nvarchar(200),
    @p_status nvarchar(20)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_old nvarchar(20);
    DECLARE @v_result TABLE (
        subscription nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
        status nvarchar(20) COLLATE Latin1_General_100_BIN2 NOT NULL,
        changed bit NOT NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        -- Resume (Active) takes back a retired subscription too.
        SELECT @v_old = CASE WHEN @p_status = N'Active' AND s.status = N'Active' AND s.retired_at IS NOT NULL
                             THEN N'Retired' ELSE s.status END
        FROM workqueue.subscription AS s WITH (UPDLOCK, ROWLOCK)
        WHERE s.name = @p_name;
        IF @v_old IS NOT NULL
        BEGIN
            UPDATE s
            SET status = @p_status,
                retired_at = CASE WHEN @p_status = N'Active' THEN NULL ELSE s.retired_at END,
                updated_at = SYSDATETIMEOFFSET()
            FROM workqueue.subscription AS s
            WHERE s.name = @p_name
              AND (s.status <> @p_status OR (@p_status = N'Active' AND s.retired_at IS NOT NULL));
            INSERT INTO @v_result (subscription, status, changed)
            VALUES (@p_name, @p_status,
                    CASE WHEN @v_old <> @p_status COLLATE Latin1_General_100_BIN2 THEN 1 ELSE 0 END);
        END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT r.subscription, r.status, r.changed FROM @v_result AS r;
END;
GO

-- Retires a subscription (retired_at): publish gives it no new delivery from the commit on, while
-- what it holds still drains and its counts stay readable; listings show it Retired.
-- returns: subscription, status, changed
CREATE OR ALTER PROCEDURE workqueue.retire_subscription
    @p_name nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_found bit = 0;
    DECLARE @v_was_retired bit = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SELECT @v_found = 1, @v_was_retired = CASE WHEN s.retired_at IS NULL THEN 0 ELSE 1 END
        FROM workqueue.subscription AS s WITH (UPDLOCK, ROWLOCK)
        WHERE s.name = @p_name;
        UPDATE s
        SET retired_at = SYSDATETIMEOFFSET(), updated_at = SYSDATETIMEOFFSET()
        FROM workqueue.subscription AS s
        WHERE s.name = @p_name AND s.retired_at IS NULL;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @p_name AS subscription, N'Retired' AS status, CASE WHEN @v_was_retired = 1 THEN 0 ELSE 1 END AS changed
    WHERE @v_found = 1;
END;
GO

-- Discards up to @p_limit Pending deliveries of a subscription, oldest id first, with @p_reason,
-- counted in settled_count, their keys handed over as a settle hands them; returns how many.
-- returns: discard_pending
CREATE OR ALTER PROCEDURE workqueue.discard_pending
    @p_subscription nvarchar(200),
    @p_reason nvarchar(max),
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
        SET status = N'Discarded', reason = @p_reason, settled_at = @v_now, lease_token = NULL,
            lease_expires_at = NULL
        OUTPUT inserted.id, inserted.subscription_id, inserted.key_mode INTO @v_u (id, subscription_id, key_mode)
        FROM workqueue.delivery AS d
        INNER JOIN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.delivery AS x WITH (UPDLOCK, READPAST, ROWLOCK)
            INNER JOIN workqueue.subscription AS s ON s.id = x.subscription_id
            WHERE s.name = @p_subscription AND x.status = N'Pending'
            ORDER BY x.id
        ) AS c ON c.id = d.id
        WHERE d.status = N'Pending';
        SET @v_count = @@ROWCOUNT;

        INSERT INTO workqueue.settled_count (subscription_id, completed, discarded)
        SELECT u.subscription_id, 0, COUNT_BIG(*)
        FROM @v_u AS u
        GROUP BY u.subscription_id;

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
    SELECT @v_count AS discard_pending;
END;
GO

-- Deletes a retired subscription with its ended deliveries, keys, counts and history. result:
-- Deleted, NotFound, NotRetired, or HasDeliveries (remaining: Pending, InFlight and DeadLettered).
-- returns: subscription, result, remaining
CREATE OR ALTER PROCEDURE workqueue.delete_subscription
    @p_name nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_id int;
    DECLARE @v_retired datetimeoffset(6);
    DECLARE @v_live bigint = 0;
    DECLARE @v_result nvarchar(20) = N'NotFound';

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SELECT @v_id = s.id, @v_retired = s.retired_at
        FROM workqueue.subscription AS s WITH (UPDLOCK, ROWLOCK)
        WHERE s.name = @p_name;
        IF @v_id IS NOT NULL AND @v_retired IS NULL
            SET @v_result = N'NotRetired';
        ELSE IF @v_id IS NOT NULL
        BEGIN
            SELECT @v_live = COUNT_BIG(*) FROM workqueue.delivery AS d
            WHERE d.subscription_id = @v_id AND d.status IN (N'Pending', N'InFlight', N'DeadLettered');
            IF @v_live > 0
                SET @v_result = N'HasDeliveries';
            ELSE
            BEGIN
                DELETE FROM workqueue.delivery WHERE subscription_id = @v_id;
                DELETE FROM workqueue.partition WHERE subscription_id = @v_id;
                DELETE FROM workqueue.partition_stale WHERE subscription_id = @v_id;
                DELETE FROM workqueue.settled_count WHERE subscription_id = @v_id;
                DELETE FROM workqueue.stats_history WHERE subscription_id = @v_id;
                DELETE FROM workqueue.subscription WHERE id = @v_id;
                SET @v_result = N'Deleted';
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
    SELECT @p_name AS subscription, @v_result AS result, @v_live AS remaining;
END;
GO

-- Retires ('Retired': retired_at), pauses ('Paused') or takes back ('Active': active and not
-- retired) a topic. A retired topic refuses new messages (TopicRetired); its subscriptions drain.
-- returns: topic, status, changed
CREATE OR ALTER PROCEDURE workqueue.set_topic_status
    @p_name nvarchar(200),
    @p_status nvarchar(20)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_old nvarchar(20);

    BEGIN TRY
        IF @p_status NOT IN (N'Active', N'Paused', N'Retired')
            THROW 51020, N'a topic''s status is Active, Paused or Retired', 1;
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SELECT @v_old = CASE WHEN t.status = N'Active' AND t.retired_at IS NOT NULL THEN N'Retired' ELSE t.status END
        FROM workqueue.topic AS t WITH (UPDLOCK, ROWLOCK)
        WHERE t.name = @p_name;
        UPDATE t
        SET status = CASE WHEN @p_status = N'Retired' THEN t.status ELSE @p_status END,
            retired_at = CASE WHEN @p_status = N'Retired' THEN COALESCE(t.retired_at, SYSDATETIMEOFFSET())
                              WHEN @p_status = N'Active' THEN NULL ELSE t.retired_at END,
            updated_at = SYSDATETIMEOFFSET()
        FROM workqueue.topic AS t
        WHERE t.name = @p_name;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @p_name AS topic, @p_status AS status,
           CASE WHEN @v_old <> @p_status COLLATE Latin1_General_100_BIN2 THEN 1 ELSE 0 END AS changed
    WHERE @v_old IS NOT NULL;
END;
GO

-- Deletes a retired topic that no subscription names any more. result: Deleted, NotFound,
-- NotRetired, or HasSubscriptions (remaining says how many).
-- returns: topic, result, remaining
CREATE OR ALTER PROCEDURE workqueue.delete_topic
    @p_name nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_found bit = 0;
    DECLARE @v_retired datetimeoffset(6);
    DECLARE @v_subscriptions bigint = 0;
    DECLARE @v_result nvarchar(20) = N'NotFound';

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        SELECT @v_found = 1, @v_retired = t.retired_at
        FROM workqueue.topic AS t WITH (UPDLOCK, ROWLOCK)
        WHERE t.name = @p_name;
        IF @v_found = 1 AND @v_retired IS NULL
            SET @v_result = N'NotRetired';
        ELSE IF @v_found = 1
        BEGIN
            SELECT @v_subscriptions = COUNT_BIG(*) FROM workqueue.subscription AS s WHERE s.topic = @p_name;
            IF @v_subscriptions > 0
                SET @v_result = N'HasSubscriptions';
            ELSE
            BEGIN
                DELETE FROM workqueue.deduplication WHERE topic = @p_name;
                DELETE FROM workqueue.topic WHERE name = @p_name;
                SET @v_result = N'Deleted';
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
    SELECT @p_name AS topic, @v_result AS result, @v_subscriptions AS remaining;
END;
GO
