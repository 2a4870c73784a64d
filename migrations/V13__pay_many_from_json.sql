-- A batch of payments from one JSON argument, for a transaction-mode pooler (issue 21).
--
-- Through PgBouncer in transaction mode a batch of payments is sent as one simple-protocol
-- message (src/db/conn.rs, `Conn::fetch_rendered`): one round trip instead of the four sqlx
-- makes there. The simple protocol has no prepared statements, so the statement is parsed and
-- planned on every call, and the batch's own statement (a lateral join of
-- jsonb_array_elements and oncepay_pay, aggregated into one JSON answer) took 0.4 ms to plan
-- (PostgreSQL 15, `EXPLAIN (SUMMARY)`, four items): measured in `make bench-ha` as 0.06 to
-- 0.09 ms more of the primary's CPU per pooled payment than direct, at 3.7 payments per
-- statement. Inside a plpgsql function the same query is planned once per server connection
-- and its plan cached; the message then only calls the function (0.017 ms to plan).
--
-- The items and the answers are those of `Pay::run_batch_rendered` (src/ledger/effects.rs):
-- [{"tenant", "claim": <oncepay_claim_args as JSON>, "account", "amount"}] in, and
-- [{"outcome", "decline", "expires_at", "resource"}] out, in the items' order, each item the
-- same oncepay_pay call as the binary path's, seeing what the earlier ones wrote.

CREATE FUNCTION oncepay_pay_many(p_items jsonb)
RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    RETURN (
        SELECT jsonb_agg(jsonb_build_object('outcome', p.outcome, 'decline', p.decline,
                                            'expires_at', p.expires_at, 'resource', p.resource)
                         ORDER BY item.n)
          FROM jsonb_array_elements(p_items) WITH ORDINALITY AS item(i, n)
         CROSS JOIN LATERAL oncepay_pay((item.i->>'tenant')::uuid,
                                        jsonb_populate_record(NULL::oncepay_claim_args, item.i->'claim'),
                                        item.i->>'account', (item.i->>'amount')::bigint) AS p);
END
$$;
