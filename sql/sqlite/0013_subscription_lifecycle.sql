-- fastapi-workqueue: SQLite, version 13: a subscription or a topic can be retired, then deleted (as
-- PostgreSQL 0036, whose header says why and how). The routines retire_subscription,
-- discard_pending, delete_subscription, set_topic_status and delete_topic are in
-- fastapi_workqueue/database/sqlite_routines.py.

ALTER TABLE topic ADD COLUMN retired_at REAL;
ALTER TABLE subscription ADD COLUMN retired_at REAL;
