CREATE OR REPLACE FUNCTION public.oncepay_resend_webhook_event(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid, p_event uuid)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource uuid)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_event::text);
    ep webhook_endpoints;
    d webhook_deliveries;
    ev webhook_events;
BEGIN
    IF c.outcome = 'created' THEN
        SELECT e.* INTO ep FROM webhook_endpoints e
         WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint AND e.deleted_at IS NULL
           FOR SHARE;
        IF FOUND THEN
            SELECT w.* INTO d FROM webhook_deliveries w
             WHERE w.tenant_id = p_tenant AND w.event_id = p_event AND w.endpoint_id = p_endpoint
               FOR UPDATE NOWAIT;
            IF FOUND THEN
                IF d.state IN ('delivered', 'given_up', 'cancelled') THEN
                    UPDATE webhook_deliveries w
                       SET state = CASE WHEN ep.disabled_at IS NULL THEN 'pending' ELSE 'held' END,
                           finished_at = CASE WHEN ep.disabled_at IS NULL THEN NULL ELSE now() END,
                           next_attempt_at = now(), leased_until = NULL, schedule_start = w.attempts
                     WHERE w.tenant_id = p_tenant AND w.event_id = p_event AND w.endpoint_id = p_endpoint;
                ELSIF d.state = 'pending' AND (d.leased_until IS NULL OR d.leased_until <= now()) THEN
                    UPDATE webhook_deliveries w SET next_attempt_at = now(), schedule_start = w.attempts
                     WHERE w.tenant_id = p_tenant AND w.event_id = p_event AND w.endpoint_id = p_endpoint;
                    PERFORM oncepay_webhook_due_behind(p_tenant, p_endpoint, ARRAY[d.resource_id],
                                                       ARRAY[d.sequence], now());
                ELSIF d.state = 'pending' THEN
                    RAISE EXCEPTION 'an attempt of this event to this endpoint is out; resend once it is settled'
                        USING ERRCODE = 'lock_not_available';
                END IF;
            ELSE
                SELECT e.* INTO ev FROM webhook_events e WHERE e.tenant_id = p_tenant AND e.event_id = p_event;
                IF NOT (FOUND AND ev.awaiting_fan_out IS TRUE
                        AND (ep.created_sequence IS NULL OR ep.created_sequence < ev.sequence)
                        AND (ep.event_types IS NULL OR ev.event_type = ANY (ep.event_types))) THEN
                    c := oncepay_decline(p_tenant, p, 'not_found');
                END IF;
            END IF;
        ELSE
            c := oncepay_decline(p_tenant, p, 'not_found');
        END IF;
        IF c.outcome = 'created' THEN
            resource := p_event;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        resource := c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


