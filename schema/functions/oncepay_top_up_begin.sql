CREATE OR REPLACE FUNCTION public.oncepay_top_up_begin(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint, p_currency text, p_payment_method text, p_owner uuid, p_lease_secs integer, p_processor text)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource top_ups, owned boolean)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
BEGIN
    owned := false;
    IF c.outcome = 'created' THEN
        IF NOT EXISTS (SELECT FROM accounts a WHERE a.tenant_id = p_tenant AND a.account_id = p_account) THEN
            c := oncepay_decline(p_tenant, p, 'account_not_found');
        ELSE
            INSERT INTO top_ups AS r (tenant_id, top_up_id, account_id, amount, currency,
                                      payment_method, status, recovery_point, idempotency_key,
                                      lease_owner, lease_expires_at, created_at, updated_at, processor)
            VALUES (p_tenant, c.resource_id::uuid, p_account, p_amount, p_currency,
                    p_payment_method, 'processing', 'started', p.key,
                    p_owner, now() + make_interval(secs => p_lease_secs), now(), now(), p_processor)
            RETURNING r.* INTO resource;
            owned := true;
        END IF;
    ELSIF c.outcome = 'replayed' AND c.resource_id IS NOT NULL THEN
        UPDATE top_ups r
           SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_secs),
               attempts = r.attempts + 1, updated_at = now()
         WHERE r.tenant_id = p_tenant AND r.top_up_id = c.resource_id::uuid
           AND r.status = 'processing'
           AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())
        RETURNING r.* INTO resource;
        IF FOUND THEN
            owned := true;
        ELSE
            SELECT r.* INTO resource FROM top_ups r
             WHERE r.tenant_id = p_tenant AND r.top_up_id = c.resource_id::uuid;
        END IF;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


