-- fastapi-workqueue: SQL Server, version 23: API keys limited to topics, a key check that never
-- hands a hash to the application, and dashboard sessions that end when their person signs out.
-- Mirrors sql/postgresql/0032 (whose header says why): api_key.topics (a JSON array of topic
-- names or patterns; NULL for every topic but the job queues') and api_key.session_generation;
-- api_key_create takes @p_topics and api_key_list answers it; api_key_lookup, which answered a
-- key's stored hash, is dropped; api_key_verify answers a key only when the hash of the presented
-- key matches, api_key_session answers it without a hash (for a cookie the app signed) and
-- api_key_end_sessions counts the generation up at a sign-out.
--
-- The table is built again with the two columns (as 0022 builds the outbox again: a table's text
-- is its definition here): its rows are copied aside, the table dropped and created anew, and the
-- rows put back. The runner applies every batch in one transaction. Run roles/runtime_role.sql
-- again after migrating: it grants the new procedures. Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

SELECT id, name, prefix, key_hash, scopes, created_at, expires_at, revoked_at, last_used_at
INTO workqueue.api_key_0023_copy
FROM workqueue.api_key WITH (TABLOCKX);
DROP TABLE workqueue.api_key;
GO

CREATE TABLE workqueue.api_key (
    id            uniqueidentifier NOT NULL,
    name          nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL,
    prefix        nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    key_hash      nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    scopes        nvarchar(max) COLLATE Latin1_General_100_BIN2 NOT NULL
                  CONSTRAINT api_key_scopes_json CHECK (ISJSON(scopes) = 1),
    created_at    datetimeoffset(6) NOT NULL CONSTRAINT api_key_created_at_default DEFAULT SYSDATETIMEOFFSET(),
    expires_at    datetimeoffset(6) NULL,
    revoked_at    datetimeoffset(6) NULL,
    last_used_at  datetimeoffset(6) NULL,
    topics        nvarchar(max) COLLATE Latin1_General_100_BIN2 NULL
                  CONSTRAINT api_key_topics_json CHECK (topics IS NULL OR ISJSON(topics) = 1),
    session_generation int NOT NULL CONSTRAINT api_key_session_generation_default DEFAULT 0,
    CONSTRAINT api_key_pk PRIMARY KEY CLUSTERED (id),
    CONSTRAINT api_key_prefix_unique UNIQUE (prefix)
);
GO

INSERT INTO workqueue.api_key (id, name, prefix, key_hash, scopes, created_at, expires_at, revoked_at,
    last_used_at)
SELECT id, name, prefix, key_hash, scopes, created_at, expires_at, revoked_at, last_used_at
FROM workqueue.api_key_0023_copy;
DROP TABLE workqueue.api_key_0023_copy;
GO

DROP PROCEDURE IF EXISTS workqueue.api_key_lookup;
GO

-- A name an unrevoked key has is refused with THROW 51004 (PostgreSQL: unique_violation).
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.api_key_create
    @p_id uniqueidentifier,
    @p_name nvarchar(max),
    @p_prefix nvarchar(200),
    @p_key_hash nvarchar(200),
    @p_scopes nvarchar(max),
    @p_expires_at datetimeoffset(6),
    @p_topics nvarchar(max) = NULL
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
        INSERT INTO workqueue.api_key (id, name, prefix, key_hash, scopes, expires_at, topics)
        VALUES (@p_id, @p_name, @p_prefix, @p_key_hash, @p_scopes, @p_expires_at, @p_topics);
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

-- The key behind a prefix whose SHA-256 is @p_key_hash, if it is usable now; never its hash.
-- returns: id, name, scopes, topics, session_generation
CREATE OR ALTER PROCEDURE workqueue.api_key_verify
    @p_prefix nvarchar(200),
    @p_key_hash nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT k.id, k.name, k.scopes, k.topics, k.session_generation
    FROM workqueue.api_key AS k
    WHERE k.prefix = @p_prefix AND k.key_hash = @p_key_hash AND k.revoked_at IS NULL
      AND (k.expires_at IS NULL OR k.expires_at > @v_now);
END;
GO

-- The key behind a prefix, if it is usable now, for a session the application signed; never its hash.
-- returns: id, name, scopes, topics, session_generation
CREATE OR ALTER PROCEDURE workqueue.api_key_session
    @p_prefix nvarchar(200)
AS
BEGIN
    SET NOCOUNT ON;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    SELECT k.id, k.name, k.scopes, k.topics, k.session_generation
    FROM workqueue.api_key AS k
    WHERE k.prefix = @p_prefix AND k.revoked_at IS NULL
      AND (k.expires_at IS NULL OR k.expires_at > @v_now);
END;
GO

-- Ends the dashboard sessions of a key issued at @p_session_generation (a sign-out).
-- returns: nothing
CREATE OR ALTER PROCEDURE workqueue.api_key_end_sessions
    @p_id uniqueidentifier,
    @p_session_generation int
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    BEGIN TRY
        UPDATE workqueue.api_key
        SET session_generation = session_generation + 1
        WHERE id = @p_id AND session_generation = @p_session_generation;
    END TRY
    BEGIN CATCH
        THROW;
    END CATCH;
END;
GO

-- returns: id, name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at, topics
CREATE OR ALTER PROCEDURE workqueue.api_key_list
AS
BEGIN
    SET NOCOUNT ON;
    SELECT k.id, k.name, k.prefix, k.scopes, k.created_at, k.expires_at, k.revoked_at, k.last_used_at, k.topics
    FROM workqueue.api_key AS k
    ORDER BY k.created_at, k.name;
END;
GO
