-- The yardstick's database: the least a PostgreSQL-backed idempotent payment can store, in
-- tables laid out like oncepay's (every primary key begins with tenant_id). Load it into an
-- empty database of its own:
--   psql -X -q -v ON_ERROR_STOP=1 -v accounts=10000 -v replay_keys=100 -d DB -f schema.sql
-- It makes tenant 1 with the accounts u1 .. u<accounts> (a balance no benchmark exhausts), the
-- function pay_once, and the finished keys replay-1 .. replay-<replay_keys> for replay.sql.
\set ON_ERROR_STOP on
SET client_min_messages = warning;
DROP FUNCTION IF EXISTS pay_once;
DROP TABLE IF EXISTS idempotency_keys, payments, accounts, tenants CASCADE;

CREATE TABLE tenants (
    tenant_id          bigint      PRIMARY KEY,
    name               text        NOT NULL,
    api_key_hash       bytea       NOT NULL UNIQUE,
    missing_key_policy text        NOT NULL DEFAULT 'reject',
    created_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE accounts (
    tenant_id  bigint      NOT NULL REFERENCES tenants,
    account_id text        NOT NULL,
    balance    bigint      NOT NULL CHECK (balance >= 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, account_id)
);

-- A payment names its account (a foreign key: each insert checks the account row, as
-- oncepay's does).
CREATE TABLE payments (
    tenant_id     bigint      NOT NULL,
    payment_id    uuid        NOT NULL DEFAULT gen_random_uuid(),
    account_id    text        NOT NULL,
    amount        bigint      NOT NULL CHECK (amount > 0),
    balance_after bigint      NOT NULL,
    status        text        NOT NULL DEFAULT 'succeeded',
    created_at    timestamptz NOT NULL DEFAULT now(),
    refunded_at   timestamptz,
    PRIMARY KEY (tenant_id, payment_id),
    FOREIGN KEY (tenant_id, account_id) REFERENCES accounts
);

-- The key rows. The primary key is the unique (tenant_id, key) a duplicate waits on. No
-- foreign key to tenants: every payment of a single busy tenant would share-lock its one row.
CREATE TABLE idempotency_keys (
    tenant_id   bigint      NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    method      text        NOT NULL,
    path        text        NOT NULL,
    status      smallint,              -- null until the effect is decided
    resource_id uuid,
    error_code  text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, key)
);
-- What a purge walks, and every key insert maintains.
CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);

-- One new payment, whole, in one call (so one round trip and one transaction in autocommit):
-- claim the key, debit the account if it covers the amount, record the payment, finish the
-- key with its result. A key that exists already is answered from its row (a replay); a debit
-- the balance does not cover finishes the key as a stored 402.
CREATE FUNCTION pay_once(tenant bigint, idem_key text, body_hash bytea,
                         account text, amount bigint,
                         replay_window interval DEFAULT interval '24 hours')
RETURNS TABLE (replayed boolean, http_status smallint, payment uuid,
               balance_after bigint, created timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    claimed  int;
    left_now bigint;
    new_id   uuid;
    made_at  timestamptz;
BEGIN
    INSERT INTO idempotency_keys AS k (tenant_id, key, fingerprint, method, path, created_at, expires_at)
    VALUES (tenant, idem_key, body_hash, 'POST', '/payments', now(), now() + replay_window)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS claimed = ROW_COUNT;

    IF claimed = 0 THEN
        RETURN QUERY
        SELECT true, k.status, k.resource_id, p.balance_after, p.created_at
          FROM idempotency_keys k
          LEFT JOIN payments p ON p.tenant_id = k.tenant_id AND p.payment_id = k.resource_id
         WHERE k.tenant_id = tenant AND k.key = idem_key;
        RETURN;
    END IF;

    UPDATE accounts a SET balance = a.balance - amount
     WHERE a.tenant_id = tenant AND a.account_id = account AND a.balance >= amount
    RETURNING a.balance INTO left_now;

    IF left_now IS NULL THEN
        UPDATE idempotency_keys k SET status = 402, error_code = 'insufficient_funds'
         WHERE k.tenant_id = tenant AND k.key = idem_key;
        RETURN QUERY SELECT false, 402::smallint, NULL::uuid, NULL::bigint, now();
        RETURN;
    END IF;

    INSERT INTO payments AS p (tenant_id, account_id, amount, balance_after)
    VALUES (tenant, account, amount, left_now)
    RETURNING p.payment_id, p.created_at INTO new_id, made_at;

    UPDATE idempotency_keys k SET status = 201, resource_id = new_id
     WHERE k.tenant_id = tenant AND k.key = idem_key;

    RETURN QUERY SELECT false, 201::smallint, new_id, left_now, made_at;
END
$$;

INSERT INTO tenants (tenant_id, name, api_key_hash) VALUES (1, 'yardstick', sha256('yardstick'::bytea));
INSERT INTO accounts (tenant_id, account_id, balance)
SELECT 1, 'u' || n, 1000000000000000 FROM generate_series(1, :accounts) AS n;

-- The finished keys replay.sql reads, each made by a real payment of 1.
SELECT count(*) AS finished_replay_keys
  FROM generate_series(1, :replay_keys) AS n,
       LATERAL pay_once(1, 'replay-' || n, sha256(('replay-' || n)::bytea), 'u' || n, 1);

VACUUM ANALYZE;
CHECKPOINT;
