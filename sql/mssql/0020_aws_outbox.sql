-- fastapi-workqueue: SQL Server, version 20: what the AWS transport keeps in the database. Mirrors
-- the tables of sql/postgresql/0027 (whose header says why): aws_binding holds the imported ARNs
-- and queue URLs, aws_outbox the publishes to aws topics made in a caller's transaction. A relay
-- takes due rows with UPDLOCK, READPAST (SQL Server's SKIP LOCKED) in its transaction, sends them
-- and marks them sent before it commits. Conventions: top of 0002_helpers.sql.

SET ANSI_NULLS ON;
SET QUOTED_IDENTIFIER ON;
GO

CREATE TABLE workqueue.aws_binding (
    kind         nvarchar(20) NOT NULL CONSTRAINT aws_binding_kind CHECK (kind IN (N'topic', N'subscription')),
    name         nvarchar(200) NOT NULL,
    region       nvarchar(64) NOT NULL,
    binding      nvarchar(max) NOT NULL,
    imported_at  datetimeoffset(6) NOT NULL CONSTRAINT aws_binding_imported_at DEFAULT SYSDATETIMEOFFSET(),
    CONSTRAINT aws_binding_pk PRIMARY KEY CLUSTERED (kind, name)
);
GO

CREATE TABLE workqueue.aws_outbox (
    id               bigint IDENTITY(1, 1) NOT NULL,
    topic            nvarchar(200) NOT NULL,
    message_id       uniqueidentifier NOT NULL,
    partition_key    nvarchar(450) NULL,
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
