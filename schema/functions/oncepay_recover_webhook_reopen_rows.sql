CREATE OR REPLACE FUNCTION public.oncepay_recover_webhook_reopen_rows(p_tenant uuid, p_endpoint uuid, p_disabled boolean, p_from timestamp with time zone, p_after timestamp with time zone, p_until timestamp with time zone)
 RETURNS integer
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    v_resources text[];
    v_sequences bigint[];
    v_n int;
BEGIN
    WITH reopened AS (
        UPDATE webhook_deliveries d
           SET state = CASE WHEN p_disabled THEN 'held' ELSE 'pending' END,
               finished_at = CASE WHEN p_disabled THEN now() END,
               next_attempt_at = now(), leased_until = NULL, schedule_start = d.attempts
         WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint
           AND d.state IN ('given_up', 'cancelled') AND d.created_at >= p_from
           AND (p_after IS NULL OR d.created_at > p_after)
           AND (p_until IS NULL OR d.created_at <= p_until)
           AND NOT EXISTS (SELECT FROM webhook_attempts a
                            WHERE a.tenant_id = d.tenant_id AND a.event_id = d.event_id
                              AND a.endpoint_id = d.endpoint_id AND a.status BETWEEN 200 AND 299)
        RETURNING d.resource_id, d.sequence, d.state),
    firsts AS (
        SELECT r.resource_id, min(r.sequence) AS sequence FROM reopened r
         WHERE r.state = 'pending' GROUP BY r.resource_id)
    SELECT (SELECT count(*)::int FROM reopened), array_agg(f.resource_id), array_agg(f.sequence)
      INTO v_n, v_resources, v_sequences
      FROM firsts f;
    PERFORM oncepay_webhook_due_behind(p_tenant, p_endpoint, v_resources, v_sequences, now());
    RETURN v_n;
END
$function$


