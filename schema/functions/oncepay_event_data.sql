CREATE OR REPLACE FUNCTION public.oncepay_event_data(ev webhook_events)
 RETURNS jsonb
 LANGUAGE plpgsql
 STABLE
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r payments;
BEGIN
    IF ev.data IS NOT NULL THEN
        RETURN ev.data;
    END IF;
    IF ev.event_type <> 'payment.succeeded' THEN
        RAISE EXCEPTION 'event % (%) has no data', ev.event_id, ev.event_type;
    END IF;
    SELECT p.* INTO STRICT r FROM payments p
     WHERE p.tenant_id = ev.tenant_id AND p.payment_id = ev.resource_id::uuid;
    r.refunded_at := NULL;
    r.balance_after_refund := NULL;
    RETURN oncepay_payment_event_data(r);
END
$function$


