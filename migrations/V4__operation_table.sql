-- One claim/replay path for every operation, the operation table's enum types, CHECK
-- constraints for what must never be stored, and transfers.
--
-- What Rust owns (src/operation.rs: each operation's method, path, success status and the
-- statuses of its declines) reaches these functions as one parameter, `oncepay_claim_args`;
-- the SQL repeats none of it. What SQL owns is the effect of each operation and the names of
-- its outcomes and declines, declared once as the enum types below and mapped in Rust with
-- `sqlx::Type` (a test checks both sides list the same labels).
--
-- Protocol (src/idempotency/mod.rs tells the whole story):
--   1. `oncepay_claim` reads the key first: a finished key is answered from that one read,
--      with no write attempt. A missing key is inserted before any account row is locked; a
--      concurrent duplicate's INSERT waits on the unique index for the first transaction,
--      bounded by `lock_timeout` (the in-flight wait, set for this transaction only, so it
--      holds through a transaction-mode pooler), whose expiry raises 55P03 (409 in progress).
--      Once claimed, `lock_timeout` is lifted again for the rest of the transaction.
--   2. The key row is written optimistically as the success and rewritten only by
--      `oncepay_decline`, so the common path writes it once.
--   3. Every operation answers through one final SELECT that rebuilds its result from the
--      resource the key names: the first answer and every replay are built the same way.
--   4. Everything commits together or not at all.

DROP FUNCTION oncepay_pay(uuid, text, boolean, bytea, integer, text, bigint);
DROP FUNCTION oncepay_refund(uuid, text, boolean, bytea, text, integer, uuid);
DROP FUNCTION oncepay_deposit(uuid, text, boolean, bytea, text, integer, text, bigint);
DROP FUNCTION oncepay_open_account(uuid, text, boolean, bytea, integer, text, bigint);
DROP FUNCTION oncepay_decline(uuid, text, smallint, text);
DROP FUNCTION oncepay_claim(uuid, text, boolean, bytea, text, text, integer, smallint, text);

CREATE TYPE oncepay_operation AS ENUM ('pay', 'refund', 'deposit', 'open_account', 'transfer');
CREATE TYPE oncepay_outcome AS ENUM ('created', 'replayed', 'declined', 'key_reused', 'expired');
CREATE TYPE oncepay_decline AS ENUM (
    'insufficient_funds', 'account_not_found', 'not_found', 'already_refunded', 'account_exists');

-- The view reads error_code, whose type changes below.
DROP VIEW idempotency_key_overview;

ALTER TABLE idempotency_keys ADD COLUMN operation oncepay_operation;
UPDATE idempotency_keys SET operation = CASE
    WHEN path = '/payments' THEN 'pay'
    WHEN path LIKE '/payments/%/refund' THEN 'refund'
    WHEN path LIKE '/accounts/%/deposits' THEN 'deposit'
    WHEN path = '/accounts' THEN 'open_account'
END::oncepay_operation;
ALTER TABLE idempotency_keys
    ALTER COLUMN operation SET NOT NULL,
    ALTER COLUMN error_code TYPE oncepay_decline USING error_code::oncepay_decline,
    ADD CONSTRAINT idempotency_keys_key_check CHECK (length(key) BETWEEN 1 AND 255),
    ADD CONSTRAINT idempotency_keys_fingerprint_check CHECK (octet_length(fingerprint) = 32),
    ADD CONSTRAINT idempotency_keys_method_check CHECK (method IN ('POST', 'PATCH', 'PUT', 'DELETE')),
    ADD CONSTRAINT idempotency_keys_status_check CHECK (status BETWEEN 200 AND 499),
    -- A success names its resource and no error; a stored failure the reverse.
    ADD CONSTRAINT idempotency_keys_result_check CHECK (
        (status < 300 AND error_code IS NULL AND resource_id IS NOT NULL)
        OR (status >= 400 AND error_code IS NOT NULL AND resource_id IS NULL)),
    ADD CONSTRAINT idempotency_keys_window_check CHECK (expires_at > created_at);

ALTER TABLE accounts
    ADD CONSTRAINT accounts_account_id_check CHECK (account_id ~ '^[A-Za-z0-9_.:-]{1,64}$'),
    ADD CONSTRAINT accounts_opening_balance_check CHECK (opening_balance BETWEEN 0 AND 1000000000000);
ALTER TABLE payments
    ADD CONSTRAINT payments_amount_check CHECK (amount BETWEEN 1 AND 1000000000000),
    ADD CONSTRAINT payments_balance_after_check CHECK (balance_after >= 0),
    ADD CONSTRAINT payments_refund_check CHECK ((refunded_at IS NULL) = (balance_after_refund IS NULL));
ALTER TABLE deposits
    ADD CONSTRAINT deposits_amount_check CHECK (amount BETWEEN 1 AND 1000000000000);
ALTER TABLE tenants
    ADD CONSTRAINT tenants_name_check CHECK (octet_length(name) BETWEEN 1 AND 200 AND name !~ '[[:cntrl:]]');

CREATE TABLE transfers (
    tenant_id          uuid        NOT NULL,
    transfer_id        uuid        NOT NULL,
    from_account_id    text        NOT NULL,
    to_account_id      text        NOT NULL,
    amount             bigint      NOT NULL,
    from_balance_after bigint      NOT NULL,
    to_balance_after   bigint      NOT NULL,
    idempotency_key    text,
    created_at         timestamptz NOT NULL,
    CONSTRAINT transfers_pkey PRIMARY KEY (tenant_id, transfer_id),
    CONSTRAINT transfers_from_fkey FOREIGN KEY (tenant_id, from_account_id)
        REFERENCES accounts (tenant_id, account_id),
    CONSTRAINT transfers_to_fkey FOREIGN KEY (tenant_id, to_account_id)
        REFERENCES accounts (tenant_id, account_id),
    CONSTRAINT transfers_accounts_check CHECK (from_account_id <> to_account_id),
    CONSTRAINT transfers_amount_check CHECK (amount BETWEEN 1 AND 1000000000000),
    CONSTRAINT transfers_balances_check CHECK (from_balance_after >= 0 AND to_balance_after >= 0)
);

-- What Rust tells the claim about one request (src/idempotency/claim.rs, `ClaimArgs`).
CREATE TYPE oncepay_claim_args AS (
    key              text,     -- NULL: a keyless request (policy `allow`), nothing is claimed
    derived          boolean,  -- a server-derived key: renewed, never "expired", past its window
    fingerprint      bytea,
    operation        oncepay_operation,
    method           text,
    path             text,
    window_secs      integer,
    inflight_wait_ms integer,  -- how long a duplicate waits for the in-flight original
    success_status   smallint,
    decline_statuses jsonb     -- {"<decline>": <status>} for this operation's declines
);

-- What a claim found, and what a decline turned it into.
CREATE TYPE oncepay_claimed AS (
    outcome     oncepay_outcome,
    decline     oncepay_decline,
    resource_id text,          -- the resource the answer is rebuilt from (NULL for a refusal)
    expires_at  timestamptz    -- until when this result replays (NULL without a key)
);

-- `p_resource_id`: the id of the resource the claim is for (a refund's payment, an account);
-- NULL for a resource not yet created: a new id is drawn only if the claim is won, so a
-- replay pays nothing for it.
CREATE FUNCTION oncepay_claim(p_tenant uuid, p oncepay_claim_args, p_resource_id text)
RETURNS oncepay_claimed
LANGUAGE plpgsql AS $$
DECLARE
    k idempotency_keys%ROWTYPE;
    r oncepay_claimed;
    claimed boolean;
BEGIN
    IF p.key IS NULL THEN
        r.outcome := 'created';
        r.resource_id := coalesce(p_resource_id, gen_random_uuid()::text);
        RETURN r;
    END IF;
    -- Three rounds at most: a duplicate's INSERT loses to the original and reads it in the
    -- next round; a row can also vanish (purge) or be renewed (derived key) in between. A
    -- fourth change would be a bug, answered as transient.
    FOR attempt IN 1..3 LOOP
        SELECT * INTO k FROM idempotency_keys i WHERE i.tenant_id = p_tenant AND i.key = p.key;
        IF NOT FOUND THEN
            r.resource_id := coalesce(p_resource_id, gen_random_uuid()::text);
            PERFORM set_config('lock_timeout', p.inflight_wait_ms || 'ms', true);
            INSERT INTO idempotency_keys AS i
                (tenant_id, key, fingerprint, operation, method, path, status, resource_id,
                 created_at, expires_at)
            VALUES (p_tenant, p.key, p.fingerprint, p.operation, p.method, p.path,
                    p.success_status, r.resource_id, now(),
                    now() + make_interval(secs => p.window_secs))
            ON CONFLICT (tenant_id, key) DO NOTHING
            RETURNING i.expires_at INTO r.expires_at;
            claimed := FOUND;  -- before PERFORM, which sets FOUND itself
            PERFORM set_config('lock_timeout', '0', true);
            IF claimed THEN
                r.outcome := 'created';
                RETURN r;
            END IF;
            r.resource_id := NULL;
            CONTINUE;  -- lost to a concurrent original: read what it committed
        END IF;

        IF k.expires_at <= now() THEN
            IF NOT p.derived THEN
                r.outcome := 'expired';
                RETURN r;
            END IF;
            -- A derived key past its window starts afresh. Replicas racing here serialise
            -- on the row lock; the losers re-check and replay.
            r.resource_id := coalesce(p_resource_id, gen_random_uuid()::text);
            PERFORM set_config('lock_timeout', p.inflight_wait_ms || 'ms', true);
            UPDATE idempotency_keys i
               SET fingerprint = p.fingerprint, operation = p.operation, method = p.method,
                   path = p.path, status = p.success_status, resource_id = r.resource_id,
                   error_code = NULL, created_at = now(),
                   expires_at = now() + make_interval(secs => p.window_secs)
             WHERE i.tenant_id = p_tenant AND i.key = p.key AND i.expires_at <= now()
            RETURNING i.expires_at INTO r.expires_at;
            claimed := FOUND;  -- before PERFORM, which sets FOUND itself
            PERFORM set_config('lock_timeout', '0', true);
            IF claimed THEN
                r.outcome := 'created';
                RETURN r;
            END IF;
            r.resource_id := NULL;
            CONTINUE;  -- another replica renewed it first: replay what it committed
        END IF;

        IF k.fingerprint <> p.fingerprint THEN
            r.outcome := 'key_reused';
            RETURN r;
        END IF;
        -- A replay answers a result as committed. If that commit's wait for the synchronous
        -- standbys was cut short (its session terminated, as a switchover does), it is
        -- visible on this primary alone and a failover would take it away after the client
        -- was told it happened. With synchronous standbys, this transaction writes a record
        -- so that its commit waits until they hold everything up to it, the replayed key row
        -- included. Without them there is nothing to wait for, and a replay writes nothing.
        IF current_setting('synchronous_standby_names') <> '' THEN
            PERFORM pg_logical_emit_message(true, 'oncepay', 'replay');
        END IF;
        r.outcome := 'replayed';
        r.decline := k.error_code;
        r.resource_id := k.resource_id;
        r.expires_at := k.expires_at;
        RETURN r;
    END LOOP;
    RAISE EXCEPTION 'idempotency key changed three times during one claim'
        USING ERRCODE = 'serialization_failure';
END
$$;

-- Turns a claimed request into a stored failure: the decline is replayed like a success.
CREATE FUNCTION oncepay_decline(p_tenant uuid, p oncepay_claim_args, p_decline oncepay_decline)
RETURNS oncepay_claimed
LANGUAGE plpgsql AS $$
DECLARE
    r oncepay_claimed;
BEGIN
    r.outcome := 'declined';
    r.decline := p_decline;
    IF p.key IS NOT NULL THEN
        UPDATE idempotency_keys
           SET status = (p.decline_statuses ->> p_decline::text)::smallint,
               error_code = p_decline, resource_id = NULL
         WHERE tenant_id = p_tenant AND key = p.key
        RETURNING expires_at INTO r.expires_at;
    END IF;
    RETURN r;
END
$$;

-- Each operation: claim, apply the effect when the claim is new, answer with the resource's
-- row as of now (NULL for a refusal), from which Rust rebuilds the body. A first answer and a
-- replay are built the same way; a later change (a refund) shows only in columns the
-- operation's answer does not read (src/ledger).

CREATE FUNCTION oncepay_pay(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
    v_balance bigint;
BEGIN
    IF c.outcome = 'created' THEN
        UPDATE accounts a SET balance = a.balance - p_amount
         WHERE a.tenant_id = p_tenant AND a.account_id = p_account AND a.balance >= p_amount
        RETURNING a.balance INTO v_balance;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, CASE
                WHEN EXISTS (SELECT FROM accounts a WHERE a.tenant_id = p_tenant AND a.account_id = p_account)
                THEN 'insufficient_funds' ELSE 'account_not_found' END::oncepay_decline);
        ELSE
            INSERT INTO payments (tenant_id, payment_id, account_id, amount, balance_after, idempotency_key, created_at)
            VALUES (p_tenant, c.resource_id::uuid, p_account, p_amount, v_balance, p.key, now());
        END IF;
    END IF;
    RETURN QUERY
        SELECT c.outcome, c.decline, c.expires_at, r
          FROM (VALUES (1)) AS one (x)
          LEFT JOIN payments r ON r.tenant_id = p_tenant AND r.payment_id = c.resource_id::uuid;
END
$$;

CREATE FUNCTION oncepay_refund(p_tenant uuid, p oncepay_claim_args, p_payment uuid)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_payment::text);
    v_pay record;
    v_balance bigint;
BEGIN
    IF c.outcome = 'created' THEN
        SELECT r.account_id, r.amount, r.refunded_at INTO v_pay
          FROM payments r WHERE r.tenant_id = p_tenant AND r.payment_id = p_payment
           FOR UPDATE;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, 'not_found');
        ELSIF v_pay.refunded_at IS NOT NULL THEN
            c := oncepay_decline(p_tenant, p, 'already_refunded');
        ELSE
            UPDATE accounts a SET balance = a.balance + v_pay.amount
             WHERE a.tenant_id = p_tenant AND a.account_id = v_pay.account_id
            RETURNING a.balance INTO v_balance;
            UPDATE payments r SET refunded_at = now(), balance_after_refund = v_balance
             WHERE r.tenant_id = p_tenant AND r.payment_id = p_payment;
        END IF;
    END IF;
    RETURN QUERY
        SELECT c.outcome, c.decline, c.expires_at, r
          FROM (VALUES (1)) AS one (x)
          LEFT JOIN payments r ON r.tenant_id = p_tenant AND r.payment_id = c.resource_id::uuid;
END
$$;

CREATE FUNCTION oncepay_deposit(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource deposits)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
    v_balance bigint;
BEGIN
    IF c.outcome = 'created' THEN
        UPDATE accounts a SET balance = a.balance + p_amount
         WHERE a.tenant_id = p_tenant AND a.account_id = p_account
        RETURNING a.balance INTO v_balance;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, 'account_not_found');
        ELSE
            INSERT INTO deposits (tenant_id, deposit_id, account_id, amount, balance_after, idempotency_key, created_at)
            VALUES (p_tenant, c.resource_id::uuid, p_account, p_amount, v_balance, p.key, now());
        END IF;
    END IF;
    RETURN QUERY
        SELECT c.outcome, c.decline, c.expires_at, r
          FROM (VALUES (1)) AS one (x)
          LEFT JOIN deposits r ON r.tenant_id = p_tenant AND r.deposit_id = c.resource_id::uuid;
END
$$;

CREATE FUNCTION oncepay_open_account(p_tenant uuid, p oncepay_claim_args, p_account text, p_balance bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource accounts)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_account);
BEGIN
    IF c.outcome = 'created' THEN
        INSERT INTO accounts (tenant_id, account_id, balance, opening_balance, created_at)
        VALUES (p_tenant, p_account, p_balance, p_balance, now())
        ON CONFLICT (tenant_id, account_id) DO NOTHING;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, 'account_exists');
        END IF;
    END IF;
    RETURN QUERY
        SELECT c.outcome, c.decline, c.expires_at, r
          FROM (VALUES (1)) AS one (x)
          LEFT JOIN accounts r ON r.tenant_id = p_tenant AND r.account_id = c.resource_id;
END
$$;

-- Both account rows are locked in one fixed order (by account id), so transfers in opposite
-- directions between the same accounts queue instead of deadlocking.
CREATE FUNCTION oncepay_transfer(p_tenant uuid, p oncepay_claim_args, p_from text, p_to text, p_amount bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource transfers)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed;
    v_locked int;
    v_from bigint;
    v_to bigint;
BEGIN
    -- Rust refuses this before calling (400); the SQL does not trust it to.
    IF p_from = p_to THEN
        RAISE EXCEPTION 'a transfer needs two different accounts' USING ERRCODE = 'check_violation';
    END IF;
    c := oncepay_claim(p_tenant, p, NULL);
    IF c.outcome = 'created' THEN
        SELECT count(*) INTO v_locked FROM (
            SELECT FROM accounts a
             WHERE a.tenant_id = p_tenant AND a.account_id IN (p_from, p_to)
             ORDER BY a.account_id
               FOR UPDATE) AS locked;
        IF v_locked < 2 THEN
            c := oncepay_decline(p_tenant, p, 'account_not_found');
        ELSE
            UPDATE accounts a SET balance = a.balance - p_amount
             WHERE a.tenant_id = p_tenant AND a.account_id = p_from AND a.balance >= p_amount
            RETURNING a.balance INTO v_from;
            IF NOT FOUND THEN
                c := oncepay_decline(p_tenant, p, 'insufficient_funds');
            ELSE
                UPDATE accounts a SET balance = a.balance + p_amount
                 WHERE a.tenant_id = p_tenant AND a.account_id = p_to
                RETURNING a.balance INTO v_to;
                INSERT INTO transfers (tenant_id, transfer_id, from_account_id, to_account_id, amount,
                                       from_balance_after, to_balance_after, idempotency_key, created_at)
                VALUES (p_tenant, c.resource_id::uuid, p_from, p_to, p_amount, v_from, v_to, p.key, now());
            END IF;
        END IF;
    END IF;
    RETURN QUERY
        SELECT c.outcome, c.decline, c.expires_at, r
          FROM (VALUES (1)) AS one (x)
          LEFT JOIN transfers r ON r.tenant_id = p_tenant AND r.transfer_id = c.resource_id::uuid;
END
$$;

CREATE VIEW idempotency_key_overview AS
SELECT k.tenant_id,
       t.name AS tenant_name,
       k.key,
       k.key LIKE 'fp:%' AS derived_key,
       k.operation,
       k.method,
       k.path,
       k.status,
       k.resource_id,
       k.error_code,
       k.created_at,
       k.expires_at,
       date_trunc('second', now() - k.created_at) AS age,
       greatest(date_trunc('second', k.expires_at - now()), interval '0') AS replay_remaining,
       CASE
           WHEN k.expires_at > now() THEN 'live'
           WHEN k.created_at < now() - oncepay_retention() THEN 'due_for_purge'
           ELSE 'expired'
       END AS state
  FROM idempotency_keys k
  JOIN tenants t USING (tenant_id);
