-- fastapi-workqueue: PostgreSQL, version 27: what the AWS transport keeps in the database.
--
-- aws_binding holds the ARNs and queue URLs that `workqueue import-bindings` read from the
-- Terraform module's binding_import output, one row per topic or subscription (binding is the JSON
-- object of that item); an import replaces them all in one transaction.
--
-- aws_outbox is the transactional outbox of the aws topics: SNS cannot join a database
-- transaction, so a publish made in the caller's transaction writes its messages here and a relay
-- in the host forwards the committed rows to SNS. The relay locks up to a batch of unsent rows that
-- are due, oldest first, skipping the rows another relay holds (FOR UPDATE SKIP LOCKED), and keeps
-- only the rows with no earlier unsent row of their topic and partition key outside its own set: a
-- key another relay holds, or whose head waits out a backoff, is left alone, so each key is
-- forwarded by one relay at a time and in order. The locks last until the relay's transaction ends:
-- it sends, marks the rows sent (or defers them after throttling) and commits. A relay that dies
-- before the commit leaves the rows unsent; the next pass sends them again with the same MessageIDs
-- (FIFO topics deduplicate them within five minutes).
--
-- The AWS layer reads and writes these tables with plain statements (it is a package of its own,
-- outside the core's SECURITY DEFINER functions): a login that runs it needs SELECT, INSERT,
-- UPDATE and DELETE on both, which no role script grants (grant them to the app's login).

CREATE TABLE workqueue.aws_binding (
    kind         text NOT NULL CHECK (kind IN ('topic', 'subscription')),
    name         text NOT NULL,
    region       text NOT NULL,
    binding      jsonb NOT NULL,
    imported_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, name)
);

CREATE TABLE workqueue.aws_outbox (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic            text NOT NULL,
    message_id       uuid NOT NULL,
    partition_key    text,
    body             text NOT NULL,
    attributes       jsonb NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    attempts         integer NOT NULL DEFAULT 0,
    last_error       text,
    sent_at          timestamptz
);
-- The unsent rows in order, and each key's earliest unsent row.
CREATE INDEX aws_outbox_unsent ON workqueue.aws_outbox (id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_unsent_key ON workqueue.aws_outbox (topic, partition_key, id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_sent ON workqueue.aws_outbox (sent_at) WHERE sent_at IS NOT NULL;
