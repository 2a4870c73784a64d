-- A consistent ledger of :payments payments for timing `oncepay audit` (scripts/audit-bench.sh).
-- 10 tenants x 1000 accounts; 90% of payments keyed (with their key rows), 10% keyless (policy
-- allow), 5% refunded (with the refund's key row), one keyed deposit per 10 payments. Balances
-- are set from the effects at the end, so a correct audit reports it clean.
\set ON_ERROR_STOP on
BEGIN;
INSERT INTO tenants (tenant_id, name, api_key_hash, missing_key_policy)
SELECT ('00000000-0000-4000-8000-' || lpad(t::text, 12, '0'))::uuid, 'bench-' || t,
       sha256(('bench-' || t)::bytea), 'allow'
  FROM generate_series(1, 10) t;

INSERT INTO accounts (tenant_id, account_id, balance, opening_balance, created_at)
SELECT tenant_id, 'acct-' || a, 0, 1000000000, now() - interval '2 days'
  FROM tenants, generate_series(1, 1000) a;

-- Payments spread over the last day; every 10th is keyless.
INSERT INTO payments (tenant_id, payment_id, account_id, amount, balance_after, idempotency_key,
                      created_at, refunded_at, balance_after_refund)
SELECT ('00000000-0000-4000-8000-' || lpad((1 + i % 10)::text, 12, '0'))::uuid,
       gen_random_uuid(), 'acct-' || (1 + (i / 10) % 1000), 1 + (i * 7919) % 5000, 0,
       CASE WHEN i % 10 <> 0 THEN 'k-' || i END,
       now() - make_interval(secs => (i % 86400)::float8 + (i / 86400) * 0.001),
       CASE WHEN i % 20 = 1 THEN now() - make_interval(secs => (i % 86400)::float8 / 2) END,
       CASE WHEN i % 20 = 1 THEN 0 END
  FROM generate_series(1::bigint, :payments) i;

INSERT INTO deposits (tenant_id, deposit_id, account_id, amount, balance_after, idempotency_key, created_at)
SELECT ('00000000-0000-4000-8000-' || lpad((1 + i % 10)::text, 12, '0'))::uuid,
       gen_random_uuid(), 'acct-' || (1 + (i / 10) % 1000), 1 + (i * 104729) % 9000, 0,
       'd-' || i, now() - make_interval(secs => (i % 86400)::float8)
  FROM generate_series(1::bigint, :payments / 10) i;

INSERT INTO idempotency_keys (tenant_id, key, fingerprint, operation, method, path, status, resource_id, created_at, expires_at)
SELECT tenant_id, idempotency_key, sha256(idempotency_key::bytea), 'pay'::oncepay_operation, 'POST', '/payments', 201,
       payment_id::text, created_at, created_at + interval '1 day'
  FROM payments WHERE idempotency_key IS NOT NULL
UNION ALL
SELECT tenant_id, 'r-' || payment_id, sha256(payment_id::text::bytea), 'refund'::oncepay_operation, 'POST',
       '/payments/' || payment_id || '/refund', 200, payment_id::text, refunded_at,
       refunded_at + interval '1 day'
  FROM payments WHERE refunded_at IS NOT NULL
UNION ALL
SELECT tenant_id, idempotency_key, sha256(idempotency_key::bytea), 'deposit'::oncepay_operation, 'POST',
       '/accounts/' || account_id || '/deposits', 201, deposit_id::text, created_at,
       created_at + interval '1 day'
  FROM deposits;

UPDATE accounts a
   SET balance = x.expected
  FROM (SELECT a.tenant_id, a.account_id,
               a.opening_balance + coalesce(d.deposited, 0) - coalesce(p.paid, 0) + coalesce(p.refunded, 0) AS expected
          FROM accounts a
          LEFT JOIN (SELECT tenant_id, account_id, sum(amount) AS paid,
                            sum(amount) FILTER (WHERE refunded_at IS NOT NULL) AS refunded
                       FROM payments GROUP BY 1, 2) p USING (tenant_id, account_id)
          LEFT JOIN (SELECT tenant_id, account_id, sum(amount) AS deposited
                       FROM deposits GROUP BY 1, 2) d USING (tenant_id, account_id)) x
 WHERE a.tenant_id = x.tenant_id AND a.account_id = x.account_id;
COMMIT;
VACUUM ANALYZE;
