CREATE OR REPLACE FUNCTION public.oncepay_payment_event_data(r payments)
 RETURNS jsonb
 LANGUAGE sql
 STABLE
AS $function$
    SELECT jsonb_build_object(
        'id', r.payment_id, 'account', r.account_id, 'amount', r.amount,
        'status', CASE WHEN r.refunded_at IS NULL THEN 'succeeded' ELSE 'refunded' END,
        'created_at', oncepay_json_time(r.created_at),
        'refunded_at', oncepay_json_time(r.refunded_at))
$function$


