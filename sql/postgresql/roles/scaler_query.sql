-- fastapi-workqueue: the backlog of one subscription, for an autoscaler (KEDA, Azure Container Apps).
-- $1 = the subscription's name (for KEDA, write the name in place of $1 as a quoted literal).
-- One row, one column: claimable Pending (single flight per key applied) plus InFlight, each part
-- capped at 1000. It counts what `workqueue backlog` counts:
--   claimable = Pending deliveries without a key lock that are visible now
--             + keys whose next delivery is visible now and that no InFlight delivery holds
--               (a key counts once: Exclusive and Ordered run one delivery per key at a time;
--               an Ordered key whose head is dead-lettered or in backoff counts nothing),
--               and 0 while the subscription or its topic is Paused;
--   in_flight = InFlight deliveries (schedulers subtract running jobs from the metric).
-- No row when the subscription does not exist, so a misspelt name fails the scaler loudly.
SELECT CASE WHEN s.status = 'Active' AND t.status = 'Active' THEN least(
           (SELECT count(*) FROM (
                SELECT 1 FROM workqueue.delivery d
                WHERE d.subscription_id = s.id AND d.status = 'Pending' AND d.key_mode = 0
                  AND d.visible_at <= now()
                LIMIT 1000) unkeyed)
         + (SELECT count(*) FROM (
                SELECT 1 FROM workqueue.partition p
                WHERE p.subscription_id = s.id AND p.holder_id IS NULL AND p.next_id IS NOT NULL
                  AND p.next_visible_at <= now()
                LIMIT 1000) ready_keys),
           1000) ELSE 0 END
     + (SELECT count(*) FROM (
            SELECT 1 FROM workqueue.delivery d
            WHERE d.subscription_id = s.id AND d.status = 'InFlight'
            LIMIT 1000) in_flight) AS backlog
FROM workqueue.subscription s
JOIN workqueue.topic t ON t.name = s.topic
WHERE s.name = $1
