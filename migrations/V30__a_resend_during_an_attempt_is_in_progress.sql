-- A resend that arrives while an attempt of the event to the endpoint is out is refused with
-- 409 request_in_progress, not answered 202 and dropped.
--
-- V24's oncepay_resend_webhook_event left a pending delivery whose attempt was out (leased:
-- sent, its answer awaited) as it was and answered 'created': the attempt then settled the
-- delivery as delivered, and the resend the client was told was accepted never went out
-- (found from outside: a receiver answering after 13 s, a resend during the wait, one
-- delivery in all). The attempt cannot take the resend's place: the receiver may already have
-- read it. Joining a delivery that has not gone out yet stays as it was (it goes out after
-- the resend was asked for). Now that case raises lock_not_available (55P03), as a key in
-- flight does: the claim rolls back, the server answers 409 request_in_progress with
-- Retry-After, and the same key once the attempt is settled resends (docs/webhooks.md
-- already promised this 409). Restated from V24 otherwise unchanged, with V27's setting.

-- POST /webhook-endpoints/{id}/events/{event_id}/resend: one more delivery of the event to the
-- endpoint, due now, with a new retry schedule (see the header). A delivery already pending is
-- made due now; one whose attempt is out is refused as in progress (above); one held (the
-- endpoint disabled) stays held.
-- An event not fanned out yet, which the endpoint will receive, needs nothing. Any other event
-- (unknown, another tenant's, one the endpoint does not receive), or an unknown or deleted
-- endpoint: not_found. The key's resource is the event.
CREATE OR REPLACE FUNCTION oncepay_resend_webhook_event(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid,
                                                        p_event uuid)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz, resource uuid)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
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
$$;
