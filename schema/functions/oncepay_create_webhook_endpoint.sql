CREATE OR REPLACE FUNCTION public.oncepay_create_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_url text, p_event_types text[], p_secret_encrypted bytea)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource webhook_endpoints)
 LANGUAGE sql
 SET enable_seqscan TO 'off'
AS $function$
    SELECT * FROM oncepay_create_webhook_endpoint(p_tenant, p, p_url, p_event_types, p_secret_encrypted, 16)
$function$


CREATE OR REPLACE FUNCTION public.oncepay_create_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_url text, p_event_types text[], p_secret_encrypted bytea, p_max_endpoints integer)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource webhook_endpoints)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    setting text := pg_advisory_xact_lock(1330665288, uuid_hash(p_tenant))::text;
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
BEGIN
    IF c.outcome = 'created' THEN
        IF (SELECT count(*) FROM webhook_endpoints e
             WHERE e.tenant_id = p_tenant AND e.deleted_at IS NULL) >= p_max_endpoints THEN
            c := oncepay_decline(p_tenant, p, 'too_many_endpoints');
        ELSE
            INSERT INTO webhook_endpoints AS r (tenant_id, endpoint_id, url, event_types, secret_encrypted,
                                                idempotency_key, created_at, created_sequence,
                                                secret_from_key)
            VALUES (p_tenant, c.resource_id::uuid, p_url, p_event_types, p_secret_encrypted, p.key, now(),
                    nextval('webhook_events_sequence_seq'), p.key)
            RETURNING r.* INTO resource;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM webhook_endpoints r
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


