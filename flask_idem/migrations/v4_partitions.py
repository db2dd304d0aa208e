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
        "reserve4": "_reserve4",
    },
    tables=("tombstones",),
    # Each statement on the key table stands in a DO block: Citus sends the text of a DDL statement on a
    # distributed table to the nodes, and refuses a text of several statements there.
    sql="""
DO $bound$
DECLARE
    bound timestamptz;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = {table_literal}::regclass) = 'p' THEN
        RETURN;  -- partitioned already: this step ran, and the ones after it
    END IF;
    ALTER TABLE {table} ADD COLUMN IF NOT EXISTS task text;
    ALTER TABLE {table} ALTER COLUMN method DROP NOT NULL, ALTER COLUMN path DROP NOT NULL;
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
DECLARE
    failed text;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = {table_literal}::regclass) <> 'r' THEN
        RETURN;
    END IF;
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        -- On Citus, a CHECK constraint added to a distributed table is named on each shard with the
        -- shard's id (the task's, here), while the partitioned table's shards name theirs as the table
        -- does; the attach would find the task's constraint missing on the old table's shards. Each
        -- shard's is renamed as the table names it, by Citus's manual propagation (a transaction of its
        -- own per shard, under this transaction's lock timeout), before this transaction touches the
        -- shards. Safe to run twice: a constraint renamed already is left alone.
        -- No percent sign written here (see step 1): run_command_on_placements's placeholder for the
        -- shard's name is made with chr(37), and the values are put in by replace().
        EXECUTE $citus$
            SELECT string_agg(p.result, '; ')
            FROM pg_catalog.pg_dist_partition AS d, LATERAL run_command_on_placements(d.logicalrelid, $1) AS p
            WHERE d.logicalrelid = $2::regclass AND NOT p.success
        $citus$ INTO failed
        USING replace(replace(replace(replace(
            $command$
            DO $rename$
            DECLARE
                suffixed name;
            BEGIN
                PERFORM set_config('lock_timeout', @timeout@, true);
                SELECT s.conname INTO suffixed FROM pg_constraint AS s, pg_constraint AS t
                WHERE s.conrelid = '@shard@'::regclass AND s.contype = 'c' AND s.conname <> t.conname
                    AND t.conrelid = @table@::regclass AND t.conname = @name@
                    AND pg_get_constraintdef(s.oid) = pg_get_constraintdef(t.oid);
                IF suffixed IS NOT NULL THEN
                    EXECUTE 'ALTER TABLE @shard@ RENAME CONSTRAINT ' || quote_ident(suffixed) || ' TO '
                        || quote_ident(@name@);
                END IF;
            END
            $rename$
            $command$,
            '@timeout@', quote_literal(current_setting('lock_timeout'))),
            '@table@', quote_literal(replace({table_literal}, chr(37), chr(37) || chr(37)))),
            '@name@', quote_literal(replace({task_check_name}, chr(37), chr(37) || chr(37)))),
            '@shard@', chr(37) || '1$s'),
            {table_literal};
        IF position('lock timeout' IN failed) > 0 THEN
            RAISE EXCEPTION USING ERRCODE = 'lock_not_available',
                MESSAGE = 'renaming a constraint on a shard of ' || {table_literal} || ': ' || failed;
        ELSIF failed IS NOT NULL THEN
            RAISE EXCEPTION USING
                MESSAGE = 'renaming a constraint on a shard of ' || {table_literal} || ': ' || failed;
        END IF;
    END IF;
    ALTER TABLE {table} VALIDATE CONSTRAINT {first_bound};
    ALTER TABLE {table} VALIDATE CONSTRAINT {task_check};
END
$validate$;
""",
        """
DO $swap$
DECLARE
    -- On Citus: whether the old table is distributed. Its partitioned successor must then be too, in
    -- its co-location group (the application's co-located tables stay with it), before the attach.
    distributed boolean := to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = {table_literal}::regclass) = 'p' THEN
        RETURN;
    END IF;
    IF distributed THEN
        EXECUTE 'SELECT EXISTS (SELECT FROM pg_catalog.pg_dist_partition WHERE logicalrelid = $1::regclass)'
            INTO distributed USING {table_literal};
    END IF;
    IF distributed THEN
        -- One connection per node for the whole transaction: Citus refuses to distribute a table
        -- after a command that went over the shards in parallel (the renames).
        PERFORM set_config('citus.multi_shard_modify_mode', 'sequential', true);
    END IF;
    ALTER TABLE {table} RENAME TO {first};
    -- The primary key's index, and with it the constraint (Citus refuses RENAME CONSTRAINT).
    ALTER INDEX {pkey_qualified} RENAME TO {first_pkey};
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
    IF distributed THEN
        PERFORM create_distributed_table({table_literal}, 'org_id', colocate_with => {first_literal});
    END IF;

    -- The old table, as it is: no scan, its valid bound constraint proves the partition's range.
    EXECUTE 'ALTER TABLE ' || {table_literal} || ' ATTACH PARTITION ' || {first_literal}
            || ' FOR VALUES FROM (MINVALUE) TO ('
            || quote_literal(substring(pg_get_constraintdef((SELECT oid FROM pg_constraint
                                                             WHERE conrelid = {first_literal}::regclass
                                                               AND conname = {first_bound_name}))
                                       FROM '''([^'']+)''')) || ')';

    -- The partitioned table's indexes take over the old table's (each found equal, and attached).
    -- Purge drops partitions, and needs no index by expiry.
    CREATE INDEX IF NOT EXISTS {lease_index} ON {table} (lease_expires_at) WHERE lease_expires_at IS NOT NULL;
    CREATE INDEX IF NOT EXISTS {attention_index} ON {table} (created_at) WHERE needs_attention;
    CREATE INDEX IF NOT EXISTS {due_index} ON {table} ((greatest(lease_expires_at, next_attempt_at)))
        WHERE lease_expires_at IS NOT NULL;
END
$swap$;
""",
    ),
    # The tombstones are sharded by organisation with the key table (the old one when this runs before
    # the swap, which keeps its co-location group; the partitioned one after it, or when `migrate
    # --distributed` distributes tables made without Citus).
    #
    # The reservation on Citus, as layout 1's (a function run on the node of the key's shard, delegated
    # with force_delegation), for the partitioned table: the key's advisory lock first, then the lookup
    # in every partition and among the live compact tombstones, then the INSERT only if none. Each is a
    # statement of its own in PL/pgSQL, which takes a new snapshot per statement under READ COMMITTED:
    # the lookup sees every row of the key committed before the lock was had. Same answer as the
    # store's reserve statement of layout 4 (the "found" fragment), and whether the transaction reads
    # with a snapshot per statement (fresh_snapshots: the store refuses REPEATABLE READ and SERIALIZABLE,
    # whose one snapshot may predate the lock). Expiry from statement_timestamp(), as the store's.
    distributed_sql="""
SELECT create_distributed_table({tombstones_literal}, 'org_id', colocate_with => {table_literal})
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {tombstones_literal}::regclass);

CREATE OR REPLACE FUNCTION {reserve4_qualified}(
    p_org_id bigint, p_key uuid, p_sha bytea, p_method text, p_path text, p_task text, p_ttl float8,
    p_lock bigint, p_flow text, p_token uuid, p_lease float8, p_tomb float8
) RETURNS TABLE (
    fresh boolean, taken boolean, request_sha bytea, status text, response jsonb, expired boolean,
    stale boolean, lease_live boolean, flow text, step text, state jsonb, fresh_snapshots boolean
) LANGUAGE plpgsql AS $$
DECLARE
    v_fresh_snapshots boolean := current_setting('transaction_isolation') = 'read committed';
    v_taken boolean := pg_try_advisory_xact_lock(p_lock);
BEGIN
    IF v_taken AND v_fresh_snapshots
        AND NOT EXISTS (SELECT FROM {table} AS k WHERE k.org_id = p_org_id AND k.idem_key = p_key)
        AND NOT EXISTS (SELECT FROM {tombstones_qualified} AS t
                        WHERE t.org_id = p_org_id AND t.idem_key = p_key AND t.expires_at > now())
    THEN
        INSERT INTO {table} AS k (org_id, idem_key, request_sha, method, path, task, status, expires_at,
                                  flow, lease_token, lease_expires_at)
        VALUES (p_org_id, p_key, p_sha, p_method, p_path, p_task, 'processing',
                statement_timestamp() + make_interval(secs => p_ttl), p_flow, p_token,
                now() + make_interval(secs => p_lease))
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT true, true, NULL::bytea, NULL::text, NULL::jsonb, NULL::boolean,
                                NULL::boolean, NULL::boolean, NULL::text, NULL::text, NULL::jsonb, true;
            RETURN;
        END IF;
    END IF;
    -- The "found" fragment of the store (flask_idem/_store.sql), as a later request reads it.
    RETURN QUERY
        SELECT false, v_taken, f.*, v_fresh_snapshots FROM (SELECT) AS one LEFT JOIN LATERAL (
            (SELECT k.request_sha, k.status, k.response,
                    k.status <> 'processing' AND NOT k.needs_attention
                        AND (k.response ? 'tombstone' IS TRUE AND k.expires_at <= now()
                             OR k.response ? 'tombstone' IS NOT TRUE
                                AND k.expires_at <= now() - make_interval(secs => p_tomb)) AS expired,
                    k.status <> 'processing' AND NOT k.needs_attention
                        AND (k.response ? 'tombstone' OR k.expires_at <= now()) AS stale,
                    coalesce(k.lease_expires_at > now(), false) AS lease_live, k.flow, k.step, k.state
             FROM {table} AS k WHERE k.org_id = p_org_id AND k.idem_key = p_key LIMIT 1)
            UNION ALL
            (SELECT t.request_sha, CASE WHEN t.status < 0 THEN 'failed' ELSE 'completed' END AS status,
                    jsonb_build_object('tombstone', true, 'status', abs(t.status), 'headers',
                        CASE WHEN t.location IS NULL THEN '[]'::jsonb
                             ELSE jsonb_build_array(jsonb_build_array('Location', t.location)) END)
                        AS response,
                    false AS expired, true AS stale, false AS lease_live, NULL::text AS flow,
                    NULL::text AS step, '{{}}'::jsonb AS state
             FROM {tombstones_qualified} AS t
             WHERE t.org_id = p_org_id AND t.idem_key = p_key AND t.expires_at > now() LIMIT 1)
            LIMIT 1
        ) AS f ON true;
END
$$;

SELECT create_distributed_function(
    ({reserve4_literal}
        || '(bigint, uuid, bytea, text, text, text, float8, bigint, text, uuid, float8, float8)')
        ::regprocedure,
    'p_org_id', colocate_with => {table_literal}, force_delegation => true
);

-- Layout 1's reserve function, which the code of layouts 1 to 3 calls until it reads layout 4, answers
-- as layout 4's from now on: its INSERT names the conflict (org_id, idem_key), a unique key the
-- partitioned table has not (refused, 42P10), and it would look neither first nor among the compact
-- tombstones. Same arguments and columns as before (the rows of those layouts name no task), run on the
-- key's node as before, in PL/pgSQL (never inlined into the caller's query).
CREATE OR REPLACE FUNCTION {reserve_qualified}(
    p_org_id bigint, p_key uuid, p_sha bytea, p_method text, p_path text, p_ttl float8, p_lock bigint,
    p_flow text, p_token uuid, p_lease float8, p_tomb float8
) RETURNS TABLE (
    fresh boolean, taken boolean, request_sha bytea, status text, response jsonb, expired boolean,
    stale boolean, lease_live boolean, flow text, step text, state jsonb
) LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
        SELECT r.fresh, r.taken, r.request_sha, r.status, r.response, r.expired, r.stale, r.lease_live,
               r.flow, r.step, r.state
        FROM {reserve4_qualified}(p_org_id, p_key, p_sha, p_method, p_path, NULL, p_ttl, p_lock, p_flow,
                                  p_token, p_lease, p_tomb) AS r;
END
$$;

SELECT create_distributed_function(
    ({reserve_literal} || '(bigint, uuid, bytea, text, text, float8, bigint, text, uuid, float8, float8)')
        ::regprocedure,
    'p_org_id', colocate_with => {table_literal}, force_delegation => true
);
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
