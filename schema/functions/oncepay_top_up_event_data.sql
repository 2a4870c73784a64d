CREATE OR REPLACE FUNCTION public.oncepay_top_up_event_data(r top_ups)
 RETURNS jsonb
 LANGUAGE sql
 STABLE
AS $function$
    SELECT jsonb_build_object(
        'id', r.top_up_id, 'account', r.account_id, 'amount', r.amount, 'currency', r.currency,
        'status', r.status, 'processor_payment_id', r.processor_payment_id,
        'failure_code', r.failure_code, 'created_at', oncepay_json_time(r.created_at))
$function$


