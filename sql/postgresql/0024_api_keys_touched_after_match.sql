-- fastapi-workqueue: PostgreSQL, version 24: an API key is marked used only once it proved itself,
-- and two live keys cannot share a name.
--
-- api_key_lookup (0006) set last_used_at on the key behind a prefix before the caller compared the
-- key's hash (fastapi_workqueue/core/keys.py: verify_key): anyone who sent a made-up key with a real
-- prefix (the prefix is public: it is printed in listings and logs) could keep a dead key looking
-- used. Now api_key_lookup only reads, and api_key_touch(id) marks the key used; verify_key calls it
-- after the hash matched. api_key_touch still writes at most once a minute per key.
--
-- api_key_create refuses a name that an unrevoked key has (the unique index api_key_name_live), with
-- an error that says to revoke that key or pick another name: api_key_revoke takes a name too, and
-- would otherwise revoke every key of that name at once. A database that already holds two live keys
-- of one name stops this migration with the names to resolve.
--
-- Replaces api_key_create and api_key_lookup of 0006 (same names, parameters and results).

DO $$
DECLARE
    v_names text;
BEGIN
    SELECT string_agg(format('%L', d.name), ', ' ORDER BY d.name) INTO v_names
    FROM (SELECT k.name FROM workqueue.api_key k WHERE k.revoked_at IS NULL
          GROUP BY k.name HAVING count(*) > 1) d;
    IF v_names IS NOT NULL THEN
        RAISE EXCEPTION 'unrevoked API keys share the names %; revoke all but one of each (workqueue api-keys list, then workqueue api-keys revoke <id>) and migrate again',
            v_names USING ERRCODE = 'unique_violation';
    END IF;
END
$$;

CREATE UNIQUE INDEX api_key_name_live ON workqueue.api_key (name) WHERE revoked_at IS NULL;

CREATE OR REPLACE FUNCTION workqueue.api_key_create(
    p_id uuid, p_name text, p_prefix text, p_key_hash text, p_scopes text[], p_expires_at timestamptz
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_constraint text;
BEGIN
    INSERT INTO workqueue.api_key (id, name, prefix, key_hash, scopes, expires_at)
    VALUES (p_id, p_name, p_prefix, p_key_hash, p_scopes, p_expires_at);
EXCEPTION WHEN unique_violation THEN
    GET STACKED DIAGNOSTICS v_constraint = CONSTRAINT_NAME;
    IF v_constraint = 'api_key_name_live' THEN
        RAISE EXCEPTION 'an API key named % exists already; revoke it first (workqueue api-keys revoke %) or pick another name',
            quote_literal(p_name), quote_literal(p_name) USING ERRCODE = 'unique_violation';
    END IF;
    RAISE;
END
$$;

-- The key behind a prefix, if it is usable now. Reads only: see api_key_touch.
CREATE OR REPLACE FUNCTION workqueue.api_key_lookup(p_prefix text)
RETURNS TABLE (id uuid, name text, key_hash text, scopes text[])
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT k.id, k.name, k.key_hash, k.scopes FROM workqueue.api_key k
    WHERE k.prefix = p_prefix AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())
$$;

-- Marks a key used (at most once a minute); called once the key's hash matched.
CREATE OR REPLACE FUNCTION workqueue.api_key_touch(p_id uuid)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    UPDATE workqueue.api_key k SET last_used_at = now()
    WHERE k.id = p_id AND k.revoked_at IS NULL
      AND (k.last_used_at IS NULL OR k.last_used_at < now() - interval '1 minute')
$$;

REVOKE ALL ON FUNCTION workqueue.api_key_touch(uuid) FROM PUBLIC;

-- A database whose runtime role was set up before this version keeps checking API keys.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'workqueue_runtime') THEN
        GRANT EXECUTE ON FUNCTION workqueue.api_key_touch(uuid) TO workqueue_runtime;
    END IF;
END
$$;
