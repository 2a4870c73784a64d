CREATE OR REPLACE FUNCTION public.oncepay_top_up_event_data(r top_ups)
 RETURNS jsonb
 LANGUAGE sql
 STABLE
AS $function$
    SELECT jsonb_build_object(
        'id', r.top_up_id, 'account', r.account_id, 'amount', r.amount, 'currency', r.currency,
        'status', CASE WHEN r.refund_state = 'debited' THEN 'refund_pending' ELSE r.status::text END,
        'processor_payment_id', r.processor_payment_id, 'processor_status', r.processor_status,
        'failure_code', r.failure_code, 'decline_code', r.decline_code,
        'refund_failure_code', r.refund_failure_code, 'created_at', oncepay_json_time(r.created_at))
$function$


