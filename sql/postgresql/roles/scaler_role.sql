-- fastapi-workqueue: the PostgreSQL scaler role.
--
-- workqueue_scaler (NOLOGIN) may run the scaler query (roles/scaler_query.sql) and nothing else:
-- USAGE on schema workqueue and SELECT on the columns that query reads. It cannot read payloads,
-- errors, reasons or API keys, cannot write anything and cannot call the queue's functions (the
-- schema keeps them from PUBLIC).
--
-- How to use it:
--   1. Apply the migrations (as the owner of schema workqueue).
--   2. Run this script in the same database as that owner (or a superuser), e.g.
--          psql -v ON_ERROR_STOP=1 -1 -d <database> -f scaler_role.sql
--      Creating the role needs CREATEROLE; when the owner lacks it, have an administrator run
--      "CREATE ROLE workqueue_scaler NOLOGIN;" first and this script leaves the role as it is.
--   3. Give the scaler its own login and make it a member:
--          CREATE ROLE keda_scaler LOGIN PASSWORD '...';
--          GRANT workqueue_scaler TO keda_scaler;
--   4. Run this script again after upgrading the library: a migration may change what the query
--      reads.
--
-- The script is idempotent and uses plain SQL only (no psql meta-commands), so it can be sent as
-- one string. The role is cluster-wide; the grants are made in the current database.

-- Runs at the same moment (deploy jobs starting together) take turns: each holds this lock until
-- its transaction ends, so run the script as one transaction (psql -1, or one string from a driver).
DO $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('workqueue.roles')::bigint);
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_scaler') THEN
        BEGIN
            CREATE ROLE workqueue_scaler NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA workqueue TO workqueue_scaler;
REVOKE CREATE ON SCHEMA workqueue FROM workqueue_scaler;

-- Nothing but what is granted below, whatever was granted before (revoking a table privilege
-- also revokes it on every column).
REVOKE ALL ON ALL TABLES IN SCHEMA workqueue FROM workqueue_scaler;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA workqueue FROM workqueue_scaler;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA workqueue FROM workqueue_scaler;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA workqueue FROM workqueue_scaler;

GRANT SELECT (id, name, topic, status) ON workqueue.subscription TO workqueue_scaler;
GRANT SELECT (name, status) ON workqueue.topic TO workqueue_scaler;
GRANT SELECT (subscription_id, status, key_mode, visible_at) ON workqueue.delivery TO workqueue_scaler;
GRANT SELECT (subscription_id, holder_id, next_id, next_visible_at) ON workqueue.partition TO workqueue_scaler;
