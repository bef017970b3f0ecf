-- fastapi-workqueue: the SQL Server role of the AWS layer.
--
-- The AWS layer (fastapi_workqueue.aws) keeps the transactional outbox (workqueue.aws_outbox) and the
-- imported bindings (workqueue.aws_binding), and reaches them only through procedures, like the core.
-- workqueue_runtime holds none of them (runtime_role.sql), so an app whose topics are on AWS also
-- needs this role. workqueue_aws holds EXECUTE on the procedures granted below, the same as
-- PostgreSQL's workqueue_aws (sql/postgresql/roles/aws_role.sql says what each is for), and no
-- privilege on any table: the procedures reach the tables through ownership chaining (they and
-- the tables have one owner, the owner of schema workqueue).
--
-- Importing bindings (`workqueue import-bindings`) replaces aws_binding's rows with
-- workqueue.aws_binding_replace: a deployment step, run as the owner of schema workqueue (or a
-- user the owner granted EXECUTE on that procedure to).
--
-- How to use it:
--   1. Apply the migrations as the owner of schema workqueue (`workqueue migrate`).
--   2. Run this script in the same database as that owner (or a member of db_owner /
--      db_securityadmin), e.g.
--          sqlcmd -S <server> -d <database> -b -i aws_role.sql
--      or `workqueue sql print roles/aws_role.sql --dialect mssql` from a wheel install.
--   3. Make the application's database user a member of it, beside workqueue_runtime:
--          ALTER ROLE workqueue_aws ADD MEMBER app_user;
--   4. Run this script again after every upgrade: it takes away every other privilege the role
--      held on the schema and its objects.
--
-- The script is idempotent. It DENYs SELECT, INSERT, UPDATE and DELETE on the schema: a member that
-- also holds db_datareader or db_datawriter still cannot touch the queue's tables directly (the
-- procedures are not stopped: objects reached through an unbroken ownership chain are not checked).

-- The role, unless it exists.
IF DATABASE_PRINCIPAL_ID(N'workqueue_aws') IS NULL
    EXEC (N'CREATE ROLE workqueue_aws');
GO

-- No privilege on the schema as a whole, whatever was granted before (EXECUTE included) ...
REVOKE EXECUTE, SELECT, INSERT, UPDATE, DELETE, REFERENCES, ALTER, CONTROL, TAKE OWNERSHIP, VIEW DEFINITION
    ON SCHEMA::workqueue FROM workqueue_aws;
GO

-- ... nor on any of its objects.
DECLARE @v_sql nvarchar(max) = N'';
SELECT @v_sql = @v_sql + N'REVOKE ' + CASE WHEN o.type IN ('U', 'V') THEN N'SELECT, INSERT, UPDATE, DELETE, REFERENCES'
                                           ELSE N'EXECUTE' END
    + N' ON OBJECT::' + QUOTENAME(s.name) + N'.' + QUOTENAME(o.name) + N' FROM workqueue_aws;' + NCHAR(10)
FROM sys.objects AS o
INNER JOIN sys.schemas AS s ON s.schema_id = o.schema_id
WHERE s.name = N'workqueue' AND o.type IN ('U', 'V', 'P', 'FN', 'IF', 'TF');
EXEC sys.sp_executesql @v_sql;
GO

-- EXECUTE on these procedures only.
GRANT EXECUTE ON OBJECT::workqueue.aws_outbox_write TO workqueue_aws;
GRANT EXECUTE ON OBJECT::workqueue.aws_outbox_take TO workqueue_aws;
GRANT EXECUTE ON OBJECT::workqueue.aws_outbox_mark_sent TO workqueue_aws;
GRANT EXECUTE ON OBJECT::workqueue.aws_outbox_defer TO workqueue_aws;
GRANT EXECUTE ON OBJECT::workqueue.aws_binding_list TO workqueue_aws;
GO

DENY SELECT, INSERT, UPDATE, DELETE ON SCHEMA::workqueue TO workqueue_aws;
GO
