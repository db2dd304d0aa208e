"""Layout 4: the key table partitioned by time, compact tombstones, and a task's row that says so.

After a year the key table itself is the cost: retention by an ``UPDATE`` or ``DELETE`` per row grows with
traffic, and a tombstone kept the whole row. From layout 4 on:

- the key table is partitioned by range of ``expires_at``. A partition whose range has passed holds
  only keys past their retention, and retention is dropping it whole (``flask idem purge``:
  ``DETACH PARTITION ... CONCURRENTLY``, then ``DROP TABLE``), never a statement per row
  (:mod:`flask_idem._partitions`);
- what a late retry needs of an expired key (its fingerprint, its final status and ``Location``) is
  kept in a narrow table of its own, ``<table>_tombstones``, partitioned the same way and dropped the
  same way;
- a background job's row names its task (column ``task``) and has no method or path: it is no request.

A key is unique across partitions because every reservation takes the key's advisory lock first and
then looks for the key in every partition and among the tombstones, in a statement whose snapshot is
taken once the lock is held; the primary key ``(org_id, idem_key, expires_at)`` only guards one
partition (docs/retention.rst says it all).

The upgrade is online. The table of layout 3 is not copied: it becomes the first partition,
``<table>_p0``, for every ``expires_at`` below a bound picked at the upgrade, later than any key it holds
and than any key the application writes while the upgrade runs (``horizon``: the longest retention plus
the time partitions are made ahead). Its rows keep replaying from where they are, and it is dropped like
any partition once that bound has passed. Steps, each safe to run twice:

1. a transaction adds the nullable column ``task``, lets ``method`` and ``path`` be NULL, adds two CHECK
   constraints ``NOT VALID`` (the bound, and the task's), and creates the tombstones' table;
2. the unique index ``(org_id, idem_key, expires_at)`` that the partitioned table's primary key needs
   is built concurrently on the old table;
3. a transaction validates the two constraints (a scan that takes no lock writers wait on);
4. a transaction renames the old table to ``<table>_p0``, makes the unique index of step 2 its
   constraint, creates the partitioned ``<table>`` and attaches the old one as its first partition (no
   scan: the valid constraint proves the bound; no index built: the partition's indexes are taken
   over), and records the layout. Writers wait for this transaction only: a few milliseconds, however
   many keys the table holds.

Older releases' code cannot run on a partitioned table (``compatible_from``); this release's code runs on
both, and switches by itself once the upgrade is recorded (it reads the layout again every minute while
it runs on an older one; until then its statements of layout 3 write into the first partition, which
holds every key that expires before its bound). Deploy it first, then upgrade.

There is no way back in place (Alembic's downgrade refuses): restore a backup taken before.
"""

from flask_idem._layout import Index, Revision

revision = "flask_idem_0004"
down_revision = "flask_idem_0003"
branch_labels = None
depends_on = None

REVISION = Revision(
    layout=4,
    compatible_from=4,
    summary="partition the key table by time, keep compact tombstones, and name a task's row",
    names={
        "first": "_p0",
        "first_pkey": "_p0_pkey",
        "first_bound": "_p0_bound",
        "first_key_index": "_p0_key_idx",
        "first_expires_index": "_p0_expires_at_idx",
        "first_lease_index": "_p0_lease_idx",
        "first_attention_index": "_p0_attention_idx",
        "first_due_index": "_p0_due_idx",
        "pkey": "_pkey",
        "key": "_key",
        "task_check": "_task_check",
        "sha_check": "_request_sha_check",
        "status_check": "_status_check",
        "response_check": "_check",
        "lease_check": "_check1",
        "tombstones": "_tombstones",
        "tombstones_index": "_tombstones_key_idx",
    },
    tables=("tombstones",),
    sql="""
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS task text;
ALTER TABLE {table} ALTER COLUMN method DROP NOT NULL, ALTER COLUMN path DROP NOT NULL;

DO $bound$
DECLARE
    bound timestamptz;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = {table_literal}::regclass) = 'p' THEN
        RETURN;  -- partitioned already: this step ran, and the ones after it
    END IF;
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = {table_literal}::regclass AND conname = {task_check_name}) THEN
        ALTER TABLE {table} ADD CONSTRAINT {task_check}
            CHECK ((task IS NULL) = (method IS NOT NULL AND path IS NOT NULL)) NOT VALID;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = {table_literal}::regclass AND conname = {first_bound_name}) THEN
        -- Later than every key kept, and than every key written while the upgrade runs.
        bound := date_trunc('second', greatest(now() + make_interval(secs => {horizon}),
                                               (SELECT max(expires_at) FROM {table}) + interval '1 second'));
        -- Concatenated, not format()'s placeholders: no percent sign, which the SQL printed by an
        -- offline Alembic run with pyformat's escaping (Flask-Migrate's env.py) would double.
        EXECUTE 'ALTER TABLE ' || {table_literal} || ' ADD CONSTRAINT ' || quote_ident({first_bound_name})
                || ' CHECK (expires_at < ' || quote_literal(bound) || '::timestamptz) NOT VALID';
    END IF;
END
$bound$;

-- What a late retry needs of a key whose response is gone: the organisation, the key, the request's
-- fingerprint, the final status and the Location of a 303, until expires_at. Partitioned like the key
-- table, and dropped partition by partition.
CREATE TABLE IF NOT EXISTS {tombstones_qualified} (
    -- Columns in this order, fixed-width ones first, leave no padding: about 105 bytes a row.
    expires_at  timestamptz NOT NULL,
    org_id      bigint      NOT NULL,
    idem_key    uuid        NOT NULL,
    -- The final answer's status; negative when the operation failed (given up by the recovery job).
    status      smallint    NOT NULL,
    request_sha bytea       NOT NULL,
    location    text
) PARTITION BY RANGE (expires_at);
-- Not unique: a tombstone is written once, by the run that retires its key's partition (which marks it),
-- and a narrower index than (org_id, idem_key, expires_at) keeps tombstones small.
CREATE INDEX IF NOT EXISTS {tombstones_index} ON {tombstones_qualified} (org_id, idem_key);
""",
    indexes=(Index("first_key_index", "ON {table} (org_id, idem_key, expires_at)", unique=True),),
    after=(
        """
DO $validate$
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = {table_literal}::regclass) = 'r' THEN
        ALTER TABLE {table} VALIDATE CONSTRAINT {first_bound};
        ALTER TABLE {table} VALIDATE CONSTRAINT {task_check};
    END IF;
END
$validate$;
""",
        """
DO $swap$
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = {table_literal}::regclass) = 'p' THEN
        RETURN;
    END IF;
    ALTER TABLE {table} RENAME TO {first};
    ALTER TABLE {first_qualified} RENAME CONSTRAINT {pkey} TO {first_pkey};
    ALTER INDEX IF EXISTS {expires_index_qualified} RENAME TO {first_expires_index};
    ALTER INDEX IF EXISTS {lease_index_qualified} RENAME TO {first_lease_index};
    ALTER INDEX IF EXISTS {attention_index_qualified} RENAME TO {first_attention_index};
    ALTER INDEX IF EXISTS {due_index_qualified} RENAME TO {first_due_index};
    -- The unique index built concurrently (step 2) becomes a constraint of its own name (no scan, no
    -- build): the partitioned table's unique constraint takes over a partition's index only when a
    -- constraint stands on it, and would otherwise build a second one here, with every writer waiting.
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = {first_literal}::regclass AND conname = {first_key_index_name}) THEN
        ALTER TABLE {first_qualified} ADD CONSTRAINT {first_key_index} UNIQUE USING INDEX {first_key_index};
    END IF;

    CREATE TABLE {table} (
        org_id           bigint      NOT NULL,
        idem_key         uuid        NOT NULL,
        request_sha      bytea       NOT NULL CONSTRAINT {sha_check} CHECK (octet_length(request_sha) = 32),
        -- A request's method and path; NULL for a background job's row, which names its task.
        method           text,
        path             text,
        status           text        NOT NULL DEFAULT 'processing' CONSTRAINT {status_check}
                                     CHECK (status IN ('processing', 'completed', 'failed')),
        -- A request's final response (status, headers, body), or a task's {{"result": ...}}.
        response         jsonb,
        created_at       timestamptz NOT NULL DEFAULT now(),
        -- The partition key: rows are kept, and dropped, with the partition of their expiry.
        expires_at       timestamptz NOT NULL,
        flow             text,
        step             text,
        state            jsonb       NOT NULL DEFAULT '{{}}',
        lease_token      uuid,
        lease_expires_at timestamptz,
        attempts         integer     NOT NULL DEFAULT 0,
        next_attempt_at  timestamptz,
        last_error       text,
        needs_attention  boolean     NOT NULL DEFAULT false,
        task             text,
        -- Unique, not the primary key: the first partition keeps its primary key (org_id, idem_key).
        CONSTRAINT {key} UNIQUE (org_id, idem_key, expires_at),
        CONSTRAINT {response_check} CHECK (status = 'processing' OR response IS NOT NULL),
        CONSTRAINT {lease_check} CHECK (status <> 'processing' OR flow IS NULL OR lease_token IS NOT NULL),
        CONSTRAINT {task_check} CHECK ((task IS NULL) = (method IS NOT NULL AND path IS NOT NULL))
    ) PARTITION BY RANGE (expires_at);

    -- The old table, as it is: no scan, its valid bound constraint proves the partition's range.
    EXECUTE 'ALTER TABLE ' || {table_literal} || ' ATTACH PARTITION ' || {first_literal}
            || ' FOR VALUES FROM (MINVALUE) TO ('
            || quote_literal(substring(pg_get_constraintdef((SELECT oid FROM pg_constraint
                                                             WHERE conrelid = {first_literal}::regclass
                                                               AND conname = {first_bound_name}))
                                       FROM '''([^'']+)''')) || ')';
END
$swap$;

-- The partitioned table's indexes take over the old table's (each found equal, and attached). Purge
-- drops partitions, and needs no index by expiry.
CREATE INDEX IF NOT EXISTS {lease_index} ON {table} (lease_expires_at) WHERE lease_expires_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {attention_index} ON {table} (created_at) WHERE needs_attention;
CREATE INDEX IF NOT EXISTS {due_index} ON {table} ((greatest(lease_expires_at, next_attempt_at)))
    WHERE lease_expires_at IS NOT NULL;
""",
    ),
    distributed_sql="""
SELECT create_distributed_table({tombstones_literal}, 'org_id', colocate_with => {first_literal})
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {tombstones_literal}::regclass);
""",
    grants="GRANT SELECT, INSERT, UPDATE, DELETE ON {tombstones_qualified} TO {role};",
)


def upgrade() -> None:
    """Alembic: apply this revision (flask_idem.alembic)."""
    from flask_idem.alembic import run_upgrade

    run_upgrade(REVISION)


def downgrade() -> None:
    """Alembic: refused. Layout 4 cannot be undone in place: the partitioned key table cannot become the
    table of layout 3 again without a copy of every key, under a lock that would stop the application
    (and the code of layout 3 could not serve keys kept as compact tombstones). Nothing is changed."""
    from alembic.util import CommandError

    raise CommandError(
        "flask-idem's layout 4 (flask_idem_0004) cannot be undone in place: the key table is partitioned"
        " by time, and making it one table again would copy every key under a lock that stops the"
        " application. Nothing was changed. This flask-idem runs on layout 4; to go back, restore a backup"
        " taken before the upgrade. Your own revisions after flask_idem_0004 can still be downgraded to it."
    )
