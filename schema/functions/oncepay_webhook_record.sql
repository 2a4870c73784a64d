CREATE OR REPLACE FUNCTION public.oncepay_webhook_record(p_tenant uuid, p_event uuid, p_endpoint uuid, p_attempt integer, p_started_at timestamp with time zone, p_latency_ms integer, p_status smallint, p_response_head text, p_error text, p_replica text, p_outcome text, p_next_attempt_at timestamp with time zone)
 RETURNS boolean
 LANGUAGE sql
AS $function$
    SELECT r.applied
      FROM oncepay_webhook_record_results(ARRAY[p_tenant], ARRAY[p_event], ARRAY[p_endpoint], ARRAY[p_attempt],
                                          ARRAY[p_started_at], ARRAY[p_latency_ms], ARRAY[p_status],
                                          ARRAY[p_response_head], ARRAY[p_error], p_replica,
                                          ARRAY[p_outcome], ARRAY[p_next_attempt_at], 432000) AS r
$function$


