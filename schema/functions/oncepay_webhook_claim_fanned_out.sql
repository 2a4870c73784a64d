CREATE OR REPLACE FUNCTION public.oncepay_webhook_claim_fanned_out(p_limit integer, p_per_endpoint integer, p_lease_ms integer)
 RETURNS TABLE(tenant_id uuid, event_id uuid, endpoint_id uuid, attempt integer, url text, secret_encrypted bytea, previous_secret_encrypted bytea, event_type text, data jsonb, created_at timestamp with time zone)
 LANGUAGE plpgsql
AS $function$
BEGIN
    RETURN QUERY
    SELECT c.tenant_id, c.event_id, c.endpoint_id, c.attempt, c.url, c.secret_encrypted,
           c.previous_secret_encrypted, c.event_type,
           coalesce(c.data, (SELECT oncepay_event_data(ev) FROM webhook_events ev
                              WHERE ev.tenant_id = c.tenant_id AND ev.event_id = c.event_id)),
           c.created_at
      FROM oncepay_webhook_claim_stored_data(p_limit, p_per_endpoint, p_lease_ms) c;
END
$function$


