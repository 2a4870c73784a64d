CREATE OR REPLACE FUNCTION public.oncepay_top_up_next_key(p_tenant uuid, p_top_up uuid, p_owner uuid, p_call text, p_from integer, p_lease_secs integer)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
BEGIN
    IF p_call NOT IN ('create', 'confirm', 'cancel', 'refund') THEN
        RAISE EXCEPTION 'no key series for the call %', p_call;
    END IF;
    UPDATE top_ups t
       SET create_key_series = CASE WHEN p_call = 'create' THEN p_from + 1 ELSE t.create_key_series END,
           confirm_key_series = CASE WHEN p_call = 'confirm' THEN p_from + 1 ELSE t.confirm_key_series END,
           cancel_key_series = CASE WHEN p_call = 'cancel' THEN p_from + 1 ELSE t.cancel_key_series END,
           refund_key_series = CASE WHEN p_call = 'refund' THEN p_from + 1 ELSE t.refund_key_series END,
           lease_expires_at = now() + make_interval(secs => p_lease_secs), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.lease_owner = p_owner
       AND (t.status = 'processing' OR t.refund_state = 'debited')
       AND CASE p_call WHEN 'create' THEN t.create_key_series WHEN 'confirm' THEN t.confirm_key_series
                       WHEN 'cancel' THEN t.cancel_key_series ELSE t.refund_key_series END = p_from
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$function$


