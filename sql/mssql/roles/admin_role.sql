-- fastapi-workqueue: the SQL Server admin role.
--
-- workqueue_admin manages the REST API's keys (api_key_create, api_key_list, api_key_revoke) and
-- nothing else: keep it from the application's user, which checks keys but cannot mint them. The
-- same as PostgreSQL's workqueue_admin (sql/postgresql/roles/admin_role.sql). Run it as
-- runtime_role.sql says (its header has the steps):
--     ALTER ROLE workqueue_admin ADD MEMBER keys_user;
--
-- The script is idempotent. Besides revoking any table privilege granted to the role, it DENYs
-- SELECT, INSERT, UPDATE and DELETE on the schema: a member that also holds db_datareader or
-- db_datawriter still cannot touch the queue's tables directly. (DENY does not stop the
-- procedures: permissions on objects reached through an unbroken ownership chain are not
-- checked.)

-- The role, unless it exists.
IF DATABASE_PRINCIPAL_ID(N'workqueue_admin') IS NULL
    EXEC (N'CREATE ROLE workqueue_admin');
GO

-- No privilege on the schema as a whole, whatever was granted before (EXECUTE included) ...
REVOKE EXECUTE, SELECT, INSERT, UPDATE, DELETE, REFERENCES, ALTER, CONTROL, TAKE OWNERSHIP, VIEW DEFINITION
    ON SCHEMA::workqueue FROM workqueue_admin;
GO

-- ... nor on any of its objects.
DECLARE @v_sql nvarchar(max) = N'';
SELECT @v_sql = @v_sql + N'REVOKE ' + CASE WHEN o.type IN ('U', 'V') THEN N'SELECT, INSERT, UPDATE, DELETE, REFERENCES'
                                           ELSE N'EXECUTE' END
    + N' ON OBJECT::' + QUOTENAME(s.name) + N'.' + QUOTENAME(o.name) + N' FROM workqueue_admin;' + NCHAR(10)
FROM sys.objects AS o
INNER JOIN sys.schemas AS s ON s.schema_id = o.schema_id
WHERE s.name = N'workqueue' AND o.type IN ('U', 'V', 'P', 'FN', 'IF', 'TF');
EXEC sys.sp_executesql @v_sql;
GO

-- EXECUTE on these procedures only.
GRANT EXECUTE ON OBJECT::workqueue.api_key_create TO workqueue_admin;
GRANT EXECUTE ON OBJECT::workqueue.api_key_list TO workqueue_admin;
GRANT EXECUTE ON OBJECT::workqueue.api_key_revoke TO workqueue_admin;
GRANT EXECUTE ON OBJECT::workqueue.delete_subscription TO workqueue_admin;
GRANT EXECUTE ON OBJECT::workqueue.delete_topic TO workqueue_admin;
GO

DENY SELECT, INSERT, UPDATE, DELETE ON SCHEMA::workqueue TO workqueue_admin;
GO
