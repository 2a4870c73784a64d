-- pgbench: a replay, the same statement as pay.sql with a key that committed earlier (the
-- seeded keys 1000000000 + 0..replay_keys-1, all `{"amount":1,"account":"0"}`): the function's
-- INSERT ... ON CONFLICT DO NOTHING finds the row, then it reads the payment.
-- -D variables: tenant, derived, fp (the seeded keys' fingerprint), window, replay_keys,
-- account, amount.
\set key 1000000000 + random(0, :replay_keys - 1)
SELECT outcome AS "outcome!", error_code, payment_id, account_id, amount, balance_after, created_at
           FROM oncepay_pay(:tenant, :key, :derived, :fp, :window, :account, :amount);
