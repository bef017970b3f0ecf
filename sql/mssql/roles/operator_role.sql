-- fastapi-workqueue: the SQL Server operator role.
--
-- workqueue_operator may act on the work (replay, discard and cancel, pause and resume, prune,
-- discard old dead letters, rewrite a stored payload, a sweeper pass) and read what it acts on; it cannot publish, claim or settle, nor manage API keys.
-- The same as PostgreSQL's workqueue_operator (sql/postgresql/roles/operator_role.sql says more).
-- Run it as runtime_role.sql says (its header has the steps), and give the role to the user the
-- `workqueue` command runs under for operator actions, and to the user of an app that serves the
-- REST API's operator calls:
--     ALTER ROLE workqueue_operator ADD MEMBER ops_user;
--
-- The script is idempotent. Besides revoking any table privilege granted to the role, it DENYs
-- SELECT, INSERT, UPDATE and DELETE on the schema: a member that also holds db_datareader or
-- db_datawriter still cannot touch the queue's tables directly. (DENY does not stop the
-- procedures: permissions on objects reached through an unbroken ownership chain are not
-- checked.)

-- The role, unless it exists.
IF DATABASE_PRINCIPAL_ID(N'workqueue_operator') IS NULL
    EXEC (N'CREATE ROLE workqueue_operator');
GO

-- No privilege on the schema as a whole, whatever was granted before (EXECUTE included) ...
REVOKE EXECUTE, SELECT, INSERT, UPDATE, DELETE, REFERENCES, ALTER, CONTROL, TAKE OWNERSHIP, VIEW DEFINITION
    ON SCHEMA::workqueue FROM workqueue_operator;
GO

-- ... nor on any of its objects.
DECLARE @v_sql nvarchar(max) = N'';
SELECT @v_sql = @v_sql + N'REVOKE ' + CASE WHEN o.type IN ('U', 'V') THEN N'SELECT, INSERT, UPDATE, DELETE, REFERENCES'
                                           ELSE N'EXECUTE' END
    + N' ON OBJECT::' + QUOTENAME(s.name) + N'.' + QUOTENAME(o.name) + N' FROM workqueue_operator;' + NCHAR(10)
FROM sys.objects AS o
INNER JOIN sys.schemas AS s ON s.schema_id = o.schema_id
WHERE s.name = N'workqueue' AND o.type IN ('U', 'V', 'P', 'FN', 'IF', 'TF');
EXEC sys.sp_executesql @v_sql;
GO

-- EXECUTE on these procedures only.
GRANT EXECUTE ON OBJECT::workqueue.replay TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.discard TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.set_subscription_status TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.retire_subscription TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.discard_pending TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.set_topic_status TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.prune TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.sweep TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.record_stats_history TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.stats TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.backlog TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.list_deliveries TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.list_processes TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.get_delivery TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.partitions TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.list_subscriptions TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.list_topics TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.schema_versions TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.discard_dead_letters TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.rewrite_payload TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.message_deliveries TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.delivery_attempts TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.search_deliveries TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.stats_history TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.live_counts TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.flow_state TO workqueue_operator;
GRANT EXECUTE ON OBJECT::workqueue.blocked_keys TO workqueue_operator;
GO

DENY SELECT, INSERT, UPDATE, DELETE ON SCHEMA::workqueue TO workqueue_operator;
GO
