-- fastapi-workqueue: the PostgreSQL runtime role.
--
-- workqueue_runtime (NOLOGIN) holds what an application needs to run the queue and nothing else:
-- USAGE on schema workqueue and EXECUTE on the functions listed below. It holds no privilege on any
-- table or sequence, so every read and write goes through the SECURITY DEFINER functions and their
-- claim, lease, settle and cancel rules cannot be bypassed with the application's connection.
--
-- What it may call:
--   * the work: publish, publish_one, claim, claim_many, heartbeat, settle (a
--     release is a settle), and the once markers (once_begin, once_finish, once_abort, once_renew);
--   * what the jobs layer adds: a unique job frees its key (release_deduplication_key), durable
--     steps (step_get, step_put), stored results (result_put, result_get), a wait for a job's end
--     (watch_message), a debounced dispatch (debounce), groups (group_create, group_members), a
--     schedule's look at the ticks it dispatched (known_messages);
--   * the process registry every host keeps (process_beat, process_stop) and reads
--     (list_processes);
--   * the sweeper, which every host runs by default (sweep, and record_stats_history, the minute
--     by minute history it writes for the dashboard's chart);
--   * the topology the app declares and syncs when it starts (sync_topic, sync_subscription). A
--     runtime login can therefore change a subscription's policy, but never its status: pausing
--     and resuming are the operator's (see operator_role.sql). Where the topology should change
--     only by deployment, set WORKQUEUE_SYNC_TOPOLOGY=false in the app, revoke these two from
--     workqueue_runtime after running this script and sync from the deployment with a login that
--     holds them (the schema owner's, say);
--   * the read-only operator views the app, its REST API and its dashboard serve: stats, backlog,
--     list_deliveries, get_delivery, message_deliveries, delivery_attempts, search_deliveries, partitions, list_subscriptions, list_topics,
--     schema_versions, stats_history, live_counts, blocked_keys and flow_state;
--   * the REST API's key check: api_key_verify (the key behind a prefix, answered only when the
--     hash of the presented key matches; never a stored hash) and api_key_touch (marks a key used
--     once it matched); the dashboard's sessions: api_key_session (a key's scopes and session
--     generation, for a cookie the app signed with its own secret) and api_key_end_sessions
--     (sign-out).
-- What it may not: replay, discard (and cancel), pause and resume (set_subscription_status),
-- prune, discard_dead_letters and rewrite_payload are workqueue_operator's; creating, listing and
-- revoking API keys workqueue_admin's (admin_role.sql); the helpers the functions call for
-- themselves are nobody's. A login of an app that serves the REST API's operator calls (replay,
-- discard, pause, resume) must be a member of workqueue_operator too.
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
--   4. Run this script again after every upgrade: it grants EXECUTE on the listed functions as
--      they exist when it runs (a migration that creates one of them again grants it to this role
--      itself, when the role exists), and takes away EXECUTE on every other function of the schema,
--      including what an earlier version of this script granted.
--
-- The script is idempotent and uses plain SQL only (no psql meta-commands), so it can be sent as
-- one string (which PostgreSQL runs as one transaction). The role is cluster-wide; the grants are
-- made in the current database.

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

-- No table or sequence privilege, and no function but the ones granted below, whatever was
-- granted before.
REVOKE ALL ON ALL TABLES IN SCHEMA workqueue FROM workqueue_runtime;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA workqueue FROM workqueue_runtime;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA workqueue FROM workqueue_runtime;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA workqueue FROM workqueue_runtime;

DO $$
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN
        SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = 'workqueue'::regnamespace
          AND p.proname = ANY (ARRAY[
              'publish', 'publish_one', 'claim', 'heartbeat', 'settle',
              'once_begin', 'once_finish', 'once_abort', 'once_renew',
              'sweep', 'record_stats_history',
              'sync_topic', 'sync_subscription',
              'stats', 'backlog', 'list_deliveries', 'get_delivery', 'partitions',
              'list_subscriptions', 'list_topics', 'schema_versions', 'stats_history',
              'live_counts', 'blocked_keys', 'flow_state',
              'api_key_verify', 'api_key_touch', 'api_key_session', 'api_key_end_sessions',
              'claim_many', 'known_messages', 'message_deliveries', 'delivery_attempts', 'search_deliveries',
              'release_deduplication_key', 'step_get', 'step_put', 'result_put', 'result_get',
              'watch_message', 'debounce', 'group_create', 'group_members',
              'process_beat', 'process_stop', 'list_processes'])
        ORDER BY 1
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO workqueue_runtime', v_function);
    END LOOP;
END
$$;
