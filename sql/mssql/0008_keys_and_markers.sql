-- fastapi-workqueue: SQL Server once markers, API keys, prune and schema versions, version 8.
-- Mirrors once_begin, once_finish and once_abort (sql/postgresql/0004_hot_paths.sql) and
-- api_key_create, api_key_lookup, api_key_list, api_key_revoke, prune and schema_versions
-- (0006_api_keys.sql); conventions: top of 0002_helpers.sql. The tables are in 0001.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- ---------------------------------------------------------------------------------------------
-- Once markers: context.once(key, fn) runs fn unless it already succeeded for the key
-- ---------------------------------------------------------------------------------------------

-- Run: the caller holds the key for @p_running_seconds and must finish or abort it. Done: it ran
-- already (within its TTL). Busy: another attempt is running it now. A key is at most 850
-- characters here (the width of the primary key); a longer one is refused with error 51003.
-- returns: state, token
CREATE OR ALTER PROCEDURE workqueue.once_begin
    @p_key nvarchar(max),
    @p_running_seconds float
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_token uniqueidentifier = NEWID();
    DECLARE @v_key nvarchar(850);
    DECLARE @v_found bit = 0;
    DECLARE @v_state nvarchar(20);
    DECLARE @v_expires_at datetimeoffset(6);
    DECLARE @v_running_until datetimeoffset(6);
    DECLARE @v_result_state nvarchar(20);
    DECLARE @v_result_token uniqueidentifier;

    BEGIN TRY
        IF DATALENGTH(@p_key) > 1700
            THROW 51003, N'a once key is at most 850 characters on SQL Server; use a shorter key (for example a hash of it)', 1;
        SET @v_key = @p_key;
        SET @v_running_until = DATEADD(
            microsecond, CAST((@p_running_seconds - FLOOR(@p_running_seconds)) * 1000000 AS int),
            DATEADD(second, CAST(FLOOR(@p_running_seconds) AS int), @v_now));
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;

        SELECT @v_found = 1, @v_state = o.state, @v_expires_at = o.expires_at
        FROM workqueue.once_marker AS o WITH (UPDLOCK, HOLDLOCK, ROWLOCK)
        WHERE o.[key] = @v_key;

        IF @v_found = 0
        BEGIN
            INSERT INTO workqueue.once_marker ([key], state, token, expires_at)
            VALUES (@v_key, N'Running', @v_token, @v_running_until);
            SET @v_result_state = N'Run';
            SET @v_result_token = @v_token;
        END
        ELSE IF @v_expires_at <= @v_now
        BEGIN
            -- The marker expired (a Done TTL ran out, or a holder died while running): take it.
            UPDATE workqueue.once_marker
            SET state = N'Running', token = @v_token, expires_at = @v_running_until
            WHERE [key] = @v_key;
            SET @v_result_state = N'Run';
            SET @v_result_token = @v_token;
        END
        ELSE
            SET @v_result_state = CASE WHEN @v_state = N'Done' COLLATE Latin1_General_100_BIN2 THEN N'Done'
                                       ELSE N'Busy' END;

        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_result_state AS state, @v_result_token AS token;
END;
GO

-- returns: once_finish
CREATE OR ALTER PROCEDURE workqueue.once_finish
    @p_key nvarchar(max),
    @p_token uniqueidentifier,
    @p_ttl_seconds float
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_done bit = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF DATALENGTH(@p_key) <= 1700
        BEGIN
            UPDATE workqueue.once_marker
            SET state = N'Done', token = NULL,
                expires_at = DATEADD(
                    microsecond, CAST((@p_ttl_seconds - FLOOR(@p_ttl_seconds)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(@p_ttl_seconds) AS int), @v_now))
            WHERE [key] = CAST(@p_key AS nvarchar(850)) AND token = @p_token;
            IF @@ROWCOUNT > 0
                SET @v_done = 1;
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_done AS once_finish;
END;
GO

-- returns: once_abort
CREATE OR ALTER PROCEDURE workqueue.once_abort
    @p_key nvarchar(max),
    @p_token uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_aborted bit = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF DATALENGTH(@p_key) <= 1700
        BEGIN
            DELETE FROM workqueue.once_marker
            WHERE [key] = CAST(@p_key AS nvarchar(850)) AND token = @p_token;
            IF @@ROWCOUNT > 0
                SET @v_aborted = 1;
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_aborted AS once_abort;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- API keys for the REST publish and operator API: only the key's SHA-256 is stored, scopes is a
-- JSON array of scope names (PostgreSQL: text[]).
-- ---------------------------------------------------------------------------------------------

-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.api_key_create
    @p_id uniqueidentifier,
    @p_name nvarchar(max),
    @p_prefix nvarchar(200),
    @p_key_hash nvarchar(200),
    @p_scopes nvarchar(max),
    @p_expires_at datetimeoffset(6)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    BEGIN TRY
        INSERT INTO workqueue.api_key (id, name, prefix, key_hash, scopes, expires_at)
        VALUES (@p_id, @p_name, @p_prefix, @p_key_hash, @p_scopes, @p_expires_at);
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO

-- The key behind a prefix, if it is usable now; marks it used (at most once a minute).
-- returns: id, name, key_hash, scopes
CREATE OR ALTER PROCEDURE workqueue.api_key_lookup
    @p_prefix nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_found TABLE (
        id uniqueidentifier NOT NULL,
        name nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL,
        key_hash nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
        scopes nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL
    );

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        UPDATE workqueue.api_key
        SET last_used_at = @v_now
        WHERE prefix = @p_prefix AND revoked_at IS NULL
          AND (last_used_at IS NULL OR last_used_at < DATEADD(minute, -1, @v_now));
        INSERT INTO @v_found (id, name, key_hash, scopes)
        SELECT k.id, k.name, k.key_hash, k.scopes
        FROM workqueue.api_key AS k
        WHERE k.prefix = @p_prefix AND k.revoked_at IS NULL
          AND (k.expires_at IS NULL OR k.expires_at > @v_now);
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT f.id, f.name, f.key_hash, f.scopes FROM @v_found AS f;
END;
GO

-- returns: id, name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at
CREATE OR ALTER PROCEDURE workqueue.api_key_list
AS
BEGIN
    SET NOCOUNT ON;
    SELECT k.id, k.name, k.prefix, k.scopes, k.created_at, k.expires_at, k.revoked_at, k.last_used_at
    FROM workqueue.api_key AS k
    ORDER BY k.created_at, k.name;
END;
GO

-- Revokes by id, prefix or name; returns how many keys it revoked now.
-- returns: api_key_revoke
CREATE OR ALTER PROCEDURE workqueue.api_key_revoke
    @p_key nvarchar(max)
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_count int = 0;
    BEGIN TRY
        UPDATE workqueue.api_key
        SET revoked_at = SYSDATETIMEOFFSET()
        WHERE revoked_at IS NULL
          AND (id = TRY_CAST(@p_key AS uniqueidentifier) OR prefix = @p_key OR name = @p_key);
        SET @v_count = @@ROWCOUNT;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
    SELECT @v_count AS api_key_revoke;
END;
GO

-- ---------------------------------------------------------------------------------------------
-- Prune and schema versions
-- ---------------------------------------------------------------------------------------------

-- Purges terminal deliveries (Completed, Discarded) settled more than @p_older_than_seconds ago,
-- whatever their subscription's retention, in batches; returns how many it removed. Used by
-- `workqueue prune`; the sweeper keeps applying each subscription's retention by itself.
-- returns: prune
CREATE OR ALTER PROCEDURE workqueue.prune
    @p_older_than_seconds float,
    @p_limit int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_cutoff datetimeoffset(6);
    DECLARE @v_count int = 0;
    BEGIN TRY
        SET @v_cutoff = DATEADD(
            microsecond, -CAST((@p_older_than_seconds - FLOOR(@p_older_than_seconds)) * 1000000 AS int),
            DATEADD(second, -CAST(FLOOR(@p_older_than_seconds) AS int), @v_now));
        DELETE FROM workqueue.delivery
        WHERE id IN (
            SELECT TOP (@p_limit) x.id
            FROM workqueue.delivery AS x
            WHERE x.status IN (N'Completed', N'Discarded') AND x.settled_at < @v_cutoff
            ORDER BY x.settled_at
        );
        SET @v_count = @@ROWCOUNT;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
    SELECT @v_count AS prune;
END;
GO

-- Which migrations this database has (for validate-bindings). The table is created by the
-- migration runner before 0001 (fastapi_workqueue/database/mssql.py).
-- returns: version, name, checksum
CREATE OR ALTER PROCEDURE workqueue.schema_versions
AS
BEGIN
    SET NOCOUNT ON;
    SELECT m.version, m.name, m.checksum
    FROM workqueue.schema_migration AS m
    ORDER BY m.version;
END;
GO
