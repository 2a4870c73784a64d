CREATE OR REPLACE FUNCTION public.oncepay_top_up_release(p_tenant uuid, p_top_up uuid, p_owner uuid)
 RETURNS void
 LANGUAGE sql
AS $function$
    UPDATE top_ups t SET lease_expires_at = now(), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.lease_owner = p_owner;
$function$


