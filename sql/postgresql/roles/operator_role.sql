-- fastapi-workqueue: the PostgreSQL operator role.
--
-- workqueue_operator (NOLOGIN) may act on the work: replay a dead letter, discard a delivery (or
-- cancel a running one), pause, resume and retire a subscription (set_subscription_status,
-- retire_subscription, discard_pending) or a topic (set_topic_status), prune old
-- deliveries, discard old dead letters (discard_dead_letters), rewrite a stored payload
-- (rewrite_payload: re-encryption with a new key) and run a sweeper pass (sweep,
-- record_stats_history), and read what it acts on (stats, backlog, list_deliveries, get_delivery,
-- message_deliveries, partitions, list_subscriptions, list_topics, schema_versions, list_processes, and the
-- dashboard's stats_history, live_counts, blocked_keys and flow_state). It cannot publish,
-- claim or settle (workqueue_runtime's, runtime_role.sql), nor create, list or revoke API keys
-- (workqueue_admin's, admin_role.sql), and holds no privilege on any table or sequence.
--
-- Give it to the login the `workqueue` command runs under for replay, discard, pause, resume and
-- prune, and to the login of an app that serves the REST API's operator calls (that login is a
-- member of workqueue_runtime too):
--     CREATE ROLE ops_login LOGIN PASSWORD '...';
--     GRANT workqueue_operator TO ops_login;
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
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_operator') THEN
        BEGIN
            CREATE ROLE workqueue_operator NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$;

-- The schema may be used (to name its functions) but nothing may be created in it.
GRANT USAGE ON SCHEMA workqueue TO workqueue_operator;
REVOKE CREATE ON SCHEMA workqueue FROM workqueue_operator;

-- No table or sequence privilege, and no function but the ones granted below, whatever was
-- granted before.
REVOKE ALL ON ALL TABLES IN SCHEMA workqueue FROM workqueue_operator;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA workqueue FROM workqueue_operator;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA workqueue FROM workqueue_operator;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA workqueue FROM workqueue_operator;

DO $$
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN
        SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = 'workqueue'::regnamespace
          AND p.proname = ANY (ARRAY[
              'replay', 'discard', 'set_subscription_status', 'prune', 'sweep', 'record_stats_history',
              'stats', 'backlog', 'list_deliveries', 'get_delivery', 'partitions',
              'list_subscriptions', 'list_topics', 'schema_versions', 'stats_history',
              'live_counts', 'blocked_keys', 'flow_state',
              'discard_dead_letters', 'rewrite_payload', 'message_deliveries', 'delivery_attempts', 'search_deliveries', 'list_processes',
              'retire_subscription', 'discard_pending', 'set_topic_status'])
        ORDER BY 1
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO workqueue_operator', v_function);
    END LOOP;
END
$$;
