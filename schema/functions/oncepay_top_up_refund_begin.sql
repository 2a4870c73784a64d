CREATE OR REPLACE FUNCTION public.oncepay_top_up_refund_begin(p_tenant uuid, p oncepay_claim_args, p_top_up uuid, p_owner uuid, p_lease_secs integer)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource top_ups, owned boolean)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_top_up::text);
    t top_ups;
    v_balance bigint;
BEGIN
    owned := false;
    IF c.outcome = 'created' THEN
        SELECT r.* INTO t FROM top_ups r
         WHERE r.tenant_id = p_tenant AND r.top_up_id = p_top_up FOR UPDATE;
        IF NOT FOUND OR t.status = 'failed' THEN
            c := oncepay_decline(p_tenant, p, 'not_found');
        ELSIF t.status = 'processing' THEN
            RAISE EXCEPTION 'top-up % is still processing', p_top_up USING ERRCODE = 'lock_not_available';
        ELSIF t.refund_state = 'debited' THEN
            -- Another key's refund is under way: how it ends decides this one's answer.
            RAISE EXCEPTION 'top-up % has a refund under way', p_top_up USING ERRCODE = 'lock_not_available';
        ELSIF t.refund_state IS NOT NULL THEN
            c := oncepay_decline(p_tenant, p, 'already_refunded');
        ELSE
            UPDATE accounts a SET balance = a.balance - t.amount
             WHERE a.tenant_id = p_tenant AND a.account_id = t.account_id AND a.balance >= t.amount
            RETURNING a.balance INTO v_balance;
            IF NOT FOUND THEN
                c := oncepay_decline(p_tenant, p, 'insufficient_funds');
            ELSE
                UPDATE top_ups r
                   SET refund_state = 'debited', refund_key = p.key, balance_after_refund = v_balance,
                       lease_owner = p_owner,
                       lease_expires_at = now() + make_interval(secs => p_lease_secs),
                       attempts = 1, updated_at = now(),
                       refund_requested_at = now(), refund_status = NULL, refund_failure_code = NULL,
                       processor_refund_id = NULL, checks = 0, next_check_at = NULL,
                       refund_key_series = CASE WHEN r.refund_key IS NULL THEN r.refund_key_series
                                                ELSE r.refund_key_series + 1 END
                 WHERE r.tenant_id = p_tenant AND r.top_up_id = p_top_up
                RETURNING r.* INTO resource;
                owned := true;
            END IF;
        END IF;
    ELSIF c.outcome = 'replayed' AND c.resource_id IS NOT NULL THEN
        UPDATE top_ups r
           SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_secs),
               attempts = r.attempts + 1, updated_at = now()
         WHERE r.tenant_id = p_tenant AND r.top_up_id = c.resource_id::uuid
           AND r.refund_state = 'debited'
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


