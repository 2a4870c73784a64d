CREATE OR REPLACE FUNCTION public.oncepay_open_account(p_tenant uuid, p oncepay_claim_args, p_account text, p_balance bigint)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource accounts)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_account);
BEGIN
    IF c.outcome = 'created' THEN
        INSERT INTO accounts AS r (tenant_id, account_id, balance, opening_balance, created_at)
        VALUES (p_tenant, p_account, p_balance, p_balance, now())
        ON CONFLICT (tenant_id, account_id) DO NOTHING
        RETURNING r.* INTO resource;
        IF NOT FOUND THEN
            -- INTO with no row leaves a row of NULLs, which is not a NULL row.
            resource := NULL;
            c := oncepay_decline(p_tenant, p, 'account_exists');
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM accounts r
         WHERE r.tenant_id = p_tenant AND r.account_id = c.resource_id;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


