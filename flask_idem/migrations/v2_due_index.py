"""Layout 2: an index of multi-step requests by the moment the recovery job may claim them."""

from flask_idem._layout import Index, Revision

revision = "flask_idem_0002"
down_revision = "flask_idem_0001"
branch_labels = None
depends_on = None

# A stranded request may be claimed once its lease has expired and its next attempt is due, that is at
# greatest(lease_expires_at, next_attempt_at) (greatest ignores NULL). On layout 1 the claim walks the
# lease index from the oldest lease and reads every row whose lease has expired, including each one still
# backing off, on every claim: while an outside party is down, every pass of the recovery job reads all
# the requests waiting for it. With this index it reads the due ones only. Only rows with a lease are in
# it, so completing an atomic request stays a HOT update, as before.
REVISION = Revision(
    layout=2,
    compatible_from=1,
    summary="index multi-step requests by when the recovery job may claim them",
    names={"due_index": "_due_idx"},
    indexes=(
        Index(
            "due_index",
            "ON {table} ((greatest(lease_expires_at, next_attempt_at))) WHERE lease_expires_at IS NOT NULL",
        ),
    ),
)


def upgrade() -> None:
    """Alembic: apply this revision (flask_idem.alembic)."""
    from flask_idem.alembic import run_upgrade

    run_upgrade(REVISION)


def downgrade() -> None:
    """Alembic: undo this revision (the index is dropped concurrently)."""
    from flask_idem.alembic import run_downgrade

    run_downgrade(REVISION)
