"""Layout 1, the first release's: the key table partitioned by time, its compact tombstones, the outbox of
background jobs, and on Citus the reserve function. Its DDL is SQL, in ``v1_first_release.sql``.

The key table is partitioned by range of ``expires_at``: retention drops whole partitions (``flask idem
purge``, :mod:`flask_idem._partitions`), and what a late retry needs of an expired key (its fingerprint,
its final status and ``Location``) is kept in the narrow ``<table>_tombstones``, partitioned the same way.
A first partition, ``<table>_p0``, takes every key that expires before the horizon (the longest retention
and the time partitions are made ahead), so that the application writes at once; ``flask idem purge``
makes the partitions after it. docs/retention.rst says it all.
"""

from flask_idem._layout import Revision
from flask_idem._sqlfile import blocks

revision = "flask_idem_0001"
down_revision = None
branch_labels = ("flask_idem",)
depends_on = None

_SQL = blocks("migrations/v1_first_release.sql", distributed=False)[1]

REVISION = Revision(
    layout=1,
    compatible_from=1,
    summary=(
        "the key table partitioned by time, its tombstones and the outbox (and on Citus the reserve function)"
    ),
    names={
        "first": "_p0",
        "key": "_key",
        "sha_check": "_request_sha_check",
        "status_check": "_status_check",
        "response_check": "_check",
        "lease_check": "_check1",
        "task_check": "_task_check",
        "lease_index": "_lease_idx",
        "attention_index": "_attention_idx",
        "due_index": "_due_idx",
        "tombstones": "_tombstones",
        "tombstones_index": "_tombstones_key_idx",
        "outbox": "_outbox",
        "outbox_unsent_index": "_outbox_unsent_idx",
        "outbox_sent_index": "_outbox_sent_idx",
        "reserve": "_reserve",
    },
    tables=("tombstones", "outbox"),
    sql=_SQL["sql"],
    distributed_sql=_SQL["distributed_sql"],
    grants=_SQL["grants"],
    downgrade_sql=_SQL["downgrade_sql"],
)


def upgrade() -> None:
    """Alembic: apply this revision (flask_idem.alembic)."""
    from flask_idem.alembic import run_upgrade

    run_upgrade(REVISION)


def downgrade() -> None:
    """Alembic: undo this revision; every table of flask-idem and every key in them are dropped."""
    from flask_idem.alembic import run_downgrade

    run_downgrade(REVISION)
