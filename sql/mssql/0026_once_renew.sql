-- fastapi-workqueue: SQL Server, version 26: a holder renews its once marker while it runs.
-- Mirrors once_renew (sql/postgresql/0035_once_renew.sql): without_overlapping holds its lock as a
-- once marker and renews it while its attempt runs, as a heartbeat renews a lease; a holder that
-- died stops renewing, so its marker still expires. roles/runtime_role.sql grants it.
-- Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

-- Keeps a Running key held for @p_running_seconds more while the caller's token holds it (an
-- overlap lock renewed while its attempt runs); 0 once the token no longer holds it.
-- returns: once_renew
CREATE OR ALTER PROCEDURE workqueue.once_renew
    @p_key nvarchar(max),
    @p_token uniqueidentifier,
    @p_running_seconds float
AS
BEGIN
    SET NOCOUNT ON;
    SET XACT_ABORT ON;
    DECLARE @v_own_transaction bit = CASE WHEN @@TRANCOUNT = 0 THEN 1 ELSE 0 END;
    DECLARE @v_now datetimeoffset(6) = SYSDATETIMEOFFSET();
    DECLARE @v_renewed bit = 0;

    BEGIN TRY
        IF @v_own_transaction = 1
            BEGIN TRANSACTION;
        IF DATALENGTH(@p_key) <= 1700
        BEGIN
            UPDATE workqueue.once_marker
            SET expires_at = DATEADD(
                    microsecond, CAST((@p_running_seconds - FLOOR(@p_running_seconds)) * 1000000 AS int),
                    DATEADD(second, CAST(FLOOR(@p_running_seconds) AS int), @v_now))
            WHERE [key] = CAST(@p_key AS nvarchar(850)) AND token = @p_token
              AND state = N'Running';
            IF @@ROWCOUNT > 0
                SET @v_renewed = 1;
        END;
        IF @v_own_transaction = 1
            COMMIT TRANSACTION;
    END TRY
    BEGIN CATCH
        IF @v_own_transaction = 1 AND @@TRANCOUNT > 0
            ROLLBACK TRANSACTION;
        THROW;
    END CATCH;
    SELECT @v_renewed AS once_renew;
END;
GO
