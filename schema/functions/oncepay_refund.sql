CREATE OR REPLACE FUNCTION public.oncepay_refund(p_tenant uuid, p oncepay_claim_args, p_payment uuid)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource payments)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_payment::text);
    v_pay record;
    v_balance bigint;
    v_event uuid;
BEGIN
    IF c.outcome = 'created' THEN
        SELECT r.account_id, r.amount, r.refunded_at INTO v_pay
          FROM payments r WHERE r.tenant_id = p_tenant AND r.payment_id = p_payment
           FOR UPDATE;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, 'not_found');
        ELSIF v_pay.refunded_at IS NOT NULL THEN
            c := oncepay_decline(p_tenant, p, 'already_refunded');
        ELSE
            UPDATE accounts a SET balance = a.balance + v_pay.amount
             WHERE a.tenant_id = p_tenant AND a.account_id = v_pay.account_id
            RETURNING a.balance INTO v_balance;
            UPDATE payments r SET refunded_at = now(), balance_after_refund = v_balance
             WHERE r.tenant_id = p_tenant AND r.payment_id = p_payment
            RETURNING r.* INTO resource;
            v_event := oncepay_emit_event(p_tenant, 'payment.refunded', p_payment::text,
                                          oncepay_payment_event_data(resource));
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM payments r
         WHERE r.tenant_id = p_tenant AND r.payment_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


