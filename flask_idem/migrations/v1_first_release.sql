-- Layout 1, the first release's: every table and function of flask-idem, made from nothing.
--
-- Loaded by v1_first_release.py with flask_idem/_sqlfile.py (as _store.sql is): each block starts with
-- "-- name: <name>", lines that start with "--" are dropped (so no comment stands at the end of a line of
-- SQL) and white space is collapsed. Braces are the names of flask_idem._layout.names(): {table} (the key
-- table, IDEM_TABLE) and, for each name of the revision, {name}, {name_qualified} (in the key table's
-- schema) and {name_literal} (that as a string); {horizon} is the seconds ahead of now that keys may
-- expire, {role} the application's role (grants only). No percent sign: the SQL printed by an offline
-- Alembic run with pyformat's escaping (Flask-Migrate's env.py) would double it.

-- name: sql
-- The key table, partitioned by range of expires_at: a partition whose range has passed holds only keys
-- past their retention, and retention drops it whole (flask idem purge, flask_idem._partitions), never a
-- statement per row. A key is unique across partitions because every reservation takes the key's
-- advisory lock first and then looks for the key in every partition and among the tombstones, in a
-- statement whose snapshot is taken once the lock is held (flask_idem/_store.sql); the unique key
-- (org_id, idem_key, expires_at) only guards one partition (docs/retention.rst).
CREATE TABLE IF NOT EXISTS {table} (
    -- The authenticated organisation, from the extension's scope callable; never from the request body.
    org_id           bigint      NOT NULL,
    idem_key         uuid        NOT NULL,
    -- SHA-256 over method, path, query and canonical body (flask_idem._fingerprint), or over a task's
    -- name and arguments (flask_idem._task.task_fingerprint).
    request_sha      bytea       NOT NULL CONSTRAINT {sha_check} CHECK (octet_length(request_sha) = 32),
    -- A request's method and path; NULL for a background job's row, which names its task.
    method           text,
    path             text,
    status           text        NOT NULL DEFAULT 'processing' CONSTRAINT {status_check}
                                 CHECK (status IN ('processing', 'completed', 'failed')),
    -- A request's final response (status, headers, body), or a task's {{"result": ...}}.
    response         jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- The partition key: after this moment the key is treated as new, and its row is dropped with its
    -- partition (after its compact tombstone is written).
    expires_at       timestamptz NOT NULL,
    -- Multi-step requests only (flask_idem.flow); NULL or defaults for atomic ones, whose rows are
    -- never seen by others before they are completed.
    flow             text,
    -- The last finished step and what each finished step returned, by step name.
    step             text,
    state            jsonb       NOT NULL DEFAULT '{{}}',
    -- Who may advance the request, and until when (database clock). Every step checks the token.
    lease_token      uuid,
    lease_expires_at timestamptz,
    -- Resumptions so far, when the recovery job may try next, the class of the last failure, and
    -- whether a person must look at the row.
    attempts         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz,
    last_error       text,
    needs_attention  boolean     NOT NULL DEFAULT false,
    -- A background job's task (flask_idem.jobs); NULL for a request.
    task             text,
    CONSTRAINT {key} UNIQUE (org_id, idem_key, expires_at),
    CONSTRAINT {response_check} CHECK (status = 'processing' OR response IS NOT NULL),
    CONSTRAINT {lease_check} CHECK (status <> 'processing' OR flow IS NULL OR lease_token IS NOT NULL),
    CONSTRAINT {task_check} CHECK ((task IS NULL) = (method IS NOT NULL AND path IS NOT NULL))
) PARTITION BY RANGE (expires_at);

-- The first partition, for every key that expires before the end of the horizon (the longest retention
-- and the time partitions are made ahead): the application can write keys at once, before the first
-- flask idem purge makes partitions ahead of it. It is retired like any partition once its range has
-- passed. Room on each page for the UPDATE that completes a row to stay on its page (a HOT update, which
-- touches no index: no indexed column changes when an atomic request completes), as every partition
-- purge makes.
CREATE TABLE IF NOT EXISTS {first_qualified} PARTITION OF {table}
    FOR VALUES FROM (MINVALUE) TO (date_trunc('second', now() + make_interval(secs => {horizon})))
    WITH (fillfactor = 80);

-- The recovery job looks for multi-step requests whose lease has expired; atomic rows have no lease.
CREATE INDEX IF NOT EXISTS {lease_index} ON {table} (lease_expires_at) WHERE lease_expires_at IS NOT NULL;

-- Rows flagged for a person: few, and counted on every scrape of the metrics (flask_idem.metrics).
-- Completing an atomic request leaves needs_attention false, so its update stays HOT.
CREATE INDEX IF NOT EXISTS {attention_index} ON {table} (created_at) WHERE needs_attention;

-- A stranded request may be claimed once its lease has expired and its next attempt is due, that is at
-- greatest(lease_expires_at, next_attempt_at) (greatest ignores NULL): the claim reads due rows only,
-- not every one still backing off while an outside party is down. Only rows with a lease are in it.
CREATE INDEX IF NOT EXISTS {due_index} ON {table} ((greatest(lease_expires_at, next_attempt_at)))
    WHERE lease_expires_at IS NOT NULL;

-- What a late retry needs of a key whose response is gone: the organisation, the key, the request's
-- fingerprint, the final status and the Location of a 303, until expires_at. Partitioned like the key
-- table, and dropped partition by partition; purge makes its partitions.
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

-- The outbox of background jobs (flask_idem.jobs, docs/jobs.rst). A view writes a message here in its
-- key's transaction (it is sent exactly when the request commits); the relay (flask idem relay) claims
-- unsent messages under a short lease, publishes each to the broker and marks it sent. A relay that dies
-- between publishing and marking leaves the claim to lapse, and the message is published again: the
-- task's key, reserved by the consumer, absorbs the duplicate.
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

-- name: distributed_sql
-- On Citus (IDEM_DISTRIBUTED) only. Every table is sharded by organisation, in one co-location group:
-- every statement of a request names its org_id, so Citus routes it to the node holding that
-- organisation's keys, and a view's key, its tombstone, its outbox message and its writes (the
-- application's tables distributed by org_id with colocate_with => the key table) sit on one node and
-- commit in one node's transaction. Each statement is safe to run again (flask idem migrate
-- --distributed distributes tables made without Citus).
SELECT create_distributed_table({table_literal}, 'org_id')
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {table_literal}::regclass);

SELECT create_distributed_table({tombstones_literal}, 'org_id', colocate_with => {table_literal})
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {tombstones_literal}::regclass);

SELECT create_distributed_table({outbox_literal}, 'org_id', colocate_with => {table_literal})
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {outbox_literal}::regclass);

-- The reservation as one function that Citus runs on the node holding the key's shard (a delegated,
-- co-located function): the key's advisory lock first, then the lookup in every partition and among
-- the live compact tombstones, then the INSERT only if none, in one round trip. A statement cannot do
-- this on Citus: an INSERT in a CTE, or an INSERT ... SELECT, is planned in several steps through the
-- coordinator. Each step is a statement of its own in PL/pgSQL, which takes a new snapshot per statement
-- under READ COMMITTED: the lookup sees every row of the key committed before the lock was had. Same
-- answer as the store's reserve statement (the "found" fragment of flask_idem/_store.sql; a test
-- compares them), and whether the transaction reads with a snapshot per statement (fresh_snapshots: the
-- store refuses REPEATABLE READ and SERIALIZABLE, whose one snapshot may predate the lock). Expiry from
-- statement_timestamp(), as the store's. force_delegation: delegated inside the request's transaction
-- too, which then continues on that node.
CREATE OR REPLACE FUNCTION {reserve_qualified}(
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
    RETURN QUERY
        SELECT false, v_taken, f.*, v_fresh_snapshots FROM (SELECT) AS one LEFT JOIN LATERAL (
            (SELECT k.request_sha, k.status, k.response,
                    k.status <> 'processing' AND NOT k.needs_attention
                        AND k.expires_at <= now() - make_interval(secs => p_tomb) AS expired,
                    k.status <> 'processing' AND NOT k.needs_attention
                        AND k.expires_at <= now() AS stale,
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
    ({reserve_literal} || '(bigint, uuid, bytea, text, text, text, float8, bigint, text, uuid, float8, float8)')
        ::regprocedure,
    'p_org_id', colocate_with => {table_literal}, force_delegation => true
);

-- name: grants
-- What the application's role needs at run time, and nothing more. The partitions that purge makes need
-- no grant: every statement of the application names the partitioned tables, whose privileges hold for
-- their partitions.
GRANT SELECT, INSERT, UPDATE, DELETE ON {table}, {tombstones_qualified}, {outbox_qualified} TO {role};

-- name: downgrade_sql
-- Alembic's downgrade to nothing: every table and key is dropped.
DROP FUNCTION IF EXISTS {reserve_qualified}(
    bigint, uuid, bytea, text, text, text, float8, bigint, text, uuid, float8, float8);
DROP TABLE IF EXISTS {outbox_qualified}, {tombstones_qualified}, {table};
