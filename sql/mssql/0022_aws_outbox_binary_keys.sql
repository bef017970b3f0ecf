-- fastapi-workqueue: SQL Server, version 22: the outbox compares topics and partition keys as the
-- rest of the schema does. 0020 declared aws_outbox.topic nvarchar(200) and partition_key
-- nvarchar(450) with the database's default collation: keys longer than 450 characters (the
-- library allows 512) could not be written, and on a case-insensitive default two keys that
-- differ only in case waited for each other in the relay (BEHIND in
-- fastapi_workqueue/aws/outbox_mssql.py). Both now use Latin1_General_100_BIN2 and partition_key
-- is nvarchar(512), as in 0001 (see its top: type mapping, collation and key sizes). The key index
-- still fits SQL Server's 1700-byte nonclustered key: topic 400 + partition_key 1024 + id 8 bytes.
--
-- An index names the columns, so ALTER COLUMN cannot change their collation: the table is built
-- again. Its rows (unsent ones included) are copied aside, the table dropped and created anew
-- with the same columns, constraints and indexes, and the rows put back with their ids, so the
-- relay keeps their order. The runner applies every batch in one transaction: no write sees the
-- table missing. Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

SELECT id, topic, message_id, partition_key, body, attributes, created_at, next_attempt_at, attempts,
    last_error, sent_at
INTO workqueue.aws_outbox_0022_copy
FROM workqueue.aws_outbox WITH (TABLOCKX);
DROP TABLE workqueue.aws_outbox;
GO

CREATE TABLE workqueue.aws_outbox (
    id               bigint IDENTITY(1, 1) NOT NULL,
    topic            nvarchar(200) COLLATE Latin1_General_100_BIN2 NOT NULL,
    message_id       uniqueidentifier NOT NULL,
    partition_key    nvarchar(512) COLLATE Latin1_General_100_BIN2 NULL,
    body             nvarchar(max) NOT NULL,
    attributes       nvarchar(max) NOT NULL,
    created_at       datetimeoffset(6) NOT NULL CONSTRAINT aws_outbox_created_at DEFAULT SYSDATETIMEOFFSET(),
    next_attempt_at  datetimeoffset(6) NOT NULL CONSTRAINT aws_outbox_next_attempt_at DEFAULT SYSDATETIMEOFFSET(),
    attempts         int NOT NULL CONSTRAINT aws_outbox_attempts DEFAULT 0,
    last_error       nvarchar(4000) NULL,
    sent_at          datetimeoffset(6) NULL,
    CONSTRAINT aws_outbox_pk PRIMARY KEY CLUSTERED (id)
);
CREATE INDEX aws_outbox_unsent ON workqueue.aws_outbox (id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_unsent_key ON workqueue.aws_outbox (topic, partition_key, id) WHERE sent_at IS NULL;
CREATE INDEX aws_outbox_sent ON workqueue.aws_outbox (sent_at) WHERE sent_at IS NOT NULL;
GO

SET IDENTITY_INSERT workqueue.aws_outbox ON;
INSERT INTO workqueue.aws_outbox (id, topic, message_id, partition_key, body, attributes, created_at,
    next_attempt_at, attempts, last_error, sent_at)
SELECT id, topic, message_id, partition_key, body, attributes, created_at, next_attempt_at, attempts,
    last_error, sent_at
FROM workqueue.aws_outbox_0022_copy;
SET IDENTITY_INSERT workqueue.aws_outbox OFF;
DROP TABLE workqueue.aws_outbox_0022_copy;
GO
