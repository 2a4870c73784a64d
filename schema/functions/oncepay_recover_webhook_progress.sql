CREATE OR REPLACE FUNCTION public.oncepay_recover_webhook_progress(p_tenant uuid, p_key text, p_fingerprint bytea, p_changed integer)
 RETURNS void
 LANGUAGE sql
AS $function$
    INSERT INTO webhook_recovery_progress AS g (tenant_id, idempotency_key, fingerprint, deliveries, updated_at)
    SELECT p_tenant, p_key, p_fingerprint, p_changed, now()
     WHERE p_key IS NOT NULL AND p_fingerprint IS NOT NULL AND p_changed > 0
    ON CONFLICT (tenant_id, idempotency_key, fingerprint)
    DO UPDATE SET deliveries = g.deliveries + EXCLUDED.deliveries, updated_at = EXCLUDED.updated_at
$function$


