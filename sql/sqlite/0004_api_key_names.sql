-- fastapi-workqueue: SQLite, version 4: two unrevoked API keys cannot share a name (as PostgreSQL
-- 0024; the routine api_key_create says so first, with what to do). A file that already holds
-- two live keys of one name fails this migration (UNIQUE constraint failed: api_key.name): revoke
-- all but one of each (workqueue api-keys list, then workqueue api-keys revoke <id>) and migrate
-- again.

CREATE UNIQUE INDEX api_key_name_live ON api_key (name) WHERE revoked_at IS NULL;
