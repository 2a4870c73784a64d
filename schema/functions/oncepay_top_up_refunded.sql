CREATE OR REPLACE FUNCTION public.oncepay_top_up_refunded(p_tenant uuid, p_top_up uuid, p_owner uuid, p_refund text)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    UPDATE top_ups t
       SET status = 'refunded', refund_state = 'refunded', processor_refund_id = p_refund,
           refund_status = 'succeeded', next_check_at = NULL,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), refunded_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.refund_state = 'debited'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$function$


CREATE OR REPLACE FUNCTION public.oncepay_top_up_refunded(p_tenant uuid, p_top_up uuid, p_refund text)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    UPDATE top_ups t
       SET status = 'refunded', refund_state = 'refunded', processor_refund_id = p_refund,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), refunded_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.refund_state = 'debited'
       AND t.refund_status IS DISTINCT FROM 'pending'
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$function$


