CREATE OR REPLACE FUNCTION public.oncepay_webhook_record_many(p_tenant uuid[], p_event uuid[], p_endpoint uuid[], p_attempt integer[], p_started_at timestamp with time zone[], p_latency_ms integer[], p_status smallint[], p_response_head text[], p_error text[], p_replica text, p_outcome text[], p_next_attempt_at timestamp with time zone[])
 RETURNS TABLE(event_id uuid, endpoint_id uuid, applied boolean)
 LANGUAGE sql
AS $function$
    SELECT * FROM oncepay_webhook_record_results(p_tenant, p_event, p_endpoint, p_attempt, p_started_at,
                                                 p_latency_ms, p_status, p_response_head, p_error,
                                                 p_replica, p_outcome, p_next_attempt_at, 432000)
$function$


