CREATE OR REPLACE FUNCTION public.oncepay_top_up_wait(p_tenant uuid, p_top_up uuid, p_owner uuid, p_processor_status text, p_next_check_secs integer)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET processor_status = p_processor_status, checks = t.checks + 1,
           next_check_at = now() + make_interval(secs => p_next_check_secs),
           lease_expires_at = now(), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$function$


CREATE OR REPLACE FUNCTION public.oncepay_top_up_wait(p_tenant uuid, p_top_up uuid, p_owner uuid, p_processor_status text, p_next_check_secs integer, p_counted boolean)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET processor_status = p_processor_status, checks = t.checks + p_counted::integer,
           next_check_at = CASE
               WHEN p_counted OR t.next_check_at IS NULL THEN now() + make_interval(secs => p_next_check_secs)
               ELSE least(t.next_check_at, now() + make_interval(secs => p_next_check_secs))
           END,
           lease_expires_at = now(), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$function$


