CREATE OR REPLACE FUNCTION public.oncepay_top_up_emit_event()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM oncepay_emit_event(NEW.tenant_id,
                               ('top_up.' || NEW.status)::oncepay_webhook_event_type,
                               NEW.top_up_id::text, oncepay_top_up_event_data(NEW));
    RETURN NULL;
END
$function$


