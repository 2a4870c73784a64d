CREATE OR REPLACE FUNCTION public.oncepay_emit_event(p_tenant uuid, p_type oncepay_webhook_event_type, p_resource_id text, p_data jsonb)
 RETURNS uuid
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    v_event uuid;
BEGIN
    IF NOT EXISTS (SELECT FROM webhook_endpoints e
                    WHERE e.tenant_id = p_tenant AND e.deleted_at IS NULL
                      AND (e.event_types IS NULL OR p_type = ANY (e.event_types))) THEN
        RETURN NULL;
    END IF;
    v_event := gen_random_uuid();
    INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at, awaiting_fan_out)
    VALUES (p_tenant, v_event, p_type, p_resource_id, p_data, now(), true);
    RETURN v_event;
END
$function$


