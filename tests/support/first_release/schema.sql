-- The key table of flask-idem. Applied by `flask idem init-db`; every statement is safe to run twice.
-- The table and index names are filled in from IDEM_TABLE by flask_idem.store.

CREATE TABLE IF NOT EXISTS {table} (
    -- The authenticated organisation, from the extension's scope callable; never from the request body.
    org_id       bigint      NOT NULL,
    idem_key     uuid        NOT NULL,
    -- SHA-256 over method, path, query and canonical body (flask_idem.fingerprint).
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

-- Purge walks rows by expiry. No predicate on status: completing a row must not change the index.
CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at);

-- The recovery job looks for multi-step requests whose lease has expired; atomic rows have no lease.
CREATE INDEX IF NOT EXISTS {lease_index} ON {table} (lease_expires_at) WHERE lease_expires_at IS NOT NULL;

-- Rows flagged for a person: few, and counted on every scrape of the metrics (flask_idem.metrics).
-- Completing an atomic request leaves needs_attention false, so its update stays HOT.
CREATE INDEX IF NOT EXISTS {attention_index} ON {table} (created_at) WHERE needs_attention;
