CREATE OR REPLACE FUNCTION public.oncepay_rotate_webhook_secret(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid, p_secret_encrypted bytea, p_overlap_secs integer)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource webhook_endpoints)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_endpoint::text);
BEGIN
    IF c.outcome = 'created' THEN
        UPDATE webhook_endpoints r
           SET previous_secret_encrypted = r.secret_encrypted,
               previous_secret_expires_at = now() + make_interval(secs => p_overlap_secs),
               secret_encrypted = p_secret_encrypted,
               secret_from_key = p.key
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = p_endpoint AND r.deleted_at IS NULL
        RETURNING r.* INTO resource;
        IF NOT FOUND THEN
            resource := NULL;
            c := oncepay_decline(p_tenant, p, 'not_found');
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM webhook_endpoints r
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


