-- fastapi-workqueue: SQL Server, version 17: an API key is marked used only once it proved itself,
-- and two live keys cannot share a name. Mirrors sql/postgresql/0024 (whose header says why):
-- api_key_lookup only reads, api_key_touch marks a key used after its hash matched, and
-- api_key_create refuses a name an unrevoked key has. The name column is nvarchar(max), which no
-- index can hold: the check reads the table with UPDLOCK, HOLDLOCK (key creation is rare), where
-- PostgreSQL has a unique index. Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- A name an unrevoked key has is refused with THROW 51004 (PostgreSQL: unique_violation).
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
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_message nvarchar(2048);
    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF EXISTS (
            SELECT 1 FROM workqueue.api_key AS k WITH (UPDLOCK, HOLDLOCK)
            WHERE k.name = @p_name AND k.revoked_at IS NULL
        )
        BEGIN
            SET @v_message = CONCAT(
                N'an API key named ''', REPLACE(@p_name, N'''', N''''''), N''' exists already; revoke it first ',
                N'(workqueue api-keys revoke ''', REPLACE(@p_name, N'''', N''''''), N''') or pick another name');
            THROW 51004, @v_message, 1;
        END;
        INSERT INTO workqueue.api_key (id, name, prefix, key_hash, scopes, expires_at)
        VALUES (@p_id, @p_name, @p_prefix, @p_key_hash, @p_scopes, @p_expires_at);
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

-- The key behind a prefix, if it is usable now. Reads only: see api_key_touch.
-- returns: id, name, key_hash, scopes
CREATE OR ALTER PROCEDURE workqueue.api_key_lookup
    @p_prefix nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT k.id, k.name, k.key_hash, k.scopes
    FROM workqueue.api_key AS k
    WHERE k.prefix = @p_prefix AND k.revoked_at IS NULL
      AND (k.expires_at IS NULL OR k.expires_at > @v_now);
END;
GO

-- Marks a key used (at most once a minute); called once the key's hash matched.
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.api_key_touch
    @p_id uniqueidentifier
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    BEGIN TRY
        UPDATE workqueue.api_key
        SET last_used_at = @v_now
        WHERE id = @p_id AND revoked_at IS NULL
          AND (last_used_at IS NULL OR last_used_at < DATEADD(minute, -1, @v_now));
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO
