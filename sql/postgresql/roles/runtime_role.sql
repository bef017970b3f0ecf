-- fastapi-workqueue: the PostgreSQL runtime role.
--
-- workqueue_runtime (NOLOGIN) holds what an application needs to use the queue and nothing else:
-- USAGE on schema workqueue and EXECUTE on its functions. It holds no privilege on any table or
-- sequence, so every read and write goes through the SECURITY DEFINER functions of 0002 and their
-- claim, lease, settle and cancel rules cannot be bypassed with the application's connection.
--
-- How to use it:
--   1. Apply the migrations (as the owner of schema workqueue).
--   2. Run this script in the same database as that owner (or a superuser), e.g.
--          psql -v ON_ERROR_STOP=1 -1 -d <database> -f runtime_role.sql
--      or from Python: await conn.execute(sql_files.read("postgresql", "roles", "runtime_role.sql")).
--      Creating the role needs CREATEROLE; when the owner lacks it, have an administrator run
--      "CREATE ROLE workqueue_runtime NOLOGIN;" first and this script leaves the role as it is.
--   3. Give the application its own login role and make it a member:
--          CREATE ROLE app_login LOGIN PASSWORD '...';
--          GRANT workqueue_runtime TO app_login;
--      and connect the application as app_login.
--   4. Run this script again after every migration that adds functions: GRANT ... ON ALL
--      FUNCTIONS covers the functions that exist when it runs, and 0003 keeps new functions from
--      being executable by PUBLIC.
--
-- The script is idempotent and uses plain SQL only (no psql meta-commands), so it can be sent as
-- one string. The role is cluster-wide; the grants are made in the current database.

-- The role, unless it exists. A concurrent run that creates it first is not an error.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        BEGIN
            CREATE ROLE workqueue_runtime NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$;

-- The schema may be used (to name its functions) but nothing may be created in it.
GRANT USAGE ON SCHEMA workqueue TO workqueue_runtime;
REVOKE CREATE ON SCHEMA workqueue FROM workqueue_runtime;

-- Every function (and any procedure) of the schema.
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA workqueue TO workqueue_runtime;
GRANT EXECUTE ON ALL PROCEDURES IN SCHEMA workqueue TO workqueue_runtime;

-- No table or sequence privilege, whatever was granted before.
REVOKE ALL ON ALL TABLES IN SCHEMA workqueue FROM workqueue_runtime;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA workqueue FROM workqueue_runtime;
