-- Every statement flask-idem runs on its key table, for a reviewer to read as SQL.
--
-- Each block starts with "-- name: <name>"; flask_idem/_store.py loads the blocks once, in this order (with
-- flask_idem/_sqlfile.py, as flask_idem/_outbox.py loads _outbox.sql), drops the comments, and fills in the
-- braces: {table} (the key table, IDEM_TABLE) and its index names, and the fragments (blocks whose names
-- start with "fragment ") by name. %(name)s are parameters: their values travel apart from the text, in Bind
-- messages. A block whose name ends with "citus" replaces the block of the same name on a Citus distributed
-- table (IDEM_DISTRIBUTED), where FOR UPDATE cannot span shards, nor a LIMIT stand under it, and UPDATE and
-- DELETE refuse STABLE functions of a column.
--
-- The key table is partitioned by range of expires_at (flask_idem/migrations/v1_first_release.sql). Its
-- unique key (org_id, idem_key, expires_at) guards one partition only, so the unique index does not
-- decide a race: the key's advisory lock does. Every reservation takes the lock in a statement of its own
-- first (the lock statement, sent in the same round trip), so that the statement that looks for the key,
-- in every partition and among the compact tombstones, has a snapshot taken once the lock is held, and
-- sees every committed row of the key. Rows expire from statement_timestamp(), the moment they are
-- written, so that no row is written into a partition whose range has passed (flask_idem._partitions
-- drops it).

-- name: fragment finished
-- A row whose request ended, and that no person has to look at.
k.status <> 'processing' AND NOT k.needs_attention

-- name: fragment gone
-- Past retention and past the tombstone's period: the key may be used anew. Written so that no STABLE
-- function (timestamptz arithmetic) takes a column: Citus refuses it in DELETE.
k.expires_at <= now() - make_interval(secs => %(tomb)s)

-- name: fragment record
-- The columns a later request reads of a key's row (KeyRecord's fields). "stale": its response passed
-- retention; "expired": the key may be used anew. The reserve function of the layout's distributed_sql
-- answers the same (a test compares them).
k.request_sha, k.status, k.response,
{finished} AND {gone} AS expired,
{finished} AND k.expires_at <= now() AS stale,
coalesce(k.lease_expires_at > now(), false) AS lease_live, k.flow, k.step, k.state

-- name: fragment mine
-- The guard of every write under a lease: the row is still processing, under this worker's token.
WHERE org_id = %(org_id)s AND idem_key = %(key)s AND status = 'processing' AND lease_token = %(token)s

-- name: fragment subject
-- What a row is for, unqualified (a claim's UPDATE joins nothing else with these columns): a request's
-- method and path, or a background job's task (its row has no method or path).
method, path, task

-- name: fragment atomic
-- An atomic request's row has no flow and no lease.
NULL, NULL, NULL

-- name: fragment leased
-- A multi-step request's row names its flow, and its lease from the database's clock.
%(flow)s, %(token)s, now() + make_interval(secs => %(lease)s)

-- name: fragment leased citus
%(flow)s, %(token)s, %(lease)s

-- name: lock
-- The key's lock, taken without waiting: a key whose lock is held is in flight. Also the transaction's
-- isolation: the lookups after the lock need a snapshot per statement (READ COMMITTED), which the store
-- checks. A lock taken is noted in a setting of the transaction (flask_idem.lock), which the reservation
-- after it reads: it must act on this lock, never take the lock itself (see reserve). An atomic request
-- in a batched transaction sends the lookup after it, and writes the key's row once, completed, with
-- COMMIT (insert_completed).
WITH lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock(%(lock)s) AS taken)
SELECT lock.taken, current_setting('transaction_isolation') = 'read committed' AS fresh_snapshots,
       CASE WHEN lock.taken THEN set_config('flask_idem.lock', %(lock)s::text, true) END AS noted
FROM lock

-- name: fragment tombstone_record
-- A compact tombstone as a later request reads a key's row: a document of its status and Location
-- (as flask_idem._protocol reads it), past retention, not to be used anew until expires_at.
t.request_sha, CASE WHEN t.status < 0 THEN 'failed' ELSE 'completed' END AS status,
jsonb_build_object('tombstone', true, 'status', abs(t.status), 'headers',
    CASE WHEN t.location IS NULL THEN '[]'::jsonb
         ELSE jsonb_build_array(jsonb_build_array('Location', t.location)) END) AS response,
false AS expired, true AS stale, false AS lease_live, NULL::text AS flow, NULL::text AS step,
'{{}}'::jsonb AS state

-- name: fragment found
-- The key's row in any partition, else its live compact tombstone: a key has at most one of each
-- (a row moved by purge is deleted and inserted in one transaction; a key is used anew only once its
-- row and tombstone expired, and the expired row is deleted first).
(SELECT {record} FROM {table} AS k WHERE k.org_id = %(org_id)s AND k.idem_key = %(key)s LIMIT 1)
UNION ALL
(SELECT {tombstone_record} FROM {tombstones} AS t
 WHERE t.org_id = %(org_id)s AND t.idem_key = %(key)s AND t.expires_at > now() LIMIT 1)
LIMIT 1

-- name: lookup
SELECT false AS fresh, true AS taken, f.* FROM ({found}) AS f

-- name: reserve
-- After the lock statement, and only under the lock it took: then this statement's snapshot, taken
-- after the lock, sees every committed row of the key. It does not try the lock itself: when the lock
-- statement found the key in flight, the holder may commit and let the lock go after this statement's
-- snapshot was taken and before a lock tried here, which would then be had while the snapshot misses
-- the holder's row (in another partition, where no unique index stops the INSERT). The INSERT's ON
-- CONFLICT only guards the partition it writes to; the NOT EXISTS under the lock guards the others.
WITH lock AS MATERIALIZED (
    SELECT coalesce(current_setting('flask_idem.lock', true) = %(lock)s::text, false) AS taken),
found AS MATERIALIZED ({found}),
reserved AS (
    INSERT INTO {table} (org_id, idem_key, request_sha, method, path, task, status, expires_at,
                         flow, lease_token, lease_expires_at)
    SELECT %(org_id)s, %(key)s, %(sha)s, %(method)s, %(path)s, %(task)s, 'processing',
           statement_timestamp() + make_interval(secs => %(ttl)s), {lease}
    FROM lock WHERE lock.taken AND NOT EXISTS (SELECT FROM found)
    ON CONFLICT DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT FROM reserved) AS fresh, lock.taken, f.*
FROM lock LEFT JOIN found AS f ON true

-- name: reserve citus
-- The same answer from the reserve function (the layout's distributed_sql), run on the node of the
-- key's shard: the lock, then the lookup in every partition and among the tombstones and the INSERT,
-- each a statement of its own there. Also the transaction's isolation (fresh_snapshots, see lock),
-- read there. No lock statement before it: the lock is the shard's node's.
SELECT * FROM {reserve_function}(%(org_id)s::bigint, %(key)s, %(sha)s, %(method)s, %(path)s, %(task)s,
                                  %(ttl)s, %(lock)s, {lease}, %(tomb)s)

-- name: insert_completed
-- Under the key's lock, after a lookup that found nothing in any partition (see lock): no reservation
-- can commit a row of the key meanwhile, since each takes the lock first and reads at READ COMMITTED
-- (the lock statement checks it). An atomic task's row is written here too, naming its task.
INSERT INTO {table} (org_id, idem_key, request_sha, method, path, task, status, response, expires_at)
VALUES (%(org_id)s, %(key)s, %(sha)s, %(method)s, %(path)s, %(task)s, 'completed', %(response)s,
        statement_timestamp() + make_interval(secs => %(ttl)s))

-- name: guard citus
-- Before the reserve function, on Citus: the key table's lock on the coordinator, as every other
-- statement of a request takes it, and no row read (nothing is sent to the nodes). The function runs on
-- the key's node and locks the key's shard there, not the table here; the request's next statements lock
-- the table here. Between the two, DDL on the key table (a migration's ALTER TABLE, purge's DETACH
-- PARTITION), which locks the table here and then the shards, would wait for the shard while the request waits for the table: a distributed deadlock, broken only by the DDL's lock timeout, on every try while
-- requests keep coming. With the table locked here first, both lock in the same order.
SELECT FROM {table} WHERE false

-- name: delete_expired
DELETE FROM {table} AS k
WHERE k.org_id = %(org_id)s AND k.idem_key = %(key)s AND {finished} AND {gone}

-- name: complete
-- An atomic request's own uncommitted row, which nothing else can see: it always matches that one row.
UPDATE {table} SET status = 'completed', response = %(response)s
WHERE org_id = %(org_id)s AND idem_key = %(key)s

-- name: take_over
-- A retry or the recovery job takes a processing request whose lease expired; of concurrent callers, one.
UPDATE {table} SET lease_token = %(token)s,
    lease_expires_at = now() + make_interval(secs => %(lease)s), attempts = attempts + 1
WHERE org_id = %(org_id)s AND idem_key = %(key)s
  AND status = 'processing' AND lease_expires_at <= now()

-- name: hold
UPDATE {table} SET lease_expires_at = now() + make_interval(secs => %(lease)s) {mine}

-- name: record_step
UPDATE {table} SET step = %(step)s,
    state = state || jsonb_build_object(%(step)s::text, %(result)s::jsonb),
    lease_expires_at = now() + make_interval(secs => %(lease)s) {mine}

-- name: complete_leased
UPDATE {table} SET status = %(status)s, response = %(response)s,
    lease_token = NULL, lease_expires_at = NULL, next_attempt_at = NULL,
    last_error = coalesce(%(error)s, last_error),
    needs_attention = (%(status)s = 'failed') {mine}

-- name: release
UPDATE {table} SET lease_expires_at = now(), last_error = %(error)s,
    next_attempt_at = now() + make_interval(secs => %(retry_in)s) {mine}

-- name: fragment due
-- A stranded request is due once its lease has expired and its next attempt is due: at
-- greatest(lease_expires_at, next_attempt_at), which ignores a NULL next_attempt_at. The due index has
-- that moment, so a claim reads due rows only, not every row still backing off.
k.lease_expires_at IS NOT NULL AND greatest(k.lease_expires_at, k.next_attempt_at) <= now()

-- name: claim
WITH due AS (
    SELECT org_id, idem_key FROM {table} AS k
    WHERE {due} AND k.status = 'processing' AND k.flow = ANY(%(flows)s)
    ORDER BY greatest(k.lease_expires_at, k.next_attempt_at) LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS k SET lease_token = %(token)s,
    lease_expires_at = now() + make_interval(secs => %(lease)s), attempts = k.attempts + 1
FROM due WHERE k.org_id = due.org_id AND k.idem_key = due.idem_key
RETURNING k.org_id, k.idem_key AS key, k.flow, k.step, k.state, {subject}, k.attempts,
          k.created_at <= now() - make_interval(secs => %(deadline)s) AS overdue

-- name: stuck
SELECT org_id, idem_key AS key, status, flow, step, attempts,
       extract(epoch FROM now() - created_at)::float8 AS age_seconds, needs_attention, last_error,
       {subject}
FROM {table}
WHERE needs_attention
   OR (status = 'processing' AND created_at <= now() - make_interval(secs => %(older_than)s))
ORDER BY created_at

-- name: fragment processing
-- Committed processing rows always have a lease (atomic rows are never committed processing), so
-- "lease_expires_at IS NOT NULL" lets the planner use the lease index.
FROM {table} WHERE lease_expires_at IS NOT NULL AND status = 'processing'

-- name: state
SELECT p.processing, p.stranded,
       (SELECT count(*) FROM {table} WHERE needs_attention) AS flagged,
       p.oldest_processing_seconds
FROM (SELECT count(*) AS processing,
             count(*) FILTER (WHERE lease_expires_at <= now()) AS stranded,
             coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_processing_seconds
      {processing}) AS p

-- name: stats_by_status
SELECT status, count(*) FROM {table} GROUP BY status ORDER BY status

-- name: stats_by_flow
SELECT flow, status, step, count(*) FROM {table} WHERE flow IS NOT NULL
GROUP BY flow, status, step ORDER BY flow, status, step NULLS FIRST

-- name: stats_oldest
SELECT org_id, idem_key AS key, status, flow, step, attempts,
       extract(epoch FROM now() - created_at)::float8 AS age_seconds, needs_attention, last_error
{processing} ORDER BY created_at LIMIT 1

-- name: stats_by_range
-- Rows, multi-step rows in progress and flagged rows by range of
-- expires_at, the ranges ending at %(bounds)s (the partitions' upper bounds, oldest first): range i is the
-- i-th partition, and the last one is past every bound. Counted by expiry rather than by tableoid, which
-- names shards on Citus.
SELECT width_bucket(k.expires_at, %(bounds)s::timestamptz[]) AS range, count(*) AS rows,
       count(*) FILTER (WHERE k.status = 'processing') AS processing,
       count(*) FILTER (WHERE k.needs_attention) AS flagged
FROM {table} AS k GROUP BY 1

-- name: stats_tombstones_by_range
SELECT width_bucket(t.expires_at, %(bounds)s::timestamptz[]) AS range, count(*) AS rows
FROM {tombstones} AS t GROUP BY 1

-- On Citus, from here on: rows are read without locks across shards (*_candidates), then acted on one
-- organisation at a time (one shard, a router query) by a statement that locks them with SKIP LOCKED
-- and checks again.

-- name: fragment claimable citus
{due} AND k.status = 'processing' AND k.flow = ANY(%(flows)s)

-- name: fragment one_org citus
k.org_id = %(org)s AND k.idem_key = ANY(%(keys)s::uuid[])

-- name: claim_candidates citus
SELECT org_id, idem_key AS key,
       created_at <= now() - make_interval(secs => %(deadline)s) AS overdue
FROM {table} AS k WHERE {claimable} AND NOT k.idem_key = ANY(%(triedkeys)s::uuid[])
ORDER BY greatest(k.lease_expires_at, k.next_attempt_at) LIMIT %(limit)s

-- name: claim citus
UPDATE {table} AS t SET lease_token = %(token)s,
    lease_expires_at = now() + make_interval(secs => %(lease)s), attempts = t.attempts + 1
FROM (SELECT org_id, idem_key FROM {table} AS k WHERE {one_org} AND {claimable}
      FOR UPDATE SKIP LOCKED) AS due
WHERE t.org_id = %(org)s AND t.org_id = due.org_id AND t.idem_key = due.idem_key
RETURNING t.org_id, t.idem_key AS key, t.flow, t.step, t.state, {subject}, t.attempts

-- name: stats_totals
-- Sizes are the partitions' (a partitioned table has no storage of its own); purge drops partitions.
SELECT count(*) FILTER (WHERE k.needs_attention) AS flagged,
       (SELECT count(*) FROM {tombstones} AS t WHERE t.expires_at > now()) AS tombstones,
       count(*) FILTER (WHERE k.expires_at <= now() AND {finished} AND {gone}) AS to_delete,
       (SELECT coalesce(sum(pg_total_relation_size(p.relid)), 0)::bigint
        FROM pg_partition_tree(%(table)s::regclass) AS p) AS total_bytes,
       (SELECT coalesce(sum(pg_indexes_size(p.relid)), 0)::bigint
        FROM pg_partition_tree(%(table)s::regclass) AS p WHERE p.isleaf) AS index_bytes
FROM {table} AS k

-- name: stats_totals citus
-- The same on Citus, which pushes no subquery of the select list down beside aggregates: each part is
-- a subquery of its own, joined on the coordinator. Sizes are the shards' (citus_total_relation_size of
-- each partition; its indexes are what citus_table_size leaves out).
SELECT k.flagged, t.tombstones, k.to_delete, s.total_bytes, s.index_bytes
FROM (SELECT count(*) FILTER (WHERE k.needs_attention) AS flagged,
             count(*) FILTER (WHERE k.expires_at <= now() AND {finished} AND {gone}) AS to_delete
      FROM {table} AS k) AS k,
     (SELECT count(*) AS tombstones FROM {tombstones} AS t WHERE t.expires_at > now()) AS t,
     (SELECT coalesce(sum(citus_total_relation_size(p.relid)), 0)::bigint AS total_bytes,
             coalesce(sum(citus_total_relation_size(p.relid) - citus_table_size(p.relid)), 0)::bigint
                 AS index_bytes
      FROM pg_partition_tree(%(table)s::regclass) AS p WHERE p.isleaf) AS s
