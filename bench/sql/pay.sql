-- pgbench: a new payment, the very statement oncepay issues for POST /payments (src/ledger/effects.rs,
-- `Pay`; tests/api/bench_sql.rs fails if the two differ; the claim arguments, which the service
-- binds as one binary composite, are spelled out as a ROW here). One round trip, one transaction.
-- -D variables: tenant, derived, fp (a fingerprint, bytea hex), window, accounts, amount.
-- A random 63-bit key is new every time; `accounts=1` makes it the hot-account case.
\set key random(1, 9000000000000000000)
\set account random(0, :accounts - 1)
SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at, resource AS "resource: PaymentRow"
  FROM oncepay_pay(:tenant, ROW(:key, :derived, :fp, 'pay', 'POST', '/payments', :window, 5000, 201, '{"insufficient_funds": 402, "account_not_found": 404}')::oncepay_claim_args, :account, :amount);
