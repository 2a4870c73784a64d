-- The same rules as V4, at a fraction of the cost per operation (issue 9: V4 made a new
-- payment cost PostgreSQL 943k instructions against 565k for V2; now ~600k).
--
-- Measured with callgrind on one backend, instructions per new payment, steady state (20k
-- payments in the tables, analysed); the commands are in docs/bench/analysis.md:
--   * CHECK constraints are re-read and re-planned for every INSERT or UPDATE statement that
--     touches their table (ExecRelCheck: stringToNode + expression_planner per execution, not
--     per backend). V4's eleven CHECKs on the three hot tables cost ~320k per payment: a third
--     of it, and the balance UPDATE paid for the account-id regex it never changes.
--   * A domain's constraint is parsed once per backend (typcache) and evaluated only when a
--     value is written to a column of that type: the same rules as domains cost ~5k.
--   * Answering with a second read of the row just written, and PERFORM (a full executor run
--     per call) for set_config, cost ~40k more.
-- So: every single-column rule becomes a domain on its column; the multi-column rules stay as
-- CHECKs only on tables written off the hot path (transfers) or where they replace nothing
-- cheaper; the functions answer from RETURNING and read the resource only on a replay.
--
-- The rows' Rust mirrors (src/ledger/rows.rs) decode the domain columns with newtypes named
-- after the domains (sqlx checks a composite's field types by name).

CREATE DOMAIN oncepay_idempotency_key AS text CHECK (length(VALUE) BETWEEN 1 AND 255);
CREATE DOMAIN oncepay_fingerprint AS bytea CHECK (octet_length(VALUE) = 32);  -- SHA-256
CREATE DOMAIN oncepay_http_method AS text CHECK (VALUE IN ('POST', 'PATCH', 'PUT', 'DELETE'));
-- A stored result: a success or a client error, never a 3xx or a 5xx (those are not stored).
CREATE DOMAIN oncepay_key_status AS smallint
    CHECK (VALUE BETWEEN 200 AND 299 OR VALUE BETWEEN 400 AND 499);
CREATE DOMAIN oncepay_account_id AS text CHECK (VALUE ~ '^[A-Za-z0-9_.:-]{1,64}$');
CREATE DOMAIN oncepay_amount AS bigint CHECK (VALUE BETWEEN 1 AND 1000000000000);
CREATE DOMAIN oncepay_balance AS bigint CHECK (VALUE >= 0);
CREATE DOMAIN oncepay_opening_balance AS bigint CHECK (VALUE BETWEEN 0 AND 1000000000000);

-- The view and the functions name the columns whose types change.
DROP VIEW idempotency_key_overview;
DROP FUNCTION oncepay_pay(uuid, oncepay_claim_args, text, bigint);
DROP FUNCTION oncepay_refund(uuid, oncepay_claim_args, uuid);
DROP FUNCTION oncepay_deposit(uuid, oncepay_claim_args, text, bigint);
DROP FUNCTION oncepay_open_account(uuid, oncepay_claim_args, text, bigint);
DROP FUNCTION oncepay_transfer(uuid, oncepay_claim_args, text, text, bigint);

-- idempotency_keys: the multi-column rules (a success names its resource and no error, a
-- failure the reverse; the window is positive) cost ~40k per new key as a CHECK. The key row
-- is written by two statements only, oncepay_claim's INSERT/renewal and oncepay_decline's
-- UPDATE, each of which sets the columns together (tests/api/sql_functions.rs drives every
-- path and checks the rows); the single-column rules stay enforced by the types.
ALTER TABLE idempotency_keys
    DROP CONSTRAINT idempotency_keys_key_check,
    DROP CONSTRAINT idempotency_keys_fingerprint_check,
    DROP CONSTRAINT idempotency_keys_method_check,
    DROP CONSTRAINT idempotency_keys_status_check,
    DROP CONSTRAINT idempotency_keys_result_check,
    DROP CONSTRAINT idempotency_keys_window_check,
    ALTER COLUMN key TYPE oncepay_idempotency_key,
    ALTER COLUMN fingerprint TYPE oncepay_fingerprint,
    ALTER COLUMN method TYPE oncepay_http_method,
    ALTER COLUMN status TYPE oncepay_key_status;

ALTER TABLE accounts
    DROP CONSTRAINT accounts_balance_check,
    DROP CONSTRAINT accounts_account_id_check,
    DROP CONSTRAINT accounts_opening_balance_check,
    ALTER COLUMN account_id TYPE oncepay_account_id,
    ALTER COLUMN balance TYPE oncepay_balance,
    ALTER COLUMN opening_balance TYPE oncepay_opening_balance;

-- payments_refund_check stays: it is evaluated on the payment INSERT too (~15k), but a refund
-- is the one later write of a payment row and the pair must change together.
ALTER TABLE payments
    DROP CONSTRAINT payments_amount_check,
    DROP CONSTRAINT payments_balance_after_check,
    ALTER COLUMN amount TYPE oncepay_amount,
    ALTER COLUMN balance_after TYPE oncepay_balance;

ALTER TABLE deposits
    DROP CONSTRAINT deposits_amount_check,
    ALTER COLUMN amount TYPE oncepay_amount;

ALTER TABLE transfers
    DROP CONSTRAINT transfers_amount_check,
    DROP CONSTRAINT transfers_balances_check,
    ALTER COLUMN amount TYPE oncepay_amount,
    ALTER COLUMN from_balance_after TYPE oncepay_balance,
    ALTER COLUMN to_balance_after TYPE oncepay_balance;

-- set_config through an assignment: plpgsql evaluates it as a simple expression, where
-- PERFORM would start an executor for a one-row SELECT. Otherwise as in V4.
CREATE OR REPLACE FUNCTION oncepay_claim(p_tenant uuid, p oncepay_claim_args, p_resource_id text)
RETURNS oncepay_claimed
LANGUAGE plpgsql AS $$
DECLARE
    k idempotency_keys%ROWTYPE;
    r oncepay_claimed;
    claimed boolean;
    setting text;
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
            setting := set_config('lock_timeout', p.inflight_wait_ms || 'ms', true);
            INSERT INTO idempotency_keys AS i
                (tenant_id, key, fingerprint, operation, method, path, status, resource_id,
                 created_at, expires_at)
            VALUES (p_tenant, p.key, p.fingerprint, p.operation, p.method, p.path,
                    p.success_status, r.resource_id, now(),
                    now() + make_interval(secs => p.window_secs))
            ON CONFLICT (tenant_id, key) DO NOTHING
            RETURNING i.expires_at INTO r.expires_at;
            claimed := FOUND;
            setting := set_config('lock_timeout', '0', true);
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
            setting := set_config('lock_timeout', p.inflight_wait_ms || 'ms', true);
            UPDATE idempotency_keys i
               SET fingerprint = p.fingerprint, operation = p.operation, method = p.method,
                   path = p.path, status = p.success_status, resource_id = r.resource_id,
                   error_code = NULL, created_at = now(),
                   expires_at = now() + make_interval(secs => p.window_secs)
             WHERE i.tenant_id = p_tenant AND i.key = p.key AND i.expires_at <= now()
            RETURNING i.expires_at INTO r.expires_at;
            claimed := FOUND;
            setting := set_config('lock_timeout', '0', true);
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

-- Each operation: claim; when the claim is new, apply the effect and answer with the row it
-- wrote (RETURNING); on a replay, answer with the resource's row as of now, read by its key;
-- a refusal has no row. A later change (a refund) shows only in columns the operation's
-- answer does not read (src/ledger). The answer is the function's one output row (RETURN
-- NEXT on the OUT columns: no query to run).

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
            INSERT INTO payments AS r (tenant_id, payment_id, account_id, amount, balance_after, idempotency_key, created_at)
            VALUES (p_tenant, c.resource_id::uuid, p_account, p_amount, v_balance, p.key, now())
            RETURNING r.* INTO resource;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM payments r
         WHERE r.tenant_id = p_tenant AND r.payment_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
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
             WHERE r.tenant_id = p_tenant AND r.payment_id = p_payment
            RETURNING r.* INTO resource;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM payments r
         WHERE r.tenant_id = p_tenant AND r.payment_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
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
            INSERT INTO deposits AS r (tenant_id, deposit_id, account_id, amount, balance_after, idempotency_key, created_at)
            VALUES (p_tenant, c.resource_id::uuid, p_account, p_amount, v_balance, p.key, now())
            RETURNING r.* INTO resource;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM deposits r
         WHERE r.tenant_id = p_tenant AND r.deposit_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
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
        INSERT INTO accounts AS r (tenant_id, account_id, balance, opening_balance, created_at)
        VALUES (p_tenant, p_account, p_balance, p_balance, now())
        ON CONFLICT (tenant_id, account_id) DO NOTHING
        RETURNING r.* INTO resource;
        IF NOT FOUND THEN
            -- INTO with no row leaves a row of NULLs, which is not a NULL row.
            resource := NULL;
            c := oncepay_decline(p_tenant, p, 'account_exists');
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM accounts r
         WHERE r.tenant_id = p_tenant AND r.account_id = c.resource_id;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
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
                INSERT INTO transfers AS r (tenant_id, transfer_id, from_account_id, to_account_id, amount,
                                            from_balance_after, to_balance_after, idempotency_key, created_at)
                VALUES (p_tenant, c.resource_id::uuid, p_from, p_to, p_amount, v_from, v_to, p.key, now())
                RETURNING r.* INTO resource;
            END IF;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM transfers r
         WHERE r.tenant_id = p_tenant AND r.transfer_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
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
