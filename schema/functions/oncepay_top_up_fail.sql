CREATE OR REPLACE FUNCTION public.oncepay_top_up_fail(p_tenant uuid, p_top_up uuid, p_failure text, p_decline_code text, p_status smallint)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    UPDATE top_ups t
       SET status = 'failed', recovery_point = 'finished', failure_code = p_failure,
           decline_code = p_decline_code, lease_owner = NULL, lease_expires_at = NULL,
           updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
        RETURN r;
    END IF;
    IF r.idempotency_key IS NOT NULL THEN
        UPDATE idempotency_keys k
           SET status = p_status, error_code = p_failure::oncepay_decline
         WHERE k.tenant_id = p_tenant AND k.key = r.idempotency_key
           AND k.resource_id = p_top_up::text;
    END IF;
    RETURN r;
END
$function$


CREATE OR REPLACE FUNCTION public.oncepay_top_up_fail(p_tenant uuid, p_top_up uuid, p_owner uuid, p_failure text, p_decline text, p_status smallint, p_decline_code text, p_processor_status text)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    UPDATE top_ups t
       SET status = 'failed', recovery_point = 'finished', failure_code = p_failure,
           decline_code = p_decline_code,
           processor_status = coalesce(p_processor_status, t.processor_status), next_check_at = NULL,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
        RETURN r;
    END IF;
    IF r.idempotency_key IS NOT NULL THEN
        UPDATE idempotency_keys k
           SET status = p_status, error_code = p_decline::oncepay_decline
         WHERE k.tenant_id = p_tenant AND k.key = r.idempotency_key
           AND k.resource_id = p_top_up::text;
    END IF;
    RETURN r;
END
$function$


