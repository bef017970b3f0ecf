-- fastapi-workqueue: the PostgreSQL admin role.
--
-- workqueue_admin (NOLOGIN) manages the REST API's keys: api_key_create, api_key_list and
-- api_key_revoke (`workqueue api-keys create|list|revoke`), and deletes what operators retired:
-- delete_subscription and delete_topic (`workqueue subscriptions delete`, `workqueue topics
-- delete`). Nothing else: a key it creates may
-- carry any scope, so keep it from the application's login, which checks keys
-- (api_key_verify, api_key_touch) but cannot mint them, nor read their hashes. It holds no privilege on any table or
-- sequence.
--
--     CREATE ROLE keys_login LOGIN PASSWORD '...';
--     GRANT workqueue_admin TO keys_login;
--
-- Run it as the schema owner after migrating, and again after every upgrade, as runtime_role.sql
-- (whose header has the steps): it grants EXECUTE on the functions listed below and takes away
-- every other. Idempotent, plain SQL.

-- Runs at the same moment (deploy jobs starting together) take turns: each holds this lock until
-- its transaction ends, so run the script as one transaction (psql -1, or one string from a driver).
DO $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('workqueue.roles')::bigint);
END
$$;

-- The role, unless it exists. A concurrent run that creates it first is not an error.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_admin') THEN
        BEGIN
            CREATE ROLE workqueue_admin NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$;

-- The schema may be used (to name its functions) but nothing may be created in it.
GRANT USAGE ON SCHEMA workqueue TO workqueue_admin;
REVOKE CREATE ON SCHEMA workqueue FROM workqueue_admin;

-- No table or sequence privilege, and no function but the ones granted below, whatever was
-- granted before.
REVOKE ALL ON ALL TABLES IN SCHEMA workqueue FROM workqueue_admin;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA workqueue FROM workqueue_admin;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA workqueue FROM workqueue_admin;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA workqueue FROM workqueue_admin;

DO $$
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN
        SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = 'workqueue'::regnamespace
          AND p.proname = ANY (ARRAY[
              'api_key_create', 'api_key_list', 'api_key_revoke', 'delete_subscription', 'delete_topic'])
        ORDER BY 1
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO workqueue_admin', v_function);
    END LOOP;
END
$$;
