-- Pre-fills idempotency_keys for the growth scenarios (psql -v): `rows` rows of tenant
-- `tenant`, random UUID keys (as clients send), created `age` ago. Inserted in key order so
-- the unique index is built by appending rather than by random page splits.
SET work_mem = '512MB';
INSERT INTO idempotency_keys AS i
    (tenant_id, key, fingerprint, operation, method, path, status, resource_id, created_at, expires_at)
SELECT :'tenant', k, sha256(convert_to(k, 'UTF8')), 'pay'::oncepay_operation, 'POST', '/payments', 201,
       gen_random_uuid()::text, now() - :'age'::interval, now() - :'age'::interval + interval '1 day'
  FROM (SELECT gen_random_uuid()::text AS k FROM generate_series(1, :rows)) AS g
 ORDER BY k;
