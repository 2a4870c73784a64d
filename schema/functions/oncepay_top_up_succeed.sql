CREATE OR REPLACE FUNCTION public.oncepay_top_up_succeed(p_tenant uuid, p_top_up uuid, p_intent text)
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
    IF NOT FOUND OR r.status <> 'processing' THEN
        RETURN r;
    END IF;
    IF r.processor_payment_id IS DISTINCT FROM p_intent THEN
        RAISE EXCEPTION 'top-up % succeeded with PaymentIntent %, not its own %',
            p_top_up, p_intent, r.processor_payment_id;
    END IF;
    UPDATE accounts a SET balance = a.balance + r.amount
     WHERE a.tenant_id = p_tenant AND a.account_id = r.account_id
    RETURNING a.balance INTO v_balance;
    UPDATE top_ups t
       SET status = 'succeeded', recovery_point = 'finished', balance_after = v_balance,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up
    RETURNING t.* INTO r;
    RETURN r;
END
$function$


CREATE OR REPLACE FUNCTION public.oncepay_top_up_succeed(p_tenant uuid, p_top_up uuid, p_owner uuid, p_intent text)
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
    IF NOT FOUND OR r.status <> 'processing' OR r.lease_owner IS DISTINCT FROM p_owner THEN
        RETURN r;
    END IF;
    IF r.processor_payment_id IS DISTINCT FROM p_intent THEN
        RAISE EXCEPTION 'top-up % succeeded with PaymentIntent %, not its own %',
            p_top_up, p_intent, r.processor_payment_id;
    END IF;
    UPDATE accounts a SET balance = a.balance + r.amount
     WHERE a.tenant_id = p_tenant AND a.account_id = r.account_id
    RETURNING a.balance INTO v_balance;
    UPDATE top_ups t
       SET status = 'succeeded', recovery_point = 'finished', balance_after = v_balance,
           processor_status = 'succeeded', next_check_at = NULL,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up
    RETURNING t.* INTO r;
    RETURN r;
END
$function$


