CREATE OR REPLACE FUNCTION public.oncepay_decline(p_tenant uuid, p oncepay_claim_args, p_decline oncepay_decline)
 RETURNS oncepay_claimed
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r oncepay_claimed;
BEGIN
    r.outcome := 'declined';
    r.decline := p_decline;
    IF p.key IS NOT NULL THEN
        UPDATE idempotency_keys
           SET status = (p.decline_statuses ->> p_decline::text)::smallint,
               error_code = p_decline, resource_id = NULL
         WHERE tenant_id = p_tenant AND key = p.key
        RETURNING expires_at INTO r.expires_at;
    END IF;
    RETURN r;
END
$function$


