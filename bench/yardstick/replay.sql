-- pgbench: a replay's database work at its least, the finished key row read by its primary key
-- (one of replay-1 .. replay-:replay_keys, which schema.sql made).
\set n random(1, :replay_keys)
SELECT status, resource_id, error_code, fingerprint, expires_at FROM idempotency_keys WHERE tenant_id = 1 AND key = 'replay-' || :n::text;
