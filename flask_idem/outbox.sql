-- ===== The outbox of flask-idem's background jobs (flask_idem.jobs, docs/jobs.rst) =====================
-- Applied by `flask idem init-db` after the key table (schema.sql); every statement is safe to run twice.
-- Its own table, apart from the key table: an application without background jobs never writes to it.
-- The table is named after IDEM_TABLE with "_outbox" appended, in the same schema; its indexes after it.
--
-- A view writes a message here in its key's transaction (it is sent exactly when the request commits);
-- the relay (`flask idem relay`) claims unsent messages under a short lease, publishes each to the
-- broker and marks it sent. A relay that dies between publishing and marking leaves the claim to lapse,
-- and the message is published again: the task's key, reserved by the consumer, absorbs the duplicate.

CREATE TABLE IF NOT EXISTS {outbox} (
    -- The organisation the task works for (its key belongs to it), as in the key table.
    org_id        bigint      NOT NULL,
    -- The message's own id; one enqueue, not the task's key.
    id            uuid        NOT NULL,
    task          text        NOT NULL CHECK (length(task) BETWEEN 1 AND 200),
    -- The key the task reserves in the key table when it runs.
    idem_key      uuid        NOT NULL,
    args          jsonb       NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(args) = 'array'),
    kwargs        jsonb       NOT NULL DEFAULT '{{}}' CHECK (jsonb_typeof(kwargs) = 'object'),
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- Which relay holds the message while it publishes it, and until when (database clock); after a
    -- failed publish, when it may be tried again.
    claim_token   uuid,
    claimed_until timestamptz,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    -- Set once the broker confirmed the message; sent rows are deleted after IDEM_OUTBOX_RETENTION.
    sent_at       timestamptz,
    PRIMARY KEY (org_id, id)
);

-- The relay walks unsent messages oldest first; the purge walks sent ones by when they were sent.
CREATE INDEX IF NOT EXISTS {unsent_index} ON {outbox} (created_at) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS {sent_index} ON {outbox} (sent_at) WHERE sent_at IS NOT NULL;
-- ===== end of the outbox ===============================================================================
