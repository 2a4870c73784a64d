-- The idempotent operations, one function each, so that a request is one round trip and one
-- transaction (an autocommit statement): claim the key, apply the effect, record the result.
--
-- Protocol (see src/idempotency/mod.rs for the whole story):
--   1. oncepay_claim inserts the key row before any account row is locked. A concurrent
--      duplicate's INSERT waits on the unique index for the first transaction; the wait is
--      bounded by the session's lock_timeout (ONCEPAY_INFLIGHT_WAIT_MS), whose expiry raises
--      SQLSTATE 55P03, answered as 409 request_in_progress. Once claimed, lock_timeout is
--      lifted for the rest of the transaction (statement_timeout still bounds it), so 55P03
--      can only ever mean "the original is still in flight".
--   2. The key row is written optimistically as the success (status, resource id) and
--      rewritten only when the effect declines, so the common path writes it once.
--   3. Everything commits together or not at all: a failed transaction leaves no key behind.

CREATE FUNCTION oncepay_claim(
    p_tenant uuid, p_key text, p_derived boolean, p_fingerprint bytea, p_method text,
    p_path text, p_window_secs integer, p_status smallint, p_resource_id text,
    OUT claimed boolean, OUT outcome text, OUT stored_status smallint,
    OUT stored_error text, OUT stored_resource text)
LANGUAGE plpgsql AS $$
DECLARE
    k idempotency_keys%ROWTYPE;
BEGIN
    -- Three rounds at most: a row can vanish (purge) or be renewed (derived key) between
    -- the INSERT and the SELECT; a fourth change in a row would be a bug, answered as transient.
    FOR attempt IN 1..3 LOOP
        INSERT INTO idempotency_keys AS i
            (tenant_id, key, fingerprint, method, path, status, resource_id, created_at, expires_at)
        VALUES (p_tenant, p_key, p_fingerprint, p_method, p_path, p_status, p_resource_id,
                now(), now() + make_interval(secs => p_window_secs))
        ON CONFLICT (tenant_id, key) DO NOTHING;
        IF FOUND THEN
            claimed := true;
            outcome := 'created';
            PERFORM set_config('lock_timeout', '0', true);
            RETURN;
        END IF;

        SELECT * INTO k FROM idempotency_keys i WHERE i.tenant_id = p_tenant AND i.key = p_key;
        CONTINUE WHEN NOT FOUND;

        claimed := false;
        IF k.expires_at <= now() THEN
            IF NOT p_derived THEN
                outcome := 'expired';
                RETURN;
            END IF;
            -- A derived key (policy `fingerprint`) past its window starts afresh. Replicas
            -- racing here serialise on the row lock; the losers re-check and replay.
            UPDATE idempotency_keys i
               SET fingerprint = p_fingerprint, method = p_method, path = p_path,
                   status = p_status, resource_id = p_resource_id, error_code = NULL,
                   created_at = now(), expires_at = now() + make_interval(secs => p_window_secs)
             WHERE i.tenant_id = p_tenant AND i.key = p_key AND i.expires_at <= now();
            IF FOUND THEN
                claimed := true;
                outcome := 'created';
                PERFORM set_config('lock_timeout', '0', true);
                RETURN;
            END IF;
            CONTINUE;
        END IF;

        IF k.fingerprint <> p_fingerprint THEN
            outcome := 'key_reused';
            RETURN;
        END IF;
        outcome := 'replayed';
        stored_status := k.status;
        stored_error := k.error_code;
        stored_resource := k.resource_id;
        RETURN;
    END LOOP;
    RAISE EXCEPTION 'idempotency key changed three times during one claim'
        USING ERRCODE = 'serialization_failure';
END
$$;

-- Records a declined effect on a claimed key: the decline is stored and replayed.
CREATE FUNCTION oncepay_decline(p_tenant uuid, p_key text, p_status smallint, p_code text)
RETURNS void
LANGUAGE sql AS $$
    UPDATE idempotency_keys
       SET status = p_status, error_code = p_code, resource_id = NULL
     WHERE tenant_id = p_tenant AND key = p_key;
$$;

CREATE FUNCTION oncepay_pay(
    p_tenant uuid, p_key text, p_derived boolean, p_fingerprint bytea, p_window_secs integer,
    p_account text, p_amount bigint)
RETURNS TABLE (outcome text, status smallint, error_code text, payment_id uuid,
               account_id text, amount bigint, balance_after bigint, created_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c record;
    v_id uuid := gen_random_uuid();
    v_balance bigint;
    v_status smallint;
    v_code text;
BEGIN
    IF p_key IS NOT NULL THEN
        SELECT * INTO c FROM oncepay_claim(p_tenant, p_key, p_derived, p_fingerprint, 'POST',
                                           '/payments', p_window_secs, 201::smallint, v_id::text);
        IF NOT c.claimed THEN
            RETURN QUERY
                SELECT c.outcome, c.stored_status, c.stored_error, p.payment_id, p.account_id,
                       p.amount, p.balance_after, p.created_at
                  FROM (VALUES (1)) AS one (x)
                  LEFT JOIN payments p
                    ON p.tenant_id = p_tenant AND p.payment_id = c.stored_resource::uuid;
            RETURN;
        END IF;
    END IF;

    UPDATE accounts a SET balance = a.balance - p_amount
     WHERE a.tenant_id = p_tenant AND a.account_id = p_account AND a.balance >= p_amount
    RETURNING a.balance INTO v_balance;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM accounts a WHERE a.tenant_id = p_tenant AND a.account_id = p_account) THEN
            v_status := 402; v_code := 'insufficient_funds';
        ELSE
            v_status := 404; v_code := 'account_not_found';
        END IF;
        IF p_key IS NOT NULL THEN
            PERFORM oncepay_decline(p_tenant, p_key, v_status, v_code);
        END IF;
        RETURN QUERY SELECT 'declined'::text, v_status, v_code, NULL::uuid, NULL::text,
                            NULL::bigint, NULL::bigint, NULL::timestamptz;
        RETURN;
    END IF;

    INSERT INTO payments (tenant_id, payment_id, account_id, amount, balance_after, idempotency_key, created_at)
    VALUES (p_tenant, v_id, p_account, p_amount, v_balance, p_key, now());
    RETURN QUERY SELECT 'created'::text, 201::smallint, NULL::text, v_id, p_account, p_amount,
                        v_balance, now();
END
$$;

CREATE FUNCTION oncepay_refund(
    p_tenant uuid, p_key text, p_derived boolean, p_fingerprint bytea, p_path text,
    p_window_secs integer, p_payment uuid)
RETURNS TABLE (outcome text, status smallint, error_code text, payment_id uuid,
               refunded bigint, balance_after_refund bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c record;
    v_pay record;
    v_balance bigint;
    v_status smallint;
    v_code text;
BEGIN
    IF p_key IS NOT NULL THEN
        SELECT * INTO c FROM oncepay_claim(p_tenant, p_key, p_derived, p_fingerprint, 'POST',
                                           p_path, p_window_secs, 200::smallint, p_payment::text);
        IF NOT c.claimed THEN
            RETURN QUERY
                SELECT c.outcome, c.stored_status, c.stored_error, p.payment_id, p.amount,
                       p.balance_after_refund
                  FROM (VALUES (1)) AS one (x)
                  LEFT JOIN payments p
                    ON p.tenant_id = p_tenant AND p.payment_id = c.stored_resource::uuid;
            RETURN;
        END IF;
    END IF;

    SELECT p.account_id, p.amount, p.refunded_at INTO v_pay
      FROM payments p WHERE p.tenant_id = p_tenant AND p.payment_id = p_payment
       FOR UPDATE;
    IF NOT FOUND OR v_pay.refunded_at IS NOT NULL THEN
        IF NOT FOUND THEN
            v_status := 404; v_code := 'not_found';
        ELSE
            v_status := 409; v_code := 'already_refunded';
        END IF;
        IF p_key IS NOT NULL THEN
            PERFORM oncepay_decline(p_tenant, p_key, v_status, v_code);
        END IF;
        RETURN QUERY SELECT 'declined'::text, v_status, v_code, NULL::uuid, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;

    UPDATE accounts a SET balance = a.balance + v_pay.amount
     WHERE a.tenant_id = p_tenant AND a.account_id = v_pay.account_id
    RETURNING a.balance INTO v_balance;
    UPDATE payments p SET refunded_at = now(), balance_after_refund = v_balance
     WHERE p.tenant_id = p_tenant AND p.payment_id = p_payment;
    RETURN QUERY SELECT 'created'::text, 200::smallint, NULL::text, p_payment, v_pay.amount, v_balance;
END
$$;

CREATE FUNCTION oncepay_deposit(
    p_tenant uuid, p_key text, p_derived boolean, p_fingerprint bytea, p_path text,
    p_window_secs integer, p_account text, p_amount bigint)
RETURNS TABLE (outcome text, status smallint, error_code text, deposit_id uuid,
               account_id text, amount bigint, balance_after bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c record;
    v_id uuid := gen_random_uuid();
    v_balance bigint;
BEGIN
    IF p_key IS NOT NULL THEN
        SELECT * INTO c FROM oncepay_claim(p_tenant, p_key, p_derived, p_fingerprint, 'POST',
                                           p_path, p_window_secs, 201::smallint, v_id::text);
        IF NOT c.claimed THEN
            RETURN QUERY
                SELECT c.outcome, c.stored_status, c.stored_error, d.deposit_id, d.account_id,
                       d.amount, d.balance_after
                  FROM (VALUES (1)) AS one (x)
                  LEFT JOIN deposits d
                    ON d.tenant_id = p_tenant AND d.deposit_id = c.stored_resource::uuid;
            RETURN;
        END IF;
    END IF;

    UPDATE accounts a SET balance = a.balance + p_amount
     WHERE a.tenant_id = p_tenant AND a.account_id = p_account
    RETURNING a.balance INTO v_balance;
    IF NOT FOUND THEN
        IF p_key IS NOT NULL THEN
            PERFORM oncepay_decline(p_tenant, p_key, 404::smallint, 'account_not_found');
        END IF;
        RETURN QUERY SELECT 'declined'::text, 404::smallint, 'account_not_found'::text,
                            NULL::uuid, NULL::text, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;

    INSERT INTO deposits (tenant_id, deposit_id, account_id, amount, balance_after, idempotency_key, created_at)
    VALUES (p_tenant, v_id, p_account, p_amount, v_balance, p_key, now());
    RETURN QUERY SELECT 'created'::text, 201::smallint, NULL::text, v_id, p_account, p_amount, v_balance;
END
$$;

CREATE FUNCTION oncepay_open_account(
    p_tenant uuid, p_key text, p_derived boolean, p_fingerprint bytea, p_window_secs integer,
    p_account text, p_balance bigint)
RETURNS TABLE (outcome text, status smallint, error_code text, account_id text,
               opening_balance bigint, created_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    IF p_key IS NOT NULL THEN
        SELECT * INTO c FROM oncepay_claim(p_tenant, p_key, p_derived, p_fingerprint, 'POST',
                                           '/accounts', p_window_secs, 201::smallint, p_account);
        IF NOT c.claimed THEN
            RETURN QUERY
                SELECT c.outcome, c.stored_status, c.stored_error, a.account_id,
                       a.opening_balance, a.created_at
                  FROM (VALUES (1)) AS one (x)
                  LEFT JOIN accounts a
                    ON a.tenant_id = p_tenant AND a.account_id = c.stored_resource;
            RETURN;
        END IF;
    END IF;

    INSERT INTO accounts (tenant_id, account_id, balance, opening_balance, created_at)
    VALUES (p_tenant, p_account, p_balance, p_balance, now())
    ON CONFLICT (tenant_id, account_id) DO NOTHING;
    IF NOT FOUND THEN
        IF p_key IS NOT NULL THEN
            PERFORM oncepay_decline(p_tenant, p_key, 409::smallint, 'account_exists');
        END IF;
        RETURN QUERY SELECT 'declined'::text, 409::smallint, 'account_exists'::text,
                            NULL::text, NULL::bigint, NULL::timestamptz;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'created'::text, 201::smallint, NULL::text, p_account, p_balance, now();
END
$$;
