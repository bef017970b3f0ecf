-- fastapi-workqueue: PostgreSQL, version 6: API keys for the REST publish and operator API.
--
-- A key is shown once when it is created; only its SHA-256 is stored. The public prefix finds
-- the row, the hash proves the key. Keys carry scopes (workqueue:publish, workqueue:read,
-- workqueue:operate, workqueue:admin), may expire and can be revoked.

CREATE TABLE workqueue.api_key (
    id            uuid PRIMARY KEY,
    name          text NOT NULL,
    prefix        text NOT NULL UNIQUE,
    key_hash      text NOT NULL,
    scopes        text[] NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz,
    revoked_at    timestamptz,
    last_used_at  timestamptz
);

CREATE OR REPLACE FUNCTION workqueue.api_key_create(
    p_id uuid, p_name text, p_prefix text, p_key_hash text, p_scopes text[], p_expires_at timestamptz
) RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO workqueue.api_key (id, name, prefix, key_hash, scopes, expires_at)
    VALUES (p_id, p_name, p_prefix, p_key_hash, p_scopes, p_expires_at)
$$;

-- The key behind a prefix, if it is usable now; marks it used (at most once a minute).
CREATE OR REPLACE FUNCTION workqueue.api_key_lookup(p_prefix text)
RETURNS TABLE (id uuid, name text, key_hash text, scopes text[])
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    UPDATE workqueue.api_key k SET last_used_at = now()
    WHERE k.prefix = p_prefix AND k.revoked_at IS NULL
      AND (k.last_used_at IS NULL OR k.last_used_at < now() - interval '1 minute');
    RETURN QUERY
    SELECT k.id, k.name, k.key_hash, k.scopes FROM workqueue.api_key k
    WHERE k.prefix = p_prefix AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now());
END
$$;

CREATE OR REPLACE FUNCTION workqueue.api_key_list()
RETURNS TABLE (
    id uuid, name text, prefix text, scopes text[], created_at timestamptz, expires_at timestamptz,
    revoked_at timestamptz, last_used_at timestamptz
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT k.id, k.name, k.prefix, k.scopes, k.created_at, k.expires_at, k.revoked_at, k.last_used_at
    FROM workqueue.api_key k ORDER BY k.created_at, k.name
$$;

-- Revokes by id, prefix or name; returns how many keys it revoked now.
CREATE OR REPLACE FUNCTION workqueue.api_key_revoke(p_key text)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count integer;
BEGIN
    UPDATE workqueue.api_key k SET revoked_at = now()
    WHERE k.revoked_at IS NULL
      AND (k.id::text = lower(p_key) OR k.prefix = p_key OR k.name = p_key);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Purges terminal deliveries (Completed, Discarded) settled more than p_older_than_seconds ago,
-- whatever their subscription's retention, in batches; returns how many it removed. Used by
-- `workqueue prune`; the sweeper keeps applying each subscription's retention by itself.
CREATE OR REPLACE FUNCTION workqueue.prune(p_older_than_seconds double precision, p_limit integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM workqueue.delivery d
    WHERE d.id IN (
        SELECT x.id FROM workqueue.delivery x
        WHERE x.status IN ('Completed', 'Discarded')
          AND x.settled_at < now() - make_interval(secs => p_older_than_seconds)
        ORDER BY x.settled_at
        LIMIT p_limit
    );
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Which migrations this database has (for validate-bindings).
CREATE OR REPLACE FUNCTION workqueue.schema_versions()
RETURNS TABLE (version integer, name text, checksum text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m.version, m.name, m.checksum FROM workqueue.schema_migration m ORDER BY m.version
$$;
