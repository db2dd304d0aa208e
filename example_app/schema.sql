-- The shop's own tables. Applied by `flask --app example_app shop init-db` (safe to run twice).

CREATE TABLE IF NOT EXISTS orgs (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         text        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    -- SHA-256 of the API key; the key itself is shown once, by `shop create-org`, and never stored.
    api_key_sha  bytea       NOT NULL UNIQUE,
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz
);

-- Every key of orders and payments leads with org_id, so that on Citus (distributed.sql) each
-- organisation's rows, and their foreign keys, live on one node.
CREATE TABLE IF NOT EXISTS orders (
    id               bigint      GENERATED ALWAYS AS IDENTITY,
    org_id           bigint      NOT NULL REFERENCES orgs (id),
    idempotency_key  uuid        NOT NULL,
    amount           bigint      NOT NULL CHECK (amount > 0),
    currency         text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, id),
    -- A second line of defence behind flask-idem's key table: one order per key, even past retention.
    UNIQUE (org_id, idempotency_key)
);

CREATE TABLE IF NOT EXISTS payments (
    id                 bigint      GENERATED ALWAYS AS IDENTITY,
    org_id             bigint      NOT NULL REFERENCES orgs (id),
    order_id           bigint      NOT NULL,
    idempotency_key    uuid        NOT NULL,
    amount             bigint      NOT NULL CHECK (amount > 0),
    currency           text        NOT NULL,
    -- pending from the intent until the gateway's answer is recorded.
    status             text        NOT NULL DEFAULT 'pending'
                                   CHECK (status IN ('pending', 'succeeded', 'declined', 'failed')),
    gateway_charge_id  text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, id),
    FOREIGN KEY (org_id, order_id) REFERENCES orders (org_id, id),
    UNIQUE (org_id, idempotency_key)
);

-- Set once by the gateway's payment.refunded event (example_app/gateway_events.py), whatever the status:
-- a refund that arrives before its success is kept, and the success still moves pending to succeeded.
ALTER TABLE payments ADD COLUMN IF NOT EXISTS refunded_at timestamptz;

-- An order is paid at most once, whatever the keys: one pending or succeeded payment per order.
CREATE UNIQUE INDEX IF NOT EXISTS payments_one_live_per_order
    ON payments (org_id, order_id) WHERE status IN ('pending', 'succeeded');

-- Links to an order's receipt (example_app/receipts.py): the token itself is never stored, only its hash.
CREATE TABLE IF NOT EXISTS receipt_links (
    id           bigint      GENERATED ALWAYS AS IDENTITY,
    org_id       bigint      NOT NULL,
    order_id     bigint      NOT NULL,
    token_sha    bytea       NOT NULL CHECK (octet_length(token_sha) = 32),
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, id),
    FOREIGN KEY (org_id, order_id) REFERENCES orders (org_id, id)
);

CREATE INDEX IF NOT EXISTS receipt_links_token ON receipt_links (token_sha);
-- One row per fulfilment of a paid order, written by the fulfilment task (example_app/fulfilment.py).
-- Deliberately no UNIQUE (org_id, order_id): the task's key is the only guard against a second run, so
-- the tests and the history checker can see one if it ever happened.
CREATE TABLE IF NOT EXISTS fulfilments (
    id           bigint      GENERATED ALWAYS AS IDENTITY,
    org_id       bigint      NOT NULL REFERENCES orgs (id),
    order_id     bigint      NOT NULL,
    payment_id   bigint      NOT NULL,
    -- reserved by the task's first step; sent once the receipt went to the mail sink.
    status       text        NOT NULL DEFAULT 'reserved' CHECK (status IN ('reserved', 'sent')),
    receipt_id   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, id),
    FOREIGN KEY (org_id, order_id) REFERENCES orders (org_id, id)
);

-- One row per gateway event the shop handled (example_app/gateway_events.py), and whether it moved the
-- payment. Deliberately no UNIQUE (event_id): the webhook's key is the only guard against applying an
-- event twice, so the tests and the history checker can see it if it ever happened.
CREATE TABLE IF NOT EXISTS payment_events (
    id          bigint      GENERATED ALWAYS AS IDENTITY,
    org_id      bigint      NOT NULL,
    payment_id  bigint      NOT NULL,
    event_id    text        NOT NULL,
    type        text        NOT NULL,
    moved       boolean     NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, id)
);
