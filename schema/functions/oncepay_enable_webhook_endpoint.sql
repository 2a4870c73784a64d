CREATE OR REPLACE FUNCTION public.oncepay_enable_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid)
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
           SET disabled_at = NULL, disabled_reason = NULL, failing_since = NULL
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = p_endpoint AND r.deleted_at IS NULL
        RETURNING r.* INTO resource;
        IF NOT FOUND THEN
            resource := NULL;
            c := oncepay_decline(p_tenant, p, 'not_found');
        ELSE
            UPDATE webhook_deliveries d
               SET state = 'pending', finished_at = NULL, next_attempt_at = now(), schedule_start = d.attempts
             WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'held';
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM webhook_endpoints r
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


