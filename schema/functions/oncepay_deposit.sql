CREATE OR REPLACE FUNCTION public.oncepay_deposit(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource deposits)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
    v_balance bigint;
    v_event uuid;
BEGIN
    IF c.outcome = 'created' THEN
        UPDATE accounts a SET balance = a.balance + p_amount
         WHERE a.tenant_id = p_tenant AND a.account_id = p_account
        RETURNING a.balance INTO v_balance;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, 'account_not_found');
        ELSE
            INSERT INTO deposits AS r (tenant_id, deposit_id, account_id, amount, balance_after, idempotency_key, created_at)
            VALUES (p_tenant, c.resource_id::uuid, p_account, p_amount, v_balance, p.key, now())
            RETURNING r.* INTO resource;
            v_event := oncepay_emit_event(p_tenant, 'deposit.succeeded', c.resource_id,
                jsonb_build_object('id', resource.deposit_id, 'account', resource.account_id,
                                   'amount', resource.amount, 'balance', resource.balance_after,
                                   'created_at', oncepay_json_time(resource.created_at)));
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM deposits r
         WHERE r.tenant_id = p_tenant AND r.deposit_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


