-- A payment's event is written without its data: the data is rendered from the payment row
-- when the event is read (delivered, or answered by GET /events/{id}).
--
-- After V17, the event a payment writes still cost its transaction the data: a jsonb object
-- of six keys built and written (170 of the event's 530 bytes of WAL). At c=32 the payments
-- wait mostly for the WAL to be written (pg_stat_activity: WALWrite), so bytes count as much
-- as instructions. Measured 2026-12-03: callgrind (V17's header) one endpoint 867,000 -> 822,000
-- instructions a payment (none: 746,000 both); pgbench on oncepay_pay at c=32, one endpoint
-- over none, V17 and V18 databases alternated, 3 rounds: 0.89, 0.79, 0.83 -> 0.92, 0.90, 0.90,
-- WAL a payment with one endpoint 1,450 -> 1,275 bytes (none: 920).
--
-- A payment row never changes again except for its refund columns (V1), so its
-- payment.succeeded data, rendered with those columns as they were when it was created
-- (unrefunded), is the same JSON, every time, as the one written until now: the event is
-- still the payment as it was when it succeeded, whatever happened to it since. Only
-- payment.succeeded is written this way; the other events keep their data, written in their
-- change's transaction. Payments are never deleted.
--
-- Replicas of the previous version: their deliverers call the claim below (by its old name)
-- and get the data rendered. Their GET /events/{id} reads the column itself and answers 500
-- for a payment's event written by this version, until they are replaced: a rollout of
-- minutes, an endpoint the merchant reads to look, not to deliver (docs/operations.md: the
-- one exception so far to "expand only what the running version does not notice").

-- No CHECK says that only payment.succeeded goes without data: a CHECK costs each insert
-- 25,000 instructions (its expression read back from its stored text at every statement,
-- callgrind as above), more than half of the 45,000 that leaving the data out saves.
-- oncepay_event_data refuses any other type instead.
ALTER TABLE webhook_events ALTER COLUMN data DROP NOT NULL;
COMMENT ON COLUMN webhook_events.data IS
    'the event''s data; NULL for payment.succeeded written since V18: rendered by oncepay_event_data';

-- The data of an event: its own, or, for a payment.succeeded written without it, the payment
-- as it was created (unrefunded), in oncepay_payment_event_data's shape. PL/pgSQL, so that
-- its plan is kept for the session (a SQL function with a subquery is planned again at every
-- query that calls it: V17).
CREATE FUNCTION oncepay_event_data(ev webhook_events) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r payments;
BEGIN
    IF ev.data IS NOT NULL THEN
        RETURN ev.data;
    END IF;
    IF ev.event_type <> 'payment.succeeded' THEN
        RAISE EXCEPTION 'event % (%) has no data', ev.event_id, ev.event_type;
    END IF;
    SELECT p.* INTO STRICT r FROM payments p
     WHERE p.tenant_id = ev.tenant_id AND p.payment_id = ev.resource_id::uuid;
    r.refunded_at := NULL;
    r.balance_after_refund := NULL;
    RETURN oncepay_payment_event_data(r);
END
$$;

-- The claim, V16's renamed (its body unchanged), with the data rendered where the event has
-- none. The three- and four-argument claims call it by this name.
ALTER FUNCTION oncepay_webhook_claim_fanned_out(int, int, int) RENAME TO oncepay_webhook_claim_stored_data;

CREATE FUNCTION oncepay_webhook_claim_fanned_out(p_limit int, p_per_endpoint int, p_lease_ms int)
RETURNS TABLE (tenant_id uuid, event_id uuid, endpoint_id uuid, attempt int, url text,
               secret_encrypted bytea, previous_secret_encrypted bytea, event_type text,
               data jsonb, created_at timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT c.tenant_id, c.event_id, c.endpoint_id, c.attempt, c.url, c.secret_encrypted,
           c.previous_secret_encrypted, c.event_type,
           coalesce(c.data, (SELECT oncepay_event_data(ev) FROM webhook_events ev
                              WHERE ev.tenant_id = c.tenant_id AND ev.event_id = c.event_id)),
           c.created_at
      FROM oncepay_webhook_claim_stored_data(p_limit, p_per_endpoint, p_lease_ms) c;
END
$$;

-- V17's oncepay_pay, same signature, its event written without data.
CREATE OR REPLACE FUNCTION oncepay_pay(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint)
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
            IF EXISTS (SELECT FROM webhook_endpoints e
                        WHERE e.tenant_id = p_tenant AND e.disabled_at IS NULL AND e.deleted_at IS NULL
                          AND (e.event_types IS NULL OR 'payment.succeeded' = ANY (e.event_types))) THEN
                INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at,
                                            awaiting_fan_out)
                VALUES (p_tenant, gen_random_uuid(), 'payment.succeeded', c.resource_id,
                        NULL, now(), true);
            END IF;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM payments r
         WHERE r.tenant_id = p_tenant AND r.payment_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;
