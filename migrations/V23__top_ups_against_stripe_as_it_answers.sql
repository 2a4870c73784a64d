-- Top-ups that hold against Stripe as it answers, not only its emulator (issue 36, contract
-- section 4b).
--
-- 1. Keys in a numbered series. Stripe saves a 5xx under its Idempotency-Key and answers it
--    again to every retry with that key (`Idempotent-Replayed: true`) for at least a day. A
--    driver that meets such an answer reads the processor's state instead (the PaymentIntents
--    carrying the top-up's metadata, the PaymentIntent, the refunds) and, only when the call
--    did not take effect, sends it again under the next key of the call's series. The series
--    is in the row (`create_key_series`, `confirm_key_series`, `cancel_key_series`,
--    `refund_key_series`; 0 is the key of V8, without a number), so that every replica and the
--    completer continue it; oncepay_top_up_next_key moves it on, once per key seen replayed.
--
-- 2. Every status ends. A PaymentIntent that waits (`requires_action`, `requires_capture`,
--    `processing`) or a refund that is `pending` is recorded as such by oncepay_top_up_wait /
--    oncepay_top_up_refund_wait: the status (`processor_status`, `refund_status`), the number
--    of looks (`checks`) and when the completer looks next (`next_check_at`, an interval that
--    grows with `checks`); the lease is given back, so that the client's retry looks at once.
--    The completer claims the top-ups that are due (oncepay_top_up_claim_due) one at a time.
--
-- 3. Refunds by their status. A refund that ends `failed` or `canceled`, or that the
--    processor refuses, credits the debited amount back in the transaction that records it
--    (oncepay_top_up_refund_failed): the top-up is `succeeded` again, with
--    `refund_failure_code`, and the refund's key row becomes a stored failure
--    (`refund_failed`). Its event, `top_up.refund_failed`, is written by that function: the
--    status does not change, so the trigger of V10 does not fire. While the refund waits for
--    the processor (`refund_state = 'debited'`), the top-up shows as `refund_pending`.
--
-- 4. Every phase's write checks its owner. The final phases take the lease owner and change
--    nothing for another (a driver whose lease ran out and was taken writes nothing), and
--    oncepay_top_up_renew lets a driver renew its lease between calls. The row names its
--    processor by a configured name (`ONCEPAY_PROCESSOR_NAME`) instead of its URL's text; the
--    completer finishes rows of any of the names it is given (the name, and the URL for rows
--    written before).
--
-- Replicas of the previous version keep calling V8's and V22's functions by their signatures:
-- those stay as they were (the new phases are new signatures), except oncepay_top_up_refunded
-- of three arguments, which no longer records as refunded a refund this version saw
-- `pending` (the previous version reads no refund status), and oncepay_top_up_refund_begin,
-- same signature and answers, which also starts the new refund columns afresh. Each final
-- phase that can write an event takes the tenant's events lock first (V22's header).
--
-- New enum labels are not used by this migration itself (it is one transaction): the
-- functions cast text at call time, as V8's do.

ALTER TYPE oncepay_decline ADD VALUE IF NOT EXISTS 'invalid_request';
ALTER TYPE oncepay_decline ADD VALUE IF NOT EXISTS 'refund_failed';

ALTER DOMAIN oncepay_webhook_event_type DROP CONSTRAINT oncepay_webhook_event_type_check;
ALTER DOMAIN oncepay_webhook_event_type ADD CONSTRAINT oncepay_webhook_event_type_check CHECK (VALUE IN (
    'payment.succeeded', 'payment.refunded', 'deposit.succeeded', 'transfer.succeeded',
    'top_up.succeeded', 'top_up.failed', 'top_up.refunded', 'top_up.refund_failed'));

ALTER TABLE top_ups
    ADD COLUMN processor_status text,
    ADD COLUMN next_check_at timestamptz,
    ADD COLUMN checks integer NOT NULL DEFAULT 0,
    ADD COLUMN create_key_series integer NOT NULL DEFAULT 0,
    ADD COLUMN confirm_key_series integer NOT NULL DEFAULT 0,
    ADD COLUMN cancel_key_series integer NOT NULL DEFAULT 0,
    ADD COLUMN refund_key_series integer NOT NULL DEFAULT 0,
    ADD COLUMN refund_status text,
    ADD COLUMN refund_failure_code text,
    ADD COLUMN refund_requested_at timestamptz;
COMMENT ON COLUMN top_ups.processor_status IS
    'the PaymentIntent''s status when a driver last looked (requires_action, requires_capture, processing while the top-up waits)';
COMMENT ON COLUMN top_ups.next_check_at IS
    'when the completer looks again at a top-up (or refund) that waits for the processor; NULL: once untouched for ONCEPAY_COMPLETER_AFTER_SECS';
COMMENT ON COLUMN top_ups.checks IS
    'looks at a waiting status so far (the interval to the next one grows with it)';
COMMENT ON COLUMN top_ups.create_key_series IS
    'the Idempotency-Key in use for creating the PaymentIntent: 0 is ...-create-intent, n is ...-create-intent-n (moved on after a saved 5xx)';
COMMENT ON COLUMN top_ups.refund_status IS
    'the processor''s refund status when last seen: pending, succeeded, failed, canceled';
COMMENT ON COLUMN top_ups.refund_failure_code IS
    'why the last refund failed (the refund''s failure_reason, or the processor''s error code); the amount was credited back';
COMMENT ON COLUMN top_ups.refund_requested_at IS
    'when the last refund debited the balance';
COMMENT ON COLUMN top_ups.processor IS
    'the processor the top-up was made with: its ONCEPAY_PROCESSOR_NAME (before V23: its URL)';

-- The driver renews its lease between calls (when what is left of it would not cover the
-- next call). Only the owner renews, and only an unfinished top-up or refund; the answer is
-- the row as it is now (the caller compares lease_owner with itself). The owner is the last
-- one that took the lease: equal owners mean nobody took it since, even if it had run out.
CREATE FUNCTION oncepay_top_up_renew(p_tenant uuid, p_top_up uuid, p_owner uuid, p_lease_secs integer)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET lease_expires_at = now() + make_interval(secs => p_lease_secs), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.lease_owner = p_owner
       AND (t.status = 'processing' OR t.refund_state = 'debited')
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

-- A key of `p_call` (create, confirm, cancel, refund) was answered with a saved 5xx and the
-- processor's state shows the call did not take effect: the series moves on, from `p_from`
-- (so that two drivers never skip a key), and the lease is renewed.
CREATE FUNCTION oncepay_top_up_next_key(p_tenant uuid, p_top_up uuid, p_owner uuid, p_call text,
                                        p_from integer, p_lease_secs integer)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
BEGIN
    IF p_call NOT IN ('create', 'confirm', 'cancel', 'refund') THEN
        RAISE EXCEPTION 'no key series for the call %', p_call;
    END IF;
    UPDATE top_ups t
       SET create_key_series = CASE WHEN p_call = 'create' THEN p_from + 1 ELSE t.create_key_series END,
           confirm_key_series = CASE WHEN p_call = 'confirm' THEN p_from + 1 ELSE t.confirm_key_series END,
           cancel_key_series = CASE WHEN p_call = 'cancel' THEN p_from + 1 ELSE t.cancel_key_series END,
           refund_key_series = CASE WHEN p_call = 'refund' THEN p_from + 1 ELSE t.refund_key_series END,
           lease_expires_at = now() + make_interval(secs => p_lease_secs), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.lease_owner = p_owner
       AND (t.status = 'processing' OR t.refund_state = 'debited')
       AND CASE p_call WHEN 'create' THEN t.create_key_series WHEN 'confirm' THEN t.confirm_key_series
                       WHEN 'cancel' THEN t.cancel_key_series ELSE t.refund_key_series END = p_from
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

-- The PaymentIntent waits (requires_action or requires_capture before the action timeout,
-- processing): its status and the next look are recorded, and the lease is given back.
CREATE FUNCTION oncepay_top_up_wait(p_tenant uuid, p_top_up uuid, p_owner uuid,
                                    p_processor_status text, p_next_check_secs integer)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET processor_status = p_processor_status, checks = t.checks + 1,
           next_check_at = now() + make_interval(secs => p_next_check_secs),
           lease_expires_at = now(), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

-- The refund is `pending` (or `requires_action`) at the processor: recorded the same way.
CREATE FUNCTION oncepay_top_up_refund_wait(p_tenant uuid, p_top_up uuid, p_owner uuid, p_refund text,
                                           p_refund_status text, p_next_check_secs integer)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET processor_refund_id = p_refund, refund_status = p_refund_status, checks = t.checks + 1,
           next_check_at = now() + make_interval(secs => p_next_check_secs),
           lease_expires_at = now(), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.refund_state = 'debited'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

-- Final: V22's oncepay_top_up_succeed for the lease's owner only.
CREATE FUNCTION oncepay_top_up_succeed(p_tenant uuid, p_top_up uuid, p_owner uuid, p_intent text)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
    v_balance bigint;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    SELECT t.* INTO r FROM top_ups t
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up FOR UPDATE;
    IF NOT FOUND OR r.status <> 'processing' OR r.lease_owner IS DISTINCT FROM p_owner THEN
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
           processor_status = 'succeeded', next_check_at = NULL,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up
    RETURNING t.* INTO r;
    RETURN r;
END
$$;

-- Final: the processor declined, refused the payment method or the request, or the
-- PaymentIntent ended canceled (by the action timeout, or by someone else). `p_failure` is
-- the top-up's failure_code (card_declined, invalid_payment_method, invalid_request,
-- authentication_required, capture_required, canceled), `p_decline` and `p_status` what its
-- key row stores and answers (a code of the contract: card_declined, invalid_payment_method,
-- invalid_request), `p_decline_code` the processor's own reason. For the lease's owner only.
CREATE FUNCTION oncepay_top_up_fail(p_tenant uuid, p_top_up uuid, p_owner uuid, p_failure text,
                                    p_decline text, p_status smallint, p_decline_code text,
                                    p_processor_status text)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    UPDATE top_ups t
       SET status = 'failed', recovery_point = 'finished', failure_code = p_failure,
           decline_code = p_decline_code,
           processor_status = coalesce(p_processor_status, t.processor_status), next_check_at = NULL,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
        RETURN r;
    END IF;
    IF r.idempotency_key IS NOT NULL THEN
        UPDATE idempotency_keys k
           SET status = p_status, error_code = p_decline::oncepay_decline
         WHERE k.tenant_id = p_tenant AND k.key = r.idempotency_key
           AND k.resource_id = p_top_up::text;
    END IF;
    RETURN r;
END
$$;

-- Final: the processor's refund succeeded. For the lease's owner only.
CREATE FUNCTION oncepay_top_up_refunded(p_tenant uuid, p_top_up uuid, p_owner uuid, p_refund text)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    UPDATE top_ups t
       SET status = 'refunded', refund_state = 'refunded', processor_refund_id = p_refund,
           refund_status = 'succeeded', next_check_at = NULL,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), refunded_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.refund_state = 'debited'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

-- V22's oncepay_top_up_refunded of the previous version's replicas, which take any refund
-- they list as done: a refund this version saw `pending` is left for it to finish.
CREATE OR REPLACE FUNCTION oncepay_top_up_refunded(p_tenant uuid, p_top_up uuid, p_refund text)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    UPDATE top_ups t
       SET status = 'refunded', refund_state = 'refunded', processor_refund_id = p_refund,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), refunded_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.refund_state = 'debited'
       AND t.refund_status IS DISTINCT FROM 'pending'
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

-- Final: the refund failed or was canceled at the processor, or the processor refused it for
-- good. The debited amount is credited back, the top-up is `succeeded` again (refundable with
-- a new request), the refund's key row becomes the stored failure `refund_failed`, and the
-- `top_up.refund_failed` event is written, all in this transaction. For the lease's owner only.
CREATE FUNCTION oncepay_top_up_refund_failed(p_tenant uuid, p_top_up uuid, p_owner uuid, p_refund text,
                                             p_refund_status text, p_failure_code text, p_status smallint)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
    v_balance bigint;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    SELECT t.* INTO r FROM top_ups t
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up FOR UPDATE;
    IF NOT FOUND OR r.refund_state IS DISTINCT FROM 'debited' OR r.lease_owner IS DISTINCT FROM p_owner THEN
        RETURN r;
    END IF;
    UPDATE accounts a SET balance = a.balance + r.amount
     WHERE a.tenant_id = p_tenant AND a.account_id = r.account_id
    RETURNING a.balance INTO v_balance;
    UPDATE top_ups t
       SET refund_state = NULL, balance_after_refund = NULL,
           processor_refund_id = coalesce(p_refund, t.processor_refund_id),
           refund_status = p_refund_status, refund_failure_code = p_failure_code, next_check_at = NULL,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up
    RETURNING t.* INTO r;
    IF r.refund_key IS NOT NULL THEN
        UPDATE idempotency_keys k
           SET status = p_status, error_code = 'refund_failed'::text::oncepay_decline
         WHERE k.tenant_id = p_tenant AND k.key = r.refund_key AND k.resource_id = p_top_up::text;
    END IF;
    PERFORM oncepay_emit_event(p_tenant, 'top_up.refund_failed', p_top_up::text,
                               oncepay_top_up_event_data(r));
    RETURN r;
END
$$;

-- V8's refund begin, same signature and answers; a new refund also starts the columns of
-- this migration afresh, and after a refund that failed it moves to the next key of the
-- refund series (a new refund must not meet the failed one's saved answer at the processor).
CREATE OR REPLACE FUNCTION oncepay_top_up_refund_begin(p_tenant uuid, p oncepay_claim_args, p_top_up uuid,
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
                       attempts = 1, updated_at = now(),
                       refund_requested_at = now(), refund_status = NULL, refund_failure_code = NULL,
                       processor_refund_id = NULL, checks = 0, next_check_at = NULL,
                       refund_key_series = CASE WHEN r.refund_key IS NULL THEN r.refund_key_series
                                                ELSE r.refund_key_series + 1 END
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

-- The completer: up to `p_limit` top-ups (or refunds) of one of `p_processors` that are due
-- (their next look has come, or, without one, they were left untouched for `p_after_secs`)
-- and whose lease is free or expired, leased to `p_owner`. Replicas running this at once skip
-- each other's rows (SKIP LOCKED) and then each other's leases.
CREATE FUNCTION oncepay_top_up_claim_due(p_owner uuid, p_after_secs integer, p_lease_secs integer,
                                         p_limit integer, p_processors text[])
RETURNS SETOF top_ups
LANGUAGE sql AS $$
    WITH due AS (
        SELECT t.tenant_id, t.top_up_id FROM top_ups t
         WHERE (t.status = 'processing' OR t.refund_state = 'debited')
           AND t.processor = ANY (p_processors)
           AND CASE WHEN t.next_check_at IS NULL
                    THEN t.updated_at <= now() - make_interval(secs => p_after_secs)
                    ELSE t.next_check_at <= now() END
           AND (t.lease_expires_at IS NULL OR t.lease_expires_at <= now())
         ORDER BY coalesce(t.next_check_at, t.updated_at)
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED)
    UPDATE top_ups t
       SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_secs),
           attempts = t.attempts + 1, updated_at = now()
      FROM due
     WHERE t.tenant_id = due.tenant_id AND t.top_up_id = due.top_up_id
    RETURNING t.*;
$$;

-- The top-up as GET /top-ups/{id} shows it (V10's, with the fields this migration adds to it):
-- a top-up whose refund waits for the processor is `refund_pending`.
CREATE OR REPLACE FUNCTION oncepay_top_up_event_data(r top_ups) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', r.top_up_id, 'account', r.account_id, 'amount', r.amount, 'currency', r.currency,
        'status', CASE WHEN r.refund_state = 'debited' THEN 'refund_pending' ELSE r.status::text END,
        'processor_payment_id', r.processor_payment_id, 'processor_status', r.processor_status,
        'failure_code', r.failure_code, 'decline_code', r.decline_code,
        'refund_failure_code', r.refund_failure_code, 'created_at', oncepay_json_time(r.created_at))
$$;
