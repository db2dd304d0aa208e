"""Layout 1: the key table of the first release, its indexes and, on Citus, its reserve function."""

from flask_idem._layout import Revision

revision = "flask_idem_0001"
down_revision = None
branch_labels = ("flask_idem",)
depends_on = None

REVISION = Revision(
    layout=1,
    compatible_from=1,
    summary="the key table, its expiry, lease and attention indexes, and the reserve function on Citus",
    names={
        "expires_index": "_expires_at_idx",
        "lease_index": "_lease_idx",
        "attention_index": "_attention_idx",
        "reserve": "_reserve",
    },
    sql="""
CREATE TABLE IF NOT EXISTS {table} (
    -- The authenticated organisation, from the extension's scope callable; never from the request body.
    org_id       bigint      NOT NULL,
    idem_key     uuid        NOT NULL,
    -- SHA-256 over method, path, query and canonical body (flask_idem._fingerprint).
    request_sha  bytea       NOT NULL CHECK (octet_length(request_sha) = 32),
    method       text        NOT NULL,
    path         text        NOT NULL,
    status       text        NOT NULL DEFAULT 'processing'
                             CHECK (status IN ('processing', 'completed', 'failed')),
    -- Once finished: the status, the replayed headers and the body of the response, as JSON.
    response     jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- After this moment the key is treated as new and `flask idem purge` may delete the row.
    expires_at   timestamptz NOT NULL,

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

    PRIMARY KEY (org_id, idem_key),
    CHECK (status = 'processing' OR response IS NOT NULL),
    CHECK (status <> 'processing' OR flow IS NULL OR lease_token IS NOT NULL)
)
-- Room on each page for the UPDATE that completes a row to stay on its page (a HOT update, which
-- touches no index: no indexed column changes when an atomic request completes).
WITH (fillfactor = 80);

-- Built with the table, empty: plain CREATE INDEX. Indexes of later revisions are built concurrently.
-- Purge walks rows by expiry. No predicate on status: completing a row must not change the index.
CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at);

-- The recovery job looks for multi-step requests whose lease has expired; atomic rows have no lease.
CREATE INDEX IF NOT EXISTS {lease_index} ON {table} (lease_expires_at) WHERE lease_expires_at IS NOT NULL;

-- Rows flagged for a person: few, and counted on every scrape of the metrics (flask_idem.metrics).
-- Completing an atomic request leaves needs_attention false, so its update stays HOT.
CREATE INDEX IF NOT EXISTS {attention_index} ON {table} (created_at) WHERE needs_attention;
""",
    # Shards by organisation: every statement of a request names its org_id, so Citus routes it to the
    # node holding that organisation's keys. The application's own tables distributed by org_id with
    # colocate_with => this table keep a request's writes and its key on the same node.
    #
    # The reservation as one function that Citus runs on the node holding the key's shard (a delegated,
    # co-located function): its advisory lock, its INSERT and its lookup all happen on that node, in one
    # round trip. A statement cannot do this on Citus: an INSERT in a CTE, or an INSERT ... SELECT, is
    # planned in several steps through the coordinator. Same answer as the reserve statement of the
    # store; the lock is taken before the INSERT, so a request never waits on another's uncommitted row.
    # force_delegation: delegated inside the request's transaction too, which then continues on that node.
    distributed_sql="""
SELECT create_distributed_table({table_literal}, 'org_id')
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = {table_literal}::regclass);

CREATE OR REPLACE FUNCTION {reserve_qualified}(
    p_org_id bigint, p_key uuid, p_sha bytea, p_method text, p_path text, p_ttl float8, p_lock bigint,
    p_flow text, p_token uuid, p_lease float8, p_tomb float8
) RETURNS TABLE (
    fresh boolean, taken boolean, request_sha bytea, status text, response jsonb, expired boolean,
    stale boolean, lease_live boolean, flow text, step text, state jsonb
) LANGUAGE plpgsql AS $$
DECLARE
    v_taken boolean := pg_try_advisory_xact_lock(p_lock);
BEGIN
    IF v_taken THEN
        INSERT INTO {table} AS k (org_id, idem_key, request_sha, method, path, status, expires_at,
                                  flow, lease_token, lease_expires_at)
        VALUES (p_org_id, p_key, p_sha, p_method, p_path, 'processing',
                now() + make_interval(secs => p_ttl), p_flow, p_token,
                now() + make_interval(secs => p_lease))
        ON CONFLICT (org_id, idem_key) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT true, true, NULL::bytea, NULL::text, NULL::jsonb, NULL::boolean,
                                NULL::boolean, NULL::boolean, NULL::text, NULL::text, NULL::jsonb;
            RETURN;
        END IF;
    END IF;
    -- The columns of the reserve statement (flask_idem._store), as a later request reads them.
    RETURN QUERY
        SELECT false, v_taken, k.request_sha, k.status, k.response,
            k.status <> 'processing' AND NOT k.needs_attention
                AND (k.response ? 'tombstone' IS TRUE AND k.expires_at <= now()
                     OR k.response ? 'tombstone' IS NOT TRUE
                        AND k.expires_at <= now() - make_interval(secs => p_tomb)) AS expired,
            k.status <> 'processing' AND NOT k.needs_attention
                AND (k.response ? 'tombstone' OR k.expires_at <= now()) AS stale,
            coalesce(k.lease_expires_at > now(), false) AS lease_live, k.flow, k.step, k.state
        FROM (SELECT) AS one LEFT JOIN {table} AS k ON k.org_id = p_org_id AND k.idem_key = p_key;
END
$$;

SELECT create_distributed_function(
    ({reserve_literal} || '(bigint, uuid, bytea, text, text, float8, bigint, text, uuid, float8, float8)')
        ::regprocedure,
    'p_org_id', colocate_with => {table_literal}, force_delegation => true
);
""",
    grants="GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role};",
    downgrade_sql="""
DROP FUNCTION IF EXISTS {reserve_qualified}(
    bigint, uuid, bytea, text, text, float8, bigint, text, uuid, float8, float8);
DROP TABLE IF EXISTS {table};
""",
)


def upgrade() -> None:
    """Alembic: apply this revision (flask_idem.alembic)."""
    from flask_idem.alembic import run_upgrade

    run_upgrade(REVISION)


def downgrade() -> None:
    """Alembic: undo this revision; the key table and every key in it are dropped."""
    from flask_idem.alembic import run_downgrade

    run_downgrade(REVISION)
