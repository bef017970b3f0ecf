-- fastapi-workqueue: SQLite, version 9: API keys limited to topics, and dashboard sessions that
-- end when their person signs out (as PostgreSQL 0032, whose header says why). topics is a JSON
-- array of topic names or patterns (NULL: every topic but the job queues'); session_generation is
-- counted up by a sign-out. The routines api_key_verify and api_key_session (queries.sql) answer
-- a key without its hash; api_key_lookup, which answered the hash, is gone.

ALTER TABLE api_key ADD COLUMN topics TEXT;
ALTER TABLE api_key ADD COLUMN session_generation INTEGER NOT NULL DEFAULT 0;
