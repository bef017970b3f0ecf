-- fastapi-workqueue: PostgreSQL, version 35: a holder renews its once marker while it runs.
--
-- without_overlapping (fastapi_workqueue/jobs/middleware.py) holds its lock as a once marker
-- (once_begin) for a fixed time, by default the job lease. An attempt that ran longer than that
-- lost the lock while it still ran, and a second attempt with the same key could start beside it.
-- once_renew moves a Running marker's expiry to p_running_seconds from now while the caller's
-- token still holds it, as a heartbeat renews a lease; it answers false when the token no longer
-- holds the key (the marker expired and another holder took it, or it was finished or aborted).
-- A holder that died stops renewing, so its marker still expires. Granted to workqueue_runtime
-- where that role exists already (roles/runtime_role.sql grants it on a fresh set-up).

CREATE OR REPLACE FUNCTION workqueue.once_renew(p_key text, p_token uuid, p_running_seconds double precision)
RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH u AS (
        UPDATE workqueue.once_marker o
        SET expires_at = now() + make_interval(secs => p_running_seconds)
        WHERE o.key = p_key AND o.token = p_token AND o.state = 'Running'
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM u)
$$;

REVOKE ALL ON FUNCTION workqueue.once_renew(text, uuid, double precision) FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.once_renew(text, uuid, double precision) TO workqueue_runtime;
    END IF;
END
$$;
