-- fastapi-workqueue: the SQL Server runtime role.
--
-- workqueue_runtime holds what an application needs to run the queue and nothing else: EXECUTE on
-- the procedures granted below, the same as PostgreSQL's workqueue_runtime but publish_one, which
-- only PostgreSQL has (sql/postgresql/roles/runtime_role.sql says what each is for and what is
-- left to workqueue_operator and workqueue_admin). It holds no privilege on any table, so every read and
-- write goes through the procedures and their claim, lease, settle and cancel rules cannot be
-- bypassed with the application's connection. The procedures reach the tables, and the helpers
-- they call, through ownership chaining: they and the tables have one owner (the owner of schema
-- workqueue), so SQL Server checks EXECUTE on the procedure called and nothing on what it touches.
-- (None of them uses dynamic SQL, which would break the chain.)
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
--   4. Run this script again after every upgrade: EXECUTE is granted procedure by procedure, and
--      every other EXECUTE the role held on the schema (an earlier version of this script granted
--      it on the whole schema) is taken away.
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

-- No privilege on the schema as a whole, whatever was granted before (EXECUTE included) ...
REVOKE EXECUTE, SELECT, INSERT, UPDATE, DELETE, REFERENCES, ALTER, CONTROL, TAKE OWNERSHIP, VIEW DEFINITION
    ON SCHEMA::workqueue FROM workqueue_runtime;
GO

-- ... nor on any of its objects.
DECLARE @v_sql nvarchar(max) = N'';
SELECT @v_sql = @v_sql + N'REVOKE ' + CASE WHEN o.type IN ('U', 'V') THEN N'SELECT, INSERT, UPDATE, DELETE, REFERENCES'
                                           ELSE N'EXECUTE' END
    + N' ON OBJECT::' + QUOTENAME(s.name) + N'.' + QUOTENAME(o.name) + N' FROM workqueue_runtime;' + NCHAR(10)
FROM sys.objects AS o
INNER JOIN sys.schemas AS s ON s.schema_id = o.schema_id
WHERE s.name = N'workqueue' AND o.type IN ('U', 'V', 'P', 'FN', 'IF', 'TF');
EXEC sys.sp_executesql @v_sql;
GO

-- EXECUTE on these procedures only.
GRANT EXECUTE ON OBJECT::workqueue.publish TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.claim TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.heartbeat TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.settle TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.once_begin TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.once_finish TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.once_abort TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.once_renew TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.sweep TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.record_stats_history TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.sync_topic TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.sync_subscription TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.stats TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.backlog TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.list_deliveries TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.get_delivery TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.partitions TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.list_subscriptions TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.list_topics TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.schema_versions TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.stats_history TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.live_counts TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.flow_state TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.blocked_keys TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.api_key_verify TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.api_key_touch TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.api_key_session TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.api_key_end_sessions TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.process_beat TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.process_stop TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.list_processes TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.claim_many TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.known_messages TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.message_deliveries TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.delivery_attempts TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.search_deliveries TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.release_deduplication_key TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.step_get TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.step_put TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.result_put TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.result_get TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.debounce TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.group_create TO workqueue_runtime;
GRANT EXECUTE ON OBJECT::workqueue.group_members TO workqueue_runtime;
GO

DENY SELECT, INSERT, UPDATE, DELETE ON SCHEMA::workqueue TO workqueue_runtime;
GO
