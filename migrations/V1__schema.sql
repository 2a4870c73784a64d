-- oncepay schema. Every table's primary key starts with tenant_id, so the schema can be
-- distributed by tenant later (Citus: distribute every table by tenant_id).

CREATE TABLE tenants (
    tenant_id          uuid        NOT NULL,
    name               text        NOT NULL,
    api_key_hash       bytea       NOT NULL,
    missing_key_policy text        NOT NULL DEFAULT 'reject',
    created_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT tenants_pkey PRIMARY KEY (tenant_id),
    CONSTRAINT tenants_api_key_hash_key UNIQUE (api_key_hash),
    CONSTRAINT tenants_missing_key_policy_check
        CHECK (missing_key_policy IN ('reject', 'allow', 'fingerprint'))
);

CREATE TABLE accounts (
    tenant_id       uuid        NOT NULL REFERENCES tenants (tenant_id),
    account_id      text        NOT NULL,
    balance         bigint      NOT NULL,
    opening_balance bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT accounts_pkey PRIMARY KEY (tenant_id, account_id),
    CONSTRAINT accounts_balance_check CHECK (balance >= 0)
);

-- A payment row never changes again except for its refund columns.
CREATE TABLE payments (
    tenant_id            uuid        NOT NULL,
    payment_id           uuid        NOT NULL,
    account_id           text        NOT NULL,
    amount               bigint      NOT NULL,
    balance_after        bigint      NOT NULL,
    idempotency_key      text,
    created_at           timestamptz NOT NULL,
    refunded_at          timestamptz,
    balance_after_refund bigint,
    CONSTRAINT payments_pkey PRIMARY KEY (tenant_id, payment_id),
    CONSTRAINT payments_account_fkey FOREIGN KEY (tenant_id, account_id)
        REFERENCES accounts (tenant_id, account_id)
);

CREATE TABLE deposits (
    tenant_id       uuid        NOT NULL,
    deposit_id      uuid        NOT NULL,
    account_id      text        NOT NULL,
    amount          bigint      NOT NULL,
    balance_after   bigint      NOT NULL,
    idempotency_key text,
    created_at      timestamptz NOT NULL,
    CONSTRAINT deposits_pkey PRIMARY KEY (tenant_id, deposit_id),
    CONSTRAINT deposits_account_fkey FOREIGN KEY (tenant_id, account_id)
        REFERENCES accounts (tenant_id, account_id)
);

-- One row per (tenant, Idempotency-Key): the request's fingerprint and its result (status,
-- created resource id, error code), never a response body. A row is only ever visible
-- committed, together with the effect it records.
CREATE TABLE idempotency_keys (
    tenant_id   uuid        NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    method      text        NOT NULL,
    path        text        NOT NULL,
    status      smallint    NOT NULL,
    resource_id text,
    error_code  text,
    created_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (tenant_id, key)
) WITH (fillfactor = 90);

-- The purge deletes by age; this index makes each batch an index range scan.
CREATE INDEX idempotency_keys_created_at_idx ON idempotency_keys (created_at);
