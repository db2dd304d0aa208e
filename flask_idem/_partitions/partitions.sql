-- Every statement flask-idem runs on the partitions of its key table and of its tombstones, for a
-- reviewer to read as SQL.
--
-- Loaded as _store.sql is (flask_idem/_sqlfile.py), by flask_idem/_partitions/tables.py: each block
-- starts with "-- name: <name>", comments are dropped, and the braces are filled in by name: {table}
-- (the key table, IDEM_TABLE), {tombstones} (its compact tombstones), {parent} (the partitioned table a
-- statement is about, one of those two), {partition} (one of its partitions, in its schema), and the
-- values of a statement of DDL, which takes no parameter ({lower}, {upper}, {fillfactor}, {timeout}).
-- %(name)s are parameters. A block whose name ends with "citus" replaces its namesake on a Citus
-- distributed table (IDEM_DISTRIBUTED); one without a namesake is run on Citus only.

-- name: citus_installed
-- Whether Citus is installed in the database (then the migration's runner may ask whether the key table
-- is distributed).
SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL

-- name: now
SELECT now()

-- name: list
-- The partitions of %(parent)s (a name as to_regclass reads it), oldest range first: each one's name,
-- its range (NULL: unbounded), whether a detach was begun and not finished (an interrupted DETACH ...
-- CONCURRENTLY), its rows as the statistics estimate them, and its bytes on disk with indexes and TOAST.
SELECT c.relname::text AS name, b.lower, b.upper, i.inhdetachpending AS detaching,
       coalesce(c.reltuples, 0)::bigint AS rows, pg_total_relation_size(c.oid) AS bytes
FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid,
LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) AS e,
LATERAL (SELECT (regexp_match(e.bound, 'FROM \(''([^'']+)''\)'))[1]::timestamptz AS lower,
                (regexp_match(e.bound, 'TO \(''([^'']+)''\)'))[1]::timestamptz AS upper) AS b
WHERE i.inhparent = to_regclass(%(parent)s)
ORDER BY b.upper NULLS LAST

-- name: now
-- The database's clock: partitions are ranges of it.
SELECT now()

-- name: holds_rows
-- Whether a partition holds a row. Not EXISTS (SELECT FROM ...): Citus plans a distributed table's empty
-- target list as a function.
SELECT 1 FROM {partition} LIMIT 1

-- name: sequential citus
-- On Citus the attach distributes the new table: its shards are made, and attached to the key table's,
-- over one connection per node, or the transaction's own connections may wait on one another (Citus then
-- cancels it as a distributed deadlock).
SET LOCAL citus.multi_shard_modify_mode TO 'sequential'

-- name: create
-- A partition made ahead, as a table of its own, to be attached: CREATE TABLE ... PARTITION OF would take
-- a lock on the parent that writers wait on.
CREATE TABLE IF NOT EXISTS {partition} (LIKE {parent} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
WITH (fillfactor = {fillfactor})

-- name: attach
-- ATTACH PARTITION takes a lock on the parent that writers do not wait on, and finds the new table
-- empty at once.
ALTER TABLE {parent} ATTACH PARTITION {partition} FOR VALUES FROM ({lower}) TO ({upper})

-- name: settle
-- A moment's lock on a partition whose range has passed: SHARE waits for every transaction still writing
-- to it. Once it was had, no row can enter the partition (rows expire from the moment they are written,
-- after its range) nor start processing there.
LOCK TABLE {partition} IN SHARE MODE

-- name: placements citus
-- On Citus, LOCK TABLE on a distributed table locks its table on each node, not its shards, where the
-- rows are written: each shard is locked instead, by %(command)s (barrier) in a transaction of its own
-- on its node.
SELECT shardid, success, result FROM run_command_on_placements(%(partition)s::regclass, %(command)s)

-- name: barrier citus
-- The command run on each shard of a partition (%s is the shard, filled in by Citus): it waits for every
-- transaction still writing to the shard, no longer than the lock timeout ({timeout}). Citus refuses a
-- command on a shard unless told, as its error says, with citus.enable_manual_changes_to_shards.
DO $barrier$ BEGIN PERFORM set_config('lock_timeout', {timeout}, true);
PERFORM set_config('citus.enable_manual_changes_to_shards', 'on', true);
LOCK TABLE %s IN SHARE MODE; END $barrier$

-- name: in_progress
-- The multi-step requests still in progress in a partition: a worker holding a lease keeps writing its
-- row where it is. Committed processing rows always have a lease: the lease index answers, not a scan.
SELECT count(*) FROM {partition} WHERE lease_expires_at IS NOT NULL AND status = 'processing'

-- name: marked
-- A partition's comment: {retired} once its tombstones are written.
SELECT obj_description(%(partition)s::regclass, 'pg_class')

-- name: mark
-- What marks a partition whose tombstones are written (a run that stopped before dropping it leaves it
-- so, and the next run writes none twice).
COMMENT ON TABLE {partition} IS {retired}

-- name: tombstones
-- The compact tombstones of a retired partition's finished keys, until the end of IDEM_TOMBSTONE_TTL
-- (%(tomb)s seconds) after their response expired, those still live at %(now)s (the run's clock). A row
-- without a stored status is a task's ({"result": ...}, or {"error": ...} given up): 200, or 500 for a
-- failed one, as a request's would be. Neither form of a task's row has a Location. A failed operation's status is kept negative (no column of its own: a tombstone is kept
-- narrow). The end of each tombstone is computed in a subquery over the partition, not in a LATERAL one
-- without FROM: Citus pushes the INSERT ... SELECT down to the shards only so.
INSERT INTO {tombstones} (expires_at, org_id, idem_key, status, request_sha, location)
SELECT k.until, k.org_id, k.idem_key,
       (CASE WHEN k.status = 'failed' THEN -1 ELSE 1 END)
       * coalesce((k.response->>'status')::smallint,
                  CASE WHEN k.status = 'failed' THEN 500 ELSE 200 END::smallint),
       k.request_sha,
       (SELECT h->>1 FROM jsonb_array_elements(
            CASE WHEN jsonb_typeof(k.response->'headers') = 'array' THEN k.response->'headers'
                 ELSE '[]'::jsonb END) AS h
        WHERE lower(h->>0) = 'location' LIMIT 1)
FROM (SELECT p.*, p.expires_at + make_interval(secs => %(tomb)s) AS until FROM {partition} AS p) AS k
WHERE k.status <> 'processing' AND NOT k.needs_attention AND k.until > %(now)s

-- name: move
-- The rows of a retired partition flagged for a person, moved into a live partition: deleted here and
-- inserted there in one statement, so that no statement sees the key missing. Each expires no sooner
-- than %(keep)s seconds (two intervals) after the run's clock (%(now)s), nor than the partition's end
-- (%(after)s).
WITH moved AS (DELETE FROM {partition} WHERE needs_attention RETURNING *)
INSERT INTO {table} (org_id, idem_key, request_sha, method, path, task, status, response, created_at,
                     expires_at, flow, step, state, lease_token, lease_expires_at, attempts,
                     next_attempt_at, last_error, needs_attention)
SELECT org_id, idem_key, request_sha, method, path, task, status, response, created_at,
       greatest(expires_at, %(now)s + make_interval(secs => %(keep)s), %(after)s), flow, step, state,
       lease_token,
       lease_expires_at, attempts, next_attempt_at, last_error, needs_attention
FROM moved

-- name: detach
-- Concurrently: it waits for the transactions that may still read the partition, without blocking anyone
-- (a plain DETACH or DROP would wait on every open transaction on the key table, and hold up every
-- request behind it). It cannot run in a transaction.
ALTER TABLE {parent} DETACH PARTITION {partition} CONCURRENTLY

-- name: detach citus
-- Citus refuses DETACH PARTITION ... CONCURRENTLY on a distributed table ("currently unsupported",
-- Citus 13; citusdata/citus#5264), and FINALIZE too. A plain detach, in a transaction of its own under
-- the migration's short lock timeout: it changes the catalog only, but takes the key table's ACCESS
-- EXCLUSIVE lock on every shard for that moment.
ALTER TABLE {parent} DETACH PARTITION {partition}

-- name: finalize
-- The end of a concurrent detach that was interrupted, or ran out of its lock timeout.
ALTER TABLE {parent} DETACH PARTITION {partition} FINALIZE

-- name: bound
-- For the session, until a concurrent detach (outside a transaction) is through: it waits for older
-- transactions no longer than the lock timeout.
SET lock_timeout = {timeout}

-- name: unbound
RESET lock_timeout

-- name: drop
-- Without IF EXISTS: the table is looked up again once its lock is had. Its files are unlinked; no row
-- is deleted, no WAL is written per row.
DROP TABLE {partition}
