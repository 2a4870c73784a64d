CREATE OR REPLACE FUNCTION public.oncepay_top_up_renew(p_tenant uuid, p_top_up uuid, p_owner uuid, p_lease_secs integer)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET lease_expires_at = now() + make_interval(secs => p_lease_secs), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.lease_owner = p_owner
       AND (t.status = 'processing' OR t.refund_state = 'debited')
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$function$


