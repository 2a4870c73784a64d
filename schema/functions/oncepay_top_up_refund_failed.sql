CREATE OR REPLACE FUNCTION public.oncepay_top_up_refund_failed(p_tenant uuid, p_top_up uuid, p_owner uuid, p_refund text, p_refund_status text, p_failure_code text, p_status smallint)
 RETURNS top_ups
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    r top_ups;
    v_balance bigint;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    SELECT t.* INTO r FROM top_ups t
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up FOR UPDATE;
    IF NOT FOUND OR r.refund_state IS DISTINCT FROM 'debited' OR r.lease_owner IS DISTINCT FROM p_owner THEN
        RETURN r;
    END IF;
    UPDATE accounts a SET balance = a.balance + r.amount
     WHERE a.tenant_id = p_tenant AND a.account_id = r.account_id
    RETURNING a.balance INTO v_balance;
    UPDATE top_ups t
       SET refund_state = NULL, balance_after_refund = NULL,
           processor_refund_id = coalesce(p_refund, t.processor_refund_id),
           refund_status = p_refund_status, refund_failure_code = p_failure_code, next_check_at = NULL,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up
    RETURNING t.* INTO r;
    IF r.refund_key IS NOT NULL THEN
        UPDATE idempotency_keys k
           SET status = p_status, error_code = 'refund_failed'::text::oncepay_decline
         WHERE k.tenant_id = p_tenant AND k.key = r.refund_key AND k.resource_id = p_top_up::text;
    END IF;
    PERFORM oncepay_emit_event(p_tenant, 'top_up.refund_failed', p_top_up::text,
                               oncepay_top_up_event_data(r));
    RETURN r;
END
$function$


