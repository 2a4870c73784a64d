-- pgbench: a new payment, the very statement oncepay issues for POST /payments (src/ledger.rs,
-- `pay`; tests/api/bench_sql.rs fails if the two differ). One round trip, one transaction.
-- -D variables: tenant, derived, fp (a fingerprint, bytea hex), window, accounts, amount.
-- A random 63-bit key is new every time; `accounts=1` makes it the hot-account case.
\set key random(1, 9000000000000000000)
\set account random(0, :accounts - 1)
SELECT outcome AS "outcome!", error_code, payment_id, account_id, amount, balance_after, created_at
           FROM oncepay_pay(:tenant, :key, :derived, :fp, :window, :account, :amount);
