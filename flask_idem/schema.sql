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
    PRIMARY KEY (org_id, idem_key),
    CHECK (status = 'processing' OR response IS NOT NULL)
);

-- Purge walks finished rows by expiry; processing rows are never purged, so they stay out of the index.
CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at) WHERE status <> 'processing';
