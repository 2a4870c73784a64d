-- Operations: a view for on-call engineers reading key rows in psql, and autovacuum tuned
-- for the key table's churn (every row is inserted once and deleted by the purge a week
-- later, so dead tuples arrive in large batches).

ALTER TABLE idempotency_keys SET (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);

-- Retention in seconds as the purge sees it: ONCEPAY_RETENTION_SECS can't be read from
-- SQL, so the view uses the default unless a session says otherwise with
--   SET oncepay.retention_secs = '86400';
CREATE FUNCTION oncepay_retention() RETURNS interval
LANGUAGE sql STABLE AS $$
    SELECT make_interval(secs => coalesce(nullif(current_setting('oncepay.retention_secs', true), '')::int, 604800))
$$;

-- One row per committed key (in-flight keys are not visible until they commit: see the
-- README's operations section for pg_stat_activity).
CREATE VIEW idempotency_key_overview AS
SELECT k.tenant_id,
       t.name AS tenant_name,
       k.key,
       k.key LIKE 'fp:%' AS derived_key,
       k.method,
       k.path,
       k.status,
       k.resource_id,
       k.error_code,
       k.created_at,
       k.expires_at,
       date_trunc('second', now() - k.created_at) AS age,
       greatest(date_trunc('second', k.expires_at - now()), interval '0') AS replay_remaining,
       CASE
           WHEN k.expires_at > now() THEN 'live'
           WHEN k.created_at < now() - oncepay_retention() THEN 'due_for_purge'
           ELSE 'expired'
       END AS state
  FROM idempotency_keys k
  JOIN tenants t USING (tenant_id);
