"""Layout 3: the outbox of background jobs (flask_idem.jobs, docs/jobs.rst), a table of its own.

A view writes a message here in its key's transaction (it is sent exactly when the request commits); the
relay (``flask idem relay``) claims unsent messages under a short lease, publishes each to the broker and
marks it sent. A relay that dies between publishing and marking leaves the claim to lapse, and the
message is published again: the task's key, reserved by the consumer, absorbs the duplicate. An
application without background jobs never writes to it. The key table is not touched, so the code of
layouts 1 and 2 runs on this one; background jobs need it.
"""

from flask_idem._layout import Revision

revision = "flask_idem_0003"
down_revision = "flask_idem_0002"
branch_labels = None
depends_on = None

REVISION = Revision(
    layout=3,
    compatible_from=1,
    summary="the outbox of background jobs",
    names={
        "outbox": "_outbox",
        "outbox_unsent_index": "_outbox_unsent_idx",
        "outbox_sent_index": "_outbox_sent_idx",
    },
    tables=("outbox",),
    # A new table: its indexes are made with it, in the same transaction (nothing writes to it yet).
    sql="""
CREATE TABLE IF NOT EXISTS {outbox_qualified} (
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
CREATE INDEX IF NOT EXISTS {outbox_unsent_index} ON {outbox_qualified} (created_at) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS {outbox_sent_index} ON {outbox_qualified} (sent_at) WHERE sent_at IS NOT NULL;
""",
    # Sharded by organisation and co-located with the key table, so that a view's message, its key and
    # its writes sit on one node and commit in one node's transaction.
    distributed_sql="""
SELECT create_distributed_table({outbox_literal}, 'org_id', colocate_with => {table_literal})
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {outbox_literal}::regclass);
""",
    grants="GRANT SELECT, INSERT, UPDATE, DELETE ON {outbox_qualified} TO {role};",
    downgrade_sql="DROP TABLE IF EXISTS {outbox_qualified};",
)


def upgrade() -> None:
    """Alembic: apply this revision (flask_idem.alembic)."""
    from flask_idem.alembic import run_upgrade

    run_upgrade(REVISION)


def downgrade() -> None:
    """Alembic: undo this revision."""
    from flask_idem.alembic import run_downgrade

    run_downgrade(REVISION)
