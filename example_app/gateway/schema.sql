-- The gateway simulator's tables, created by the gateway itself when it starts (safe to run twice).
-- The names start with gateway_ so that the gateway can share a database with the shop.

CREATE TABLE IF NOT EXISTS gateway_charges (
    id          text        PRIMARY KEY DEFAULT 'ch_' || replace(gen_random_uuid()::text, '-', ''),
    -- The caller's Idempotency-Key: one charge per key, whatever the caller retries.
    idem_key    text        NOT NULL UNIQUE CHECK (length(idem_key) BETWEEN 1 AND 255),
    amount      bigint      NOT NULL CHECK (amount > 0),
    currency    text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    -- A payment token such as tok_visa, never a card number.
    source      text        NOT NULL CHECK (length(source) BETWEEN 1 AND 255),
    status      text        NOT NULL CHECK (status IN ('succeeded', 'declined')),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- The caller's reference (the shop's "org:payment"), echoed in the charge's events; when refunded.
ALTER TABLE gateway_charges ADD COLUMN IF NOT EXISTS reference text CHECK (length(reference) <= 255);
ALTER TABLE gateway_charges ADD COLUMN IF NOT EXISTS refunded_at timestamptz;

-- Injected faults, oldest first; every gunicorn worker consumes from this one queue.
CREATE TABLE IF NOT EXISTS gateway_faults (
    id          bigint           GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    mode        text             NOT NULL CHECK (
                                     mode IN ('delay', 'fail_before', 'fail_after', 'drop_after',
                                              'webhook_duplicate', 'webhook_reorder', 'webhook_fail_first')
                                 ),
    -- Charge requests this entry still affects; an entry is deleted when it reaches zero.
    remaining   integer          NOT NULL CHECK (remaining > 0),
    delay       double precision NOT NULL DEFAULT 0 CHECK (delay >= 0),
    created_at  timestamptz      NOT NULL DEFAULT now()
);

-- A database made before the webhook faults existed gets their modes (the CHECK above is only a new table's).
ALTER TABLE gateway_faults DROP CONSTRAINT IF EXISTS gateway_faults_mode_check;
ALTER TABLE gateway_faults ADD CONSTRAINT gateway_faults_mode_check CHECK (
    mode IN ('delay', 'fail_before', 'fail_after', 'drop_after',
             'webhook_duplicate', 'webhook_reorder', 'webhook_fail_first')
);

-- The webhook outbox: one row per event, written in the transaction of the charge (or refund) it tells
-- of, and delivered at least once by the sender threads (example_app/gateway/events.py).
CREATE TABLE IF NOT EXISTS gateway_events (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id         text        NOT NULL UNIQUE DEFAULT 'evt_' || replace(gen_random_uuid()::text, '-', ''),
    type             text        NOT NULL CHECK (type IN ('payment.succeeded', 'payment.refunded')),
    body             text        NOT NULL,
    -- The webhook fault taken for this event when it was written, if any.
    fault            text,
    attempts         integer     NOT NULL DEFAULT 0,
    -- Not before then; a sender that claims the event pushes it past its own delivery attempt.
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    delivered_at     timestamptz,
    abandoned_at     timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now()
);
