-- fastapi-workqueue: SQLite, version 8: a minute-by-minute history of each subscription's counts,
-- which the dashboard charts (as PostgreSQL 0028, whose header says why and how). The routines
-- record_stats_history and stats_history are in fastapi_workqueue/database/sqlite_history.py; the
-- file's single writer keeps two processes from writing one minute twice.

CREATE TABLE stats_history (
    subscription_id  INTEGER NOT NULL,
    recorded_at      REAL NOT NULL,
    pending          INTEGER NOT NULL,
    in_flight        INTEGER NOT NULL,
    dead_lettered    INTEGER NOT NULL,
    completed        INTEGER NOT NULL,
    window_seconds   REAL NOT NULL,
    PRIMARY KEY (subscription_id, recorded_at)
);
CREATE INDEX stats_history_recorded_at ON stats_history (recorded_at);
