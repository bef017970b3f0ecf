-- fastapi-workqueue: SQLite, version 3: stats read no history (as PostgreSQL 0022). The Completed
-- and Discarded deliveries of each subscription are counted in settled_count as they are made
-- (settle, lease expiry, discard) and taken away as they are deleted (purge, prune); stats reads
-- the other states through partial indexes. SQLite has one writer, so one row per subscription,
-- updated in place, serializes nothing that was not serialized already (PostgreSQL appends deltas
-- instead). The counts start from the deliveries the file holds when this migration runs.

CREATE TABLE settled_count (
    subscription_id  INTEGER PRIMARY KEY,
    completed        INTEGER NOT NULL,
    discarded        INTEGER NOT NULL
);

INSERT INTO settled_count (subscription_id, completed, discarded)
SELECT subscription_id, sum(status = 'Completed'), sum(status = 'Discarded')
FROM delivery
WHERE status IN ('Completed', 'Discarded')
GROUP BY subscription_id;
