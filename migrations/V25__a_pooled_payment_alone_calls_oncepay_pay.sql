-- A payment alone through a transaction-mode pooler costs what it costs without one again.
--
-- Through a pooler every payment, alone too, reaches PostgreSQL as
-- `SELECT oncepay_pay_many('<json>')` (src/ledger/effects.rs, `run_batch_rendered`). Since
-- V20 that function passes its items to oncepay_pay_batch, whose statement, built for many
-- items, costs a batch of one more than the payment itself: four arrays rebuilt from the
-- JSON, the events' INSERT planned and opened even when it writes nothing, the generic plan
-- for a thousand rows, and since V22 the tenants' events locks taken by a statement of their
-- own. Measured with make sql-callgrind's pooled-replay (a replay, one item a statement):
-- 502,000 instructions with V13's function, 704,000 after V20, 738,000 after V22, against
-- 244,000 for the same replay sent directly. make bench-ha read replays through PgBouncer at
-- 0.45 of direct where V13 read 0.76-0.91 (issue 37).
--
-- Now a single item calls oncepay_pay, as a payment alone does without a pooler: the same
-- claim, effect and event in the same transaction, with or without a pooler. Several items
-- still go through oncepay_pay_batch (one statement, one commit for all). Same signature:
-- replicas of the previous version call it unchanged.
CREATE OR REPLACE FUNCTION oncepay_pay_many(p_items jsonb)
RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    x jsonb;
    r record;
BEGIN
    IF jsonb_array_length(p_items) = 1 THEN
        x := p_items -> 0;
        SELECT p.outcome, p.decline, p.expires_at, p.resource INTO r
          FROM oncepay_pay((x ->> 'tenant')::uuid, jsonb_populate_record(NULL::oncepay_claim_args, x -> 'claim'),
                           x ->> 'account', (x ->> 'amount')::bigint) AS p;
        RETURN jsonb_build_array(jsonb_build_object('outcome', r.outcome, 'decline', r.decline,
                                                    'expires_at', r.expires_at, 'resource', r.resource));
    END IF;
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
