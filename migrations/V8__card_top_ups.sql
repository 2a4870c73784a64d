-- Card top-ups through a processor speaking Stripe's API (issue 24, contract section 4b).
--
-- A top-up is not one transaction: a card is charged over HTTP between two of them. So it is
-- a sequence of atomic phases (Brandur Leach, "Implementing Stripe-like Idempotency Keys in
-- Postgres"), each a transaction of its own, with the processor calls between them and the
-- top-up row recording how far it got (`recovery_point`):
--
--   begin      claim the key and insert the top-up (`started`), with a lease for its owner
--   (call)     create the PaymentIntent, unconfirmed, metadata[oncepay_top_up_id]
--   intent     commit its id (`intent_created`): from here on only this one is ever confirmed
--   (call)     confirm it (or, when resuming, first GET it: it may have succeeded already)
--   finish     oncepay_top_up_succeed (credit, `succeeded`) or oncepay_top_up_fail (`failed`,
--              the key row becomes the stored decline)
--
-- No transaction is open and no row is locked while a call is out. The owner of an
-- unfinished top-up is named by a lease (`lease_owner`, `lease_expires_at`), not by a row
-- lock: a request or the completer takes it when it is free or expired, and gives it back
-- (expires it) when a call's outcome is unknown, so that the client's retry resumes at once.
-- The lease and the key's replay window (`idempotency_keys.expires_at`) are separate clocks.
--
-- A refund (its own operation and key) debits the balance first (`refund_state = debited`),
-- then refunds at the processor, then oncepay_top_up_refunded records it.
--
-- The three final state changes are each one function, the one place where a
-- `top_up.succeeded`, `top_up.failed` or `top_up.refunded` event is to be written in the same
-- transaction: oncepay_top_up_succeed, oncepay_top_up_fail, oncepay_top_up_refunded.
--
-- New enum labels are not used by this migration itself (it is one transaction, and a label
-- added in a transaction cannot be used before it commits): the functions cast text at call
-- time.

ALTER TYPE oncepay_operation ADD VALUE 'top_up';
ALTER TYPE oncepay_operation ADD VALUE 'refund_top_up';
ALTER TYPE oncepay_decline ADD VALUE 'card_declined';
ALTER TYPE oncepay_decline ADD VALUE 'invalid_payment_method';

CREATE DOMAIN oncepay_top_up_status AS text
    CHECK (VALUE IN ('processing', 'succeeded', 'failed', 'refunded'));
CREATE DOMAIN oncepay_top_up_recovery_point AS text
    CHECK (VALUE IN ('started', 'intent_created', 'finished'));
CREATE DOMAIN oncepay_top_up_refund_state AS text CHECK (VALUE IN ('debited', 'refunded'));

CREATE TABLE top_ups (
    tenant_id             uuid                          NOT NULL,
    top_up_id             uuid                          NOT NULL,
    account_id            oncepay_account_id            NOT NULL,
    amount                oncepay_amount                NOT NULL,
    currency              text                          NOT NULL,
    payment_method        text                          NOT NULL,
    status                oncepay_top_up_status         NOT NULL,
    recovery_point        oncepay_top_up_recovery_point NOT NULL,
    -- The PaymentIntent's id, committed before it is confirmed.
    processor_payment_id  text,
    -- The stored decline (`card_declined`, `invalid_payment_method`) and the processor's
    -- own reason (its `decline_code`, or its error `code`).
    failure_code          text,
    decline_code          text,
    balance_after         bigint,
    idempotency_key       text,
    -- The refund: NULL, `debited` (the balance was debited, the processor not yet told), or
    -- `refunded`; the key of the refund request; the processor's refund id.
    refund_state          oncepay_top_up_refund_state,
    refund_key            text,
    processor_refund_id   text,
    balance_after_refund  bigint,
    -- Who drives the unfinished top-up (or its refund) now, and until when.
    lease_owner           uuid,
    lease_expires_at      timestamptz,
    attempts              integer                       NOT NULL DEFAULT 1,
    created_at            timestamptz                   NOT NULL,
    updated_at            timestamptz                   NOT NULL,
    finished_at           timestamptz,
    refunded_at           timestamptz,
    -- The processor (its base URL) the top-up was made with: only a completer configured with
    -- the same processor finishes it (a PaymentIntent lives at one processor).
    processor             text                          NOT NULL,
    CONSTRAINT top_ups_pkey PRIMARY KEY (tenant_id, top_up_id),
    CONSTRAINT top_ups_account_fkey FOREIGN KEY (tenant_id, account_id)
        REFERENCES accounts (tenant_id, account_id),
    CONSTRAINT top_ups_succeeded_check CHECK (
        (status IN ('succeeded', 'refunded')) = (balance_after IS NOT NULL)),
    CONSTRAINT top_ups_refund_check CHECK (
        refund_state IS NULL OR status IN ('succeeded', 'refunded')),
    CONSTRAINT top_ups_refunded_check CHECK (
        (status = 'refunded') = (refund_state IS NOT DISTINCT FROM 'refunded'))
);

-- The completer's work: unfinished top-ups and refunds, oldest activity first.
CREATE INDEX top_ups_unfinished ON top_ups (updated_at)
    WHERE status = 'processing' OR refund_state = 'debited';
-- The audit's lookup of a PaymentIntent's top-up.
CREATE INDEX top_ups_processor_payment ON top_ups (processor_payment_id)
    WHERE processor_payment_id IS NOT NULL;

-- Phase 1 of a top-up: claim the key and insert the top-up in one transaction, its owner's
-- lease taken; or, for a key already claimed, the top-up as it is now, its lease taken if the
-- top-up is unfinished and the lease is free (`owned`). An unknown account is a stored
-- decline, before anything is sent to the processor.
CREATE FUNCTION oncepay_top_up_begin(p_tenant uuid, p oncepay_claim_args, p_account text,
                                     p_amount bigint, p_currency text, p_payment_method text,
                                     p_owner uuid, p_lease_secs integer, p_processor text)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource top_ups, owned boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
BEGIN
    owned := false;
    IF c.outcome = 'created' THEN
        IF NOT EXISTS (SELECT FROM accounts a WHERE a.tenant_id = p_tenant AND a.account_id = p_account) THEN
            c := oncepay_decline(p_tenant, p, 'account_not_found');
        ELSE
            INSERT INTO top_ups AS r (tenant_id, top_up_id, account_id, amount, currency,
                                      payment_method, status, recovery_point, idempotency_key,
                                      lease_owner, lease_expires_at, created_at, updated_at, processor)
            VALUES (p_tenant, c.resource_id::uuid, p_account, p_amount, p_currency,
                    p_payment_method, 'processing', 'started', p.key,
                    p_owner, now() + make_interval(secs => p_lease_secs), now(), now(), p_processor)
            RETURNING r.* INTO resource;
            owned := true;
        END IF;
    ELSIF c.outcome = 'replayed' AND c.resource_id IS NOT NULL THEN
        UPDATE top_ups r
           SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_secs),
               attempts = r.attempts + 1, updated_at = now()
         WHERE r.tenant_id = p_tenant AND r.top_up_id = c.resource_id::uuid
           AND r.status = 'processing'
           AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())
        RETURNING r.* INTO resource;
        IF FOUND THEN
            owned := true;
        ELSE
            SELECT r.* INTO resource FROM top_ups r
             WHERE r.tenant_id = p_tenant AND r.top_up_id = c.resource_id::uuid;
        END IF;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

-- Phase 2: the PaymentIntent's id, committed before it is confirmed. Only the lease's owner
-- records one, and only once: the answer is the row as it is now, whose
-- `processor_payment_id` is the one PaymentIntent of this top-up that may be confirmed.
CREATE FUNCTION oncepay_top_up_intent_created(p_tenant uuid, p_top_up uuid, p_owner uuid,
                                              p_intent text)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET processor_payment_id = p_intent, recovery_point = 'intent_created', updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
       AND t.recovery_point = 'started' AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

-- Final: the PaymentIntent succeeded; the account is credited, once (a top-up no longer
-- `processing` is answered as it is). The place of a `top_up.succeeded` event.
CREATE FUNCTION oncepay_top_up_succeed(p_tenant uuid, p_top_up uuid, p_intent text)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
    v_balance bigint;
BEGIN
    SELECT t.* INTO r FROM top_ups t
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up FOR UPDATE;
    IF NOT FOUND OR r.status <> 'processing' THEN
        RETURN r;
    END IF;
    IF r.processor_payment_id IS DISTINCT FROM p_intent THEN
        RAISE EXCEPTION 'top-up % succeeded with PaymentIntent %, not its own %',
            p_top_up, p_intent, r.processor_payment_id;
    END IF;
    UPDATE accounts a SET balance = a.balance + r.amount
     WHERE a.tenant_id = p_tenant AND a.account_id = r.account_id
    RETURNING a.balance INTO v_balance;
    UPDATE top_ups t
       SET status = 'succeeded', recovery_point = 'finished', balance_after = v_balance,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up
    RETURNING t.* INTO r;
    RETURN r;
END
$$;

-- Final: the processor declined (`card_declined`) or refused the payment method
-- (`invalid_payment_method`); nothing was charged. The key row becomes that stored decline
-- (it keeps naming the top-up, whose row holds the processor's `decline_code` for the
-- replay). The place of a `top_up.failed` event.
CREATE FUNCTION oncepay_top_up_fail(p_tenant uuid, p_top_up uuid, p_failure text,
                                    p_decline_code text, p_status smallint)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET status = 'failed', recovery_point = 'finished', failure_code = p_failure,
           decline_code = p_decline_code, lease_owner = NULL, lease_expires_at = NULL,
           updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
        RETURN r;
    END IF;
    IF r.idempotency_key IS NOT NULL THEN
        UPDATE idempotency_keys k
           SET status = p_status, error_code = p_failure::oncepay_decline
         WHERE k.tenant_id = p_tenant AND k.key = r.idempotency_key
           AND k.resource_id = p_top_up::text;
    END IF;
    RETURN r;
END
$$;

-- The outcome of a call is unknown: the owner gives its lease back, so that the client's
-- retry (or, later, the completer) resumes at once.
CREATE FUNCTION oncepay_top_up_release(p_tenant uuid, p_top_up uuid, p_owner uuid)
RETURNS void
LANGUAGE sql AS $$
    UPDATE top_ups t SET lease_expires_at = now(), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.lease_owner = p_owner;
$$;

-- Phase 1 of a refund: claim the refund's key, debit the balance (402 when it no longer
-- covers the top-up, 409 when a refund was already made), mark the top-up `debited`, and take
-- the lease; or, for a key already claimed, the top-up as it is, its lease taken if the
-- refund is unfinished and the lease free. A top-up still processing is not refundable yet:
-- 55P03 rolls the claim back (409 request_in_progress, nothing stored).
CREATE FUNCTION oncepay_top_up_refund_begin(p_tenant uuid, p oncepay_claim_args, p_top_up uuid,
                                            p_owner uuid, p_lease_secs integer)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource top_ups, owned boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_top_up::text);
    t top_ups;
    v_balance bigint;
BEGIN
    owned := false;
    IF c.outcome = 'created' THEN
        SELECT r.* INTO t FROM top_ups r
         WHERE r.tenant_id = p_tenant AND r.top_up_id = p_top_up FOR UPDATE;
        IF NOT FOUND OR t.status = 'failed' THEN
            c := oncepay_decline(p_tenant, p, 'not_found');
        ELSIF t.status = 'processing' THEN
            RAISE EXCEPTION 'top-up % is still processing', p_top_up USING ERRCODE = 'lock_not_available';
        ELSIF t.refund_state IS NOT NULL THEN
            c := oncepay_decline(p_tenant, p, 'already_refunded');
        ELSE
            UPDATE accounts a SET balance = a.balance - t.amount
             WHERE a.tenant_id = p_tenant AND a.account_id = t.account_id AND a.balance >= t.amount
            RETURNING a.balance INTO v_balance;
            IF NOT FOUND THEN
                c := oncepay_decline(p_tenant, p, 'insufficient_funds');
            ELSE
                UPDATE top_ups r
                   SET refund_state = 'debited', refund_key = p.key, balance_after_refund = v_balance,
                       lease_owner = p_owner,
                       lease_expires_at = now() + make_interval(secs => p_lease_secs),
                       attempts = 1, updated_at = now()
                 WHERE r.tenant_id = p_tenant AND r.top_up_id = p_top_up
                RETURNING r.* INTO resource;
                owned := true;
            END IF;
        END IF;
    ELSIF c.outcome = 'replayed' AND c.resource_id IS NOT NULL THEN
        UPDATE top_ups r
           SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_secs),
               attempts = r.attempts + 1, updated_at = now()
         WHERE r.tenant_id = p_tenant AND r.top_up_id = c.resource_id::uuid
           AND r.refund_state = 'debited'
           AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())
        RETURNING r.* INTO resource;
        IF FOUND THEN
            owned := true;
        ELSE
            SELECT r.* INTO resource FROM top_ups r
             WHERE r.tenant_id = p_tenant AND r.top_up_id = c.resource_id::uuid;
        END IF;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

-- Final: the processor refunded. The place of a `top_up.refunded` event.
CREATE FUNCTION oncepay_top_up_refunded(p_tenant uuid, p_top_up uuid, p_refund text)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET status = 'refunded', refund_state = 'refunded', processor_refund_id = p_refund,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), refunded_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.refund_state = 'debited'
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

-- The completer: up to `p_limit` top-ups (or refunds) of its processor unfinished, untouched
-- for `p_after_secs`, whose lease is free or expired, leased to `p_owner`. Replicas running this
-- at once skip each other's rows (SKIP LOCKED) and then each other's leases.
CREATE FUNCTION oncepay_top_up_claim_stale(p_owner uuid, p_after_secs integer,
                                           p_lease_secs integer, p_limit integer, p_processor text)
RETURNS SETOF top_ups
LANGUAGE sql AS $$
    WITH stale AS (
        SELECT t.tenant_id, t.top_up_id FROM top_ups t
         WHERE (t.status = 'processing' OR t.refund_state = 'debited')
           AND t.processor = p_processor
           AND t.updated_at <= now() - make_interval(secs => p_after_secs)
           AND (t.lease_expires_at IS NULL OR t.lease_expires_at <= now())
         ORDER BY t.updated_at
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED)
    UPDATE top_ups t
       SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_secs),
           attempts = t.attempts + 1, updated_at = now()
      FROM stale
     WHERE t.tenant_id = stale.tenant_id AND t.top_up_id = stale.top_up_id
    RETURNING t.*;
$$;
