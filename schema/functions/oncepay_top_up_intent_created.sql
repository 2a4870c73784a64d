CREATE OR REPLACE FUNCTION public.oncepay_top_up_intent_created(p_tenant uuid, p_top_up uuid, p_owner uuid, p_intent text)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET processor_payment_id = p_intent, recovery_point = 'intent_created', updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
       AND t.recovery_point = 'started' AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$function$


