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

-- Injected faults, oldest first; every gunicorn worker consumes from this one queue.
CREATE TABLE IF NOT EXISTS gateway_faults (
    id          bigint           GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    mode        text             NOT NULL CHECK (
                                     mode IN ('delay', 'fail_before', 'fail_after', 'drop_after')
                                 ),
    -- Charge requests this entry still affects; an entry is deleted when it reaches zero.
    remaining   integer          NOT NULL CHECK (remaining > 0),
    delay       double precision NOT NULL DEFAULT 0 CHECK (delay >= 0),
    created_at  timestamptz      NOT NULL DEFAULT now()
);
