"""Layout 2, for the test suite only: a layout no release has, to prove the machinery for future layouts
(tests/test_second_layout.py, and the upgrades page's "Writing a revision").

A revision file as a release would ship one in ``flask_idem/migrations/``, and an Alembic revision on the
``flask_idem`` branch after ``flask_idem_0001``; it lives in this folder, which an Alembic project lists in
``version_locations`` and no wheel ships, and it adds itself to the layouts this process knows when it is
imported (``flask_idem._layout.add``). It adds what a later release might:

- a nullable column on the key table, which PostgreSQL adds to every partition with it, rewriting
  nothing; the code of layout 1 never names it, so it goes on serving (``compatible_from = 1``);
- a table of its own beside the key table, with its grants for the application's role, an index built
  concurrently, and on Citus its distribution with the key table.

Its SQL stands here as strings rather than in a ``.sql`` file beside it: flask-idem's loader reads files
of the package only, and this file must stand alone in its folder (Alembic reads every ``.py`` there).
"""

from flask_idem._layout import Index, Revision, add

revision = "flask_idem_0002"
down_revision = "flask_idem_0001"
branch_labels = None
depends_on = None

REVISION = Revision(
    layout=2,
    compatible_from=1,
    summary="a note column on the key table and a labels table (a test's own layout)",
    names={"labels": "_labels", "labels_note_index": "_labels_note_idx"},
    tables=("labels",),
    sql=(
        "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS client_note text;"
        " CREATE TABLE IF NOT EXISTS {labels_qualified} ("
        " org_id bigint NOT NULL, idem_key uuid NOT NULL, note text,"
        " created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (org_id, idem_key))"
    ),
    indexes=(Index("labels_note_index", "ON {labels_qualified} (note)"),),
    distributed_sql=(
        "SELECT create_distributed_table({labels_literal}, 'org_id', colocate_with => {table_literal})"
        " WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {labels_literal}::regclass)"
    ),
    grants="GRANT SELECT, INSERT, UPDATE, DELETE ON {labels_qualified} TO {role}",
    downgrade_sql=(
        "DROP TABLE IF EXISTS {labels_qualified}; ALTER TABLE {table} DROP COLUMN IF EXISTS client_note"
    ),
)

add(REVISION, revision, down_revision)


def upgrade() -> None:
    """Alembic: apply this revision (flask_idem.alembic)."""
    from flask_idem.alembic import run_upgrade

    run_upgrade(REVISION)


def downgrade() -> None:
    """Alembic: undo this revision."""
    from flask_idem.alembic import run_downgrade

    run_downgrade(REVISION)
