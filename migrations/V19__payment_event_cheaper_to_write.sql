-- The outbox costs a payment less: its event takes the payment's id and time, and the events
-- table has one partial index where it had two.
--
-- Measured with make sql-callgrind (2026-12-03, base 21e3ba3, PostgreSQL's instructions per
-- new payment of a tenant with one endpoint; without an endpoint unchanged, 608,000-610,000):
-- 676,900 -> 661,700, the outbox's own cost 68,200 -> 51,900, new / hooked 0.899 -> 0.922.
--
-- The id. A payment succeeds once, so "the payment.succeeded event of payment X" names one
-- event, and its id can be X's: unique within the tenant like the payment's (every other
-- event's id is still drawn by gen_random_uuid; two draws of 122 random bits do not meet).
-- The payment's transaction no longer draws one for its event: gen_random_uuid reads
-- OpenSSL's RAND_bytes, 8,600 instructions. The id is still the same webhook-id on every
-- attempt and GET /events/{id} finds it as before; events written before keep theirs.
-- The time: the payment row's created_at, which is now() as before, read from the row instead
-- of called again.
--
-- One index for the fan-out and the purge instead of two: each index on the table costs every
-- event's insert its opening, its lock and its predicate (4,200 instructions for the purge's
-- index, which an event never enters when it is written). The fan-out's scan (awaiting, in
-- sequence order) and the purge's (fanned out to no endpoint: rare, kept for the retention)
-- both read it; the fan-out crosses the few of the purge's, the purge the awaiting backlog.
-- The purge names the predicate (src/purge.rs); the previous version's purge query does not,
-- so while a replica of it runs the purge, that batch reads the table sequentially (slower,
-- still correct: docs/operations.md).
CREATE INDEX webhook_events_fan_out_idx ON webhook_events (sequence) WHERE awaiting_fan_out IS NOT NULL;
DROP INDEX webhook_events_awaiting_idx;
DROP INDEX webhook_events_unsent_idx;

-- V18's oncepay_pay, same signature, the event's id and time the payment's.
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
                VALUES (p_tenant, resource.payment_id, 'payment.succeeded', c.resource_id,
                        NULL, resource.created_at, true);
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
