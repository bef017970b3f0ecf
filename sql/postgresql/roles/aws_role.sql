-- fastapi-workqueue: the PostgreSQL role of the AWS layer's tables.
--
-- The AWS layer (fastapi_workqueue.aws) is a package of its own: it writes the transactional outbox
-- (workqueue.aws_outbox) and reads the imported bindings (workqueue.aws_binding)
-- with plain statements, not through the core's SECURITY DEFINER functions. workqueue_runtime holds
-- no table privilege (runtime_role.sql), so an app whose topics are on AWS also needs this role:
--
--   workqueue_aws (NOLOGIN): SELECT, INSERT and UPDATE on aws_outbox (a publish writes a row in the
--   caller's transaction, the relay marks it sent) and SELECT on aws_binding.
--   Nothing else: no DELETE, no other table, no sequence (the outbox id is an identity column).
--
-- Importing bindings (`workqueue import-bindings`) replaces aws_binding's rows: a deployment step,
-- run as the schema owner or a login granted INSERT and DELETE on workqueue.aws_binding.
--
-- How to use it: after the migrations, as the schema owner (or a superuser), in the same database:
--     psql -v ON_ERROR_STOP=1 -1 -d <database> -f aws_role.sql
--     GRANT workqueue_runtime, workqueue_aws TO app_login;
-- (`workqueue sql print roles/aws_role.sql` prints it from a wheel install.) Idempotent; run it
-- again after every upgrade.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_aws') THEN
        CREATE ROLE workqueue_aws NOLOGIN;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA workqueue TO workqueue_aws;
REVOKE ALL ON ALL TABLES IN SCHEMA workqueue FROM workqueue_aws;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA workqueue FROM workqueue_aws;
GRANT SELECT, INSERT, UPDATE ON workqueue.aws_outbox TO workqueue_aws;
GRANT SELECT ON workqueue.aws_binding TO workqueue_aws;
