-- fastapi-workqueue: PostgreSQL, version 32: API keys limited to topics, a key check that never
-- hands a hash to the application, and dashboard sessions that end when their person signs out.
--
-- * api_key.topics: the topics a key may publish to (names, or patterns with *: billing.*); NULL
--   is every topic but the job queues' (jobs.*), which also need the scope workqueue:jobs. The
--   REST API checks both (fastapi_workqueue/web/topic_access.py). api_key_create takes the list
--   (p_topics, NULL by default: a key made as before reaches what it reached before) and
--   api_key_list shows it.
-- * api_key_lookup (0024) answered the stored SHA-256 of the key behind a prefix to the runtime
--   role, which compared it with the presented key: the application's login (or a copy of the
--   table) could read every key's hash, and the dashboard keyed its session cookies with it, so a
--   hash was as good as an admin session. It is dropped. api_key_verify(prefix, hash) answers a
--   key's id, name, scopes and topics only when the hash the caller computed from the presented
--   key matches; api_key_session(prefix) answers the same without a hash, for a dashboard session
--   whose cookie the application signed with a secret of its own (never in the database).
-- * api_key.session_generation: the dashboard's cookies carry it; api_key_end_sessions(id,
--   generation) counts it up when a person signs out, so every cookie of that key issued before
--   no longer works (the key itself still does).
--
-- The runtime role, where it exists, gets EXECUTE on api_key_verify, api_key_session and
-- api_key_end_sessions; the admin role on the new api_key_create and api_key_list (their
-- signatures change, so they are dropped and created again).

ALTER TABLE workqueue.api_key ADD COLUMN topics text[];
ALTER TABLE workqueue.api_key ADD COLUMN session_generation integer NOT NULL DEFAULT 0;

DROP FUNCTION workqueue.api_key_lookup(text);
DROP FUNCTION workqueue.api_key_create(uuid, text, text, text, text[], timestamptz);
DROP FUNCTION workqueue.api_key_list();

-- Stores a new key (only its SHA-256); a name an unrevoked key has is refused.
CREATE OR REPLACE FUNCTION workqueue.api_key_create(
    p_id uuid, p_name text, p_prefix text, p_key_hash text, p_scopes text[], p_expires_at timestamptz,
    p_topics text[] DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_constraint text;
BEGIN
    INSERT INTO workqueue.api_key (id, name, prefix, key_hash, scopes, expires_at, topics)
    VALUES (p_id, p_name, p_prefix, p_key_hash, p_scopes, p_expires_at, p_topics);
EXCEPTION WHEN unique_violation THEN
    GET STACKED DIAGNOSTICS v_constraint = CONSTRAINT_NAME;
    IF v_constraint = 'api_key_name_live' THEN
        RAISE EXCEPTION 'an API key named % exists already; revoke it first (workqueue api-keys revoke %) or pick another name',
            quote_literal(p_name), quote_literal(p_name) USING ERRCODE = 'unique_violation';
    END IF;
    RAISE;
END
$$;

-- The key behind a prefix whose SHA-256 is p_key_hash, if it is usable now; never its hash.
CREATE OR REPLACE FUNCTION workqueue.api_key_verify(p_prefix text, p_key_hash text)
RETURNS TABLE (id uuid, name text, scopes text[], topics text[], session_generation integer)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT k.id, k.name, k.scopes, k.topics, k.session_generation FROM workqueue.api_key k
    WHERE k.prefix = p_prefix AND k.key_hash = p_key_hash AND k.revoked_at IS NULL
      AND (k.expires_at IS NULL OR k.expires_at > now())
$$;

-- The key behind a prefix, if it is usable now, for a session the application signed; never its hash.
CREATE OR REPLACE FUNCTION workqueue.api_key_session(p_prefix text)
RETURNS TABLE (id uuid, name text, scopes text[], topics text[], session_generation integer)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT k.id, k.name, k.scopes, k.topics, k.session_generation FROM workqueue.api_key k
    WHERE k.prefix = p_prefix AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())
$$;

-- Ends the dashboard sessions of a key issued at p_session_generation (a sign-out).
CREATE OR REPLACE FUNCTION workqueue.api_key_end_sessions(p_id uuid, p_session_generation integer)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE workqueue.api_key k SET session_generation = k.session_generation + 1
    WHERE k.id = p_id AND k.session_generation = p_session_generation
$$;

-- Every key, without its hash.
CREATE OR REPLACE FUNCTION workqueue.api_key_list()
RETURNS TABLE (
    id uuid, name text, prefix text, scopes text[], created_at timestamptz, expires_at timestamptz,
    revoked_at timestamptz, last_used_at timestamptz, topics text[]
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT k.id, k.name, k.prefix, k.scopes, k.created_at, k.expires_at, k.revoked_at, k.last_used_at, k.topics
    FROM workqueue.api_key k ORDER BY k.created_at, k.name
$$;

REVOKE ALL ON FUNCTION workqueue.api_key_create(uuid, text, text, text, text[], timestamptz, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION workqueue.api_key_verify(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION workqueue.api_key_session(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION workqueue.api_key_end_sessions(uuid, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION workqueue.api_key_list() FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.api_key_verify(text, text), workqueue.api_key_session(text),
                                  workqueue.api_key_end_sessions(uuid, integer)
            TO workqueue_runtime;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_admin') THEN
        GRANT EXECUTE ON FUNCTION workqueue.api_key_create(uuid, text, text, text, text[], timestamptz, text[]),
                                  workqueue.api_key_list()
            TO workqueue_admin;
    END IF;
END
$$;
