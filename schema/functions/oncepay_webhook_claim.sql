CREATE OR REPLACE FUNCTION public.oncepay_webhook_claim(p_limit integer, p_per_endpoint integer, p_lease_ms integer)
 RETURNS TABLE(tenant_id uuid, event_id uuid, endpoint_id uuid, attempt integer, url text, secret_encrypted bytea, previous_secret_encrypted bytea, event_type text, data jsonb, created_at timestamp with time zone)
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM oncepay_webhook_fan_out(1000);
    RETURN QUERY SELECT * FROM oncepay_webhook_claim_fanned_out(p_limit, p_per_endpoint, p_lease_ms);
END
$function$


CREATE OR REPLACE FUNCTION public.oncepay_webhook_claim(p_limit integer, p_per_endpoint integer, p_lease_ms integer, p_fan_out boolean)
 RETURNS TABLE(tenant_id uuid, event_id uuid, endpoint_id uuid, attempt integer, url text, secret_encrypted bytea, previous_secret_encrypted bytea, event_type text, data jsonb, created_at timestamp with time zone)
 LANGUAGE plpgsql
AS $function$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    IF p_fan_out THEN
        PERFORM oncepay_webhook_fan_out(1000);
    END IF;
    RETURN QUERY SELECT * FROM oncepay_webhook_claim_fanned_out(p_limit, p_per_endpoint, p_lease_ms);
END
$function$


CREATE OR REPLACE FUNCTION public.oncepay_webhook_claim(p_limit integer, p_per_endpoint integer, p_lease_ms integer, p_fan_out boolean, p_tenants uuid[], p_tenant_rooms integer[], p_room integer)
 RETURNS TABLE(tenant_id uuid, event_id uuid, endpoint_id uuid, attempt integer, url text, secret_encrypted bytea, previous_secret_encrypted bytea, event_type text, data jsonb, created_at timestamp with time zone)
 LANGUAGE sql
AS $function$
    SELECT c.tenant_id, c.event_id, c.endpoint_id, c.attempt, c.url, c.secret_encrypted,
           c.previous_secret_encrypted, c.event_type, c.data, c.created_at
      FROM oncepay_webhook_claim_scheduled(p_limit, p_per_endpoint, p_lease_ms, p_fan_out, p_tenants,
                                           p_tenant_rooms, p_room) AS c
$function$


