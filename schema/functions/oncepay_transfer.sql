CREATE OR REPLACE FUNCTION public.oncepay_transfer(p_tenant uuid, p oncepay_claim_args, p_from text, p_to text, p_amount bigint)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource transfers)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed;
    v_locked int;
    v_from bigint;
    v_to bigint;
    v_event uuid;
BEGIN
    -- Rust refuses this before calling (400); the SQL does not trust it to.
    IF p_from = p_to THEN
        RAISE EXCEPTION 'a transfer needs two different accounts' USING ERRCODE = 'check_violation';
    END IF;
    c := oncepay_claim(p_tenant, p, NULL);
    IF c.outcome = 'created' THEN
        SELECT count(*) INTO v_locked FROM (
            SELECT FROM accounts a
             WHERE a.tenant_id = p_tenant AND a.account_id IN (p_from, p_to)
             ORDER BY a.account_id COLLATE "C"
               FOR UPDATE) AS locked;
        IF v_locked < 2 THEN
            c := oncepay_decline(p_tenant, p, 'account_not_found');
        ELSE
            UPDATE accounts a SET balance = a.balance - p_amount
             WHERE a.tenant_id = p_tenant AND a.account_id = p_from AND a.balance >= p_amount
            RETURNING a.balance INTO v_from;
            IF NOT FOUND THEN
                c := oncepay_decline(p_tenant, p, 'insufficient_funds');
            ELSE
                UPDATE accounts a SET balance = a.balance + p_amount
                 WHERE a.tenant_id = p_tenant AND a.account_id = p_to
                RETURNING a.balance INTO v_to;
                INSERT INTO transfers AS r (tenant_id, transfer_id, from_account_id, to_account_id, amount,
                                            from_balance_after, to_balance_after, idempotency_key, created_at)
                VALUES (p_tenant, c.resource_id::uuid, p_from, p_to, p_amount, v_from, v_to, p.key, now())
                RETURNING r.* INTO resource;
                v_event := oncepay_emit_event(p_tenant, 'transfer.succeeded', c.resource_id,
                    jsonb_build_object('id', resource.transfer_id, 'from', resource.from_account_id,
                                       'to', resource.to_account_id, 'amount', resource.amount,
                                       'created_at', oncepay_json_time(resource.created_at)));
            END IF;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM transfers r
         WHERE r.tenant_id = p_tenant AND r.transfer_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


