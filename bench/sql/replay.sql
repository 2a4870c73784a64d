-- pgbench: a replay, the same statement as pay.sql with a key that committed earlier (the
-- seeded keys 1000000000 + 0..replay_keys-1, all `{"amount":1,"account":"0"}`): the function's
-- claim reads the key row (no write attempt), then it reads the payment.
-- -D variables: tenant, derived, fp (the seeded keys' fingerprint), window, replay_keys,
-- account, amount.
\set key 1000000000 + random(0, :replay_keys - 1)
SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at, resource AS "resource: PaymentRow"
  FROM oncepay_pay(:tenant, ROW(:key, :derived, :fp, 'pay', 'POST', '/payments', :window, 5000, 201, '{"insufficient_funds": 402, "account_not_found": 404}')::oncepay_claim_args, :account, :amount);
