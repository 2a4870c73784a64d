CREATE OR REPLACE FUNCTION public.oncepay_webhook_disable(p_tenant uuid, p_endpoint uuid, p_reason text)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF p_reason = 'deleted' THEN
        UPDATE webhook_endpoints e SET deleted_at = now()
         WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint AND e.deleted_at IS NULL;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        UPDATE webhook_deliveries d SET state = 'cancelled', finished_at = now(), leased_until = NULL
         WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'pending';
        UPDATE webhook_deliveries d SET state = 'cancelled', finished_at = now()
         WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'held';
        RETURN true;
    END IF;
    UPDATE webhook_endpoints e SET disabled_at = now(), disabled_reason = p_reason
     WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint
       AND e.disabled_at IS NULL AND e.deleted_at IS NULL;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE webhook_deliveries d SET state = 'held', finished_at = now(), leased_until = NULL
     WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'pending';
    RETURN true;
END
$function$


