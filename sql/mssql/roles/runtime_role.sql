-- fastapi-workqueue: the SQL Server runtime role.
--
-- workqueue_runtime holds what an application needs to use the queue and nothing else: EXECUTE on
-- schema workqueue (its stored procedures and the two helper functions). It holds no privilege on
-- any table, so every read and write goes through the procedures of 0002-0008 and their claim,
-- lease, settle and cancel rules cannot be bypassed with the application's connection. The
-- procedures reach the tables through ownership chaining: they and the tables have one owner
-- (the owner of schema workqueue), so SQL Server checks EXECUTE on the procedure and nothing on
-- the tables it touches. (None of them uses dynamic SQL, which would break the chain.)
--
-- How to use it:
--   1. Apply the migrations as the owner of schema workqueue (`workqueue migrate`).
--   2. Run this script in the same database as that owner (or a member of db_owner /
--      db_securityadmin), e.g.
--          sqlcmd -S <server> -d <database> -b -i runtime_role.sql
--      or from Python: split sql_files.read("mssql", "roles", "runtime_role.sql") on its GO lines
--      and execute each batch.
--   3. Give the application its own login and database user and make it a member:
--          CREATE LOGIN app_login WITH PASSWORD = '...';          -- in master
--          CREATE USER app_user FOR LOGIN app_login;              -- in the queue's database
--          ALTER ROLE workqueue_runtime ADD MEMBER app_user;
--      and connect the application as app_login.
--   4. EXECUTE is granted on the schema, so procedures added by later migrations are covered
--      without running this script again.
--
-- The script is idempotent. Besides revoking any table privilege granted to the role, it DENYs
-- SELECT, INSERT, UPDATE and DELETE on the schema: a member that also holds db_datareader or
-- db_datawriter still cannot touch the queue's tables directly. (DENY does not stop the
-- procedures: permissions on objects reached through an unbroken ownership chain are not
-- checked.)

-- The role, unless it exists.
IF DATABASE_PRINCIPAL_ID(N'workqueue_runtime') IS NULL
    EXEC (N'CREATE ROLE workqueue_runtime');
GO

-- EXECUTE on every procedure and function of the schema, now and later.
GRANT EXECUTE ON SCHEMA::workqueue TO workqueue_runtime;
GO

-- No table privilege, whatever was granted before: on the schema ...
REVOKE SELECT, INSERT, UPDATE, DELETE, REFERENCES, ALTER, CONTROL, TAKE OWNERSHIP, VIEW DEFINITION
    ON SCHEMA::workqueue FROM workqueue_runtime;
GO

-- ... and on each table and view of it.
DECLARE @v_sql nvarchar(max) = N'';
SELECT @v_sql = @v_sql + N'REVOKE SELECT, INSERT, UPDATE, DELETE, REFERENCES ON OBJECT::'
    + QUOTENAME(s.name) + N'.' + QUOTENAME(o.name) + N' FROM workqueue_runtime;' + NCHAR(10)
FROM sys.objects AS o
INNER JOIN sys.schemas AS s ON s.schema_id = o.schema_id
WHERE s.name = N'workqueue' AND o.type IN ('U', 'V');
EXEC sys.sp_executesql @v_sql;
GO

DENY SELECT, INSERT, UPDATE, DELETE ON SCHEMA::workqueue TO workqueue_runtime;
GO
