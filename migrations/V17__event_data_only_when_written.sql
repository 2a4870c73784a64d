-- A payment builds its event's data only when it writes the event, and builds it without
-- planning a query.
--
-- oncepay_json_time was declared IMMUTABLE over to_char, which is STABLE (it reads the
-- session's locale settings). PostgreSQL inlines a SQL function into its caller only when the
-- body is no more volatile than the declaration, so every call ran as a function of its own:
-- its body parsed, analysed and planned again, since a PL/pgSQL expression's function cache
-- lasts one transaction. And oncepay_pay evaluated oncepay_payment_event_data (two such calls)
-- as an argument of oncepay_emit_event, before that function looked for an endpoint: every
-- payment paid for an event's data, written or not.
--
-- Measured with callgrind (2026-12-03, /work notes: 3,000 payments through oncepay_pay in a
-- single-user backend, instructions per payment, the statement's own parsing included):
--   V16:  no endpoint 961,000; one endpoint 1,041,000 (the data's SQL functions: 163,000)
--   V17:  no endpoint 746,000; one endpoint   867,000
-- The other operations (refunds, deposits, transfers, top-ups) keep calling
-- oncepay_emit_event with their data built first; declared STABLE, oncepay_json_time is
-- inlined there too, which takes the re-planning out of their cost.
--
-- tests/api/webhooks.rs a_payment_runs_no_sql_function_that_is_planned_again_each_transaction
-- fails on V16 (oncepay_json_time is called, twice).

ALTER FUNCTION oncepay_json_time(timestamptz) STABLE;

-- V9's oncepay_pay, same signature (replicas of the previous version keep calling it), with
-- oncepay_emit_event's check and insert written out in the created branch: the data is built
-- only after the check, and the fast path saves two PL/pgSQL calls (a helper function for
-- either costs 12,000 to 32,000 instructions a payment, measured as above). Keep the check
-- and the insert the same as oncepay_emit_event's (V14).
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
                        oncepay_payment_event_data(resource), now(), true);
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
