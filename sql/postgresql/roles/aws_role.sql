-- fastapi-workqueue: the PostgreSQL role of the AWS layer.
--
-- The AWS layer (fastapi_workqueue.aws) keeps the transactional outbox (workqueue.aws_outbox) and the
-- imported bindings (workqueue.aws_binding), and reaches them only through SECURITY DEFINER
-- functions, like the core. workqueue_runtime holds none of them (runtime_role.sql), so an app whose
-- topics are on AWS also needs this role:
--
--   workqueue_aws (NOLOGIN): USAGE on schema workqueue and EXECUTE on
--     * aws_outbox_write: a publish writes its rows in the caller's transaction;
--     * aws_outbox_take, aws_outbox_mark_sent, aws_outbox_defer: the relay locks the due rows,
--       sends them to SNS, marks them sent or puts them off;
--     * aws_binding_list: the host reads the imported bindings.
--   Nothing else: no privilege on any table or sequence.
--
-- Importing bindings (`workqueue import-bindings`) replaces aws_binding's rows with
-- aws_binding_replace: a deployment step, run as the schema owner (or a login the owner granted
-- EXECUTE ON FUNCTION workqueue.aws_binding_replace to).
--
-- How to use it: after the migrations, as the schema owner (or a superuser), in the same database:
--     psql -v ON_ERROR_STOP=1 -1 -d <database> -f aws_role.sql
--     GRANT workqueue_runtime, workqueue_aws TO app_login;
-- (`workqueue sql print roles/aws_role.sql` prints it from a wheel install.) Idempotent; run it
-- again after every upgrade: it takes away every other privilege the role held in the schema.

-- Runs at the same moment (deploy jobs starting together) take turns: each holds this lock until
-- its transaction ends, so run the script as one transaction (psql -1, or one string from a driver).
DO $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('workqueue.roles')::bigint);
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_aws') THEN
        BEGIN
            CREATE ROLE workqueue_aws NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA workqueue TO workqueue_aws;
REVOKE CREATE ON SCHEMA workqueue FROM workqueue_aws;

REVOKE ALL ON ALL TABLES IN SCHEMA workqueue FROM workqueue_aws;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA workqueue FROM workqueue_aws;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA workqueue FROM workqueue_aws;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA workqueue FROM workqueue_aws;

DO $$
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN
        SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = 'workqueue'::regnamespace
          AND p.proname = ANY (ARRAY[
              'aws_outbox_write', 'aws_outbox_take', 'aws_outbox_mark_sent', 'aws_outbox_defer',
              'aws_binding_list'])
        ORDER BY 1
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO workqueue_aws', v_function);
    END LOOP;
END
$$;
