-- A batch of payments writes its payments' events in one INSERT after the payments, in a
-- statement planned once per connection.
--
-- After V19 the outbox still cost a batched payment of a tenant with an endpoint 72,000
-- PostgreSQL instructions more than one without (702,000 against 630,000 a payment in batches
-- of eight, callgrind on a single-user backend, /work notes of 2026-12-03), 17-18 us of
-- PostgreSQL's CPU in make bench, where a payment without costs 95: 0.88 of the payments per
-- second, short of issue 20's 0.9. Most of it was the statement, not the row: oncepay_pay ran
-- its endpoint check and its INSERT as statements of their own, started and ended (relation
-- and indexes opened and locked) once per payment. And the batch's statement itself
-- (src/ledger/effects.rs, `Pay::run_batch`) was planned again at every batch: its
-- generate_series(1, cardinality($1)) is estimated from the array when planned for the
-- values (8 rows) and at 1,000 rows generically, so the plan cache never found the generic
-- plan cheaper; 20,000 instructions a payment, endpoint or not.
--
-- Now:
-- - oncepay_pay_in_batch is oncepay_pay (V19) without the event, declared ROWS 1;
-- - oncepay_pay_batch(tenants, claims, accounts, amounts) calls it per item and, in the same
--   statement, writes the payment.succeeded event of each payment it created whose tenant has
--   an enabled endpoint subscribed to it: the same row oncepay_pay writes (V19: the payment's
--   id and time, no data), in the payments' transaction, so the outbox's promise is unchanged
--   (a declined item, a replay or a refused key writes none). Its statement is planned once
--   per connection (plan_cache_mode = force_generic_plan for the function). And never
--   JIT-compiled (jit = off; ROWS 1 keeps the generic plan's cost low too): estimated at the
--   default 1,000 rows a call, a generic plan crossed jit_above_cost and was compiled at every
--   call, measured at 2.4 million instructions a payment;
-- - the binary batch statement and oncepay_pay_many (a transaction-mode pooler's) call it.
-- Measured as above, batches of eight: without an endpoint 630,000 -> 610,000 instructions a
-- payment; with one 702,000 -> 655,000; without / with 0.897 -> 0.932.
--
-- oncepay_pay keeps its event (a payment alone, and replicas of the previous version, whose
-- batch statement calls it). Call oncepay_pay_in_batch only through oncepay_pay_batch.

-- oncepay_pay (V19) without the event. Its body repeats oncepay_pay's: a later change to
-- either changes both (one calling the other would cost each lone payment a PL/pgSQL call,
-- 12,000 to 32,000 instructions, V17).
CREATE FUNCTION oncepay_pay_in_batch(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql ROWS 1 AS $$
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


CREATE FUNCTION oncepay_pay_batch(p_tenants uuid[], p_claims oncepay_claim_args[], p_accounts text[],
                                  p_amounts bigint[])
RETURNS TABLE (item int, outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET jit = off AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH paid AS (
        SELECT i.item, p.outcome, p.decline, p.expires_at, p.resource
          FROM generate_series(1, cardinality(p_tenants)) AS i(item)
         CROSS JOIN LATERAL oncepay_pay_in_batch(p_tenants[i.item], p_claims[i.item], p_accounts[i.item],
                                                 p_amounts[i.item]) AS p),
    events AS (
        INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at,
                                    awaiting_fan_out)
        SELECT (paid.resource).tenant_id, (paid.resource).payment_id, 'payment.succeeded',
               (paid.resource).payment_id::text, NULL, (paid.resource).created_at, true
          FROM paid
         WHERE paid.outcome = 'created' AND (paid.resource).payment_id IS NOT NULL
           AND EXISTS (SELECT FROM webhook_endpoints e
                        WHERE e.tenant_id = (paid.resource).tenant_id AND e.disabled_at IS NULL
                          AND e.deleted_at IS NULL
                          AND (e.event_types IS NULL OR 'payment.succeeded' = ANY (e.event_types)))
         ORDER BY paid.item)
    SELECT paid.item, paid.outcome, paid.decline, paid.expires_at, paid.resource
      FROM paid
     ORDER BY paid.item;
END
$$;

-- V13's batch for a transaction-mode pooler, same signature, through oncepay_pay_batch.
CREATE OR REPLACE FUNCTION oncepay_pay_many(p_items jsonb)
RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (
        SELECT jsonb_agg(jsonb_build_object('outcome', b.outcome, 'decline', b.decline,
                                            'expires_at', b.expires_at, 'resource', b.resource)
                         ORDER BY b.item)
          FROM oncepay_pay_batch(
                   ARRAY(SELECT (x.i->>'tenant')::uuid FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(i, n) ORDER BY x.n),
                   ARRAY(SELECT jsonb_populate_record(NULL::oncepay_claim_args, x.i->'claim')
                           FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(i, n) ORDER BY x.n),
                   ARRAY(SELECT x.i->>'account' FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(i, n) ORDER BY x.n),
                   ARRAY(SELECT (x.i->>'amount')::bigint FROM jsonb_array_elements(p_items) WITH ORDINALITY AS x(i, n) ORDER BY x.n)
               ) AS b);
END
$$;
