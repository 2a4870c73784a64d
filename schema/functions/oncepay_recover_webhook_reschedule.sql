CREATE OR REPLACE FUNCTION public.oncepay_recover_webhook_reschedule(p_tenant uuid, p_endpoint uuid, p_since timestamp with time zone, p_after_at timestamp with time zone, p_after_sequence bigint, p_limit integer, p_key text, p_fingerprint bytea)
 RETURNS TABLE(changed integer, last_at timestamp with time zone, last_sequence bigint)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    v_events uuid[];
    v_seen int;
    v_resources text[];
    v_sequences bigint[];
BEGIN
    SELECT array_agg(s.event_id) FILTER (WHERE s.created_at >= p_since AND NOT s.leased), count(*),
           (array_agg(s.next_attempt_at ORDER BY s.next_attempt_at DESC, s.sequence DESC))[1],
           (array_agg(s.sequence ORDER BY s.next_attempt_at DESC, s.sequence DESC))[1]
      INTO v_events, v_seen, last_at, last_sequence
      FROM (SELECT d.event_id, d.created_at, d.next_attempt_at, d.sequence,
                   coalesce(d.leased_until > now(), false) AS leased
              FROM webhook_deliveries d
             WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'pending'
               AND d.next_attempt_at > now()
               AND (d.next_attempt_at, d.sequence) > (coalesce(p_after_at, '-infinity'), coalesce(p_after_sequence, 0))
             ORDER BY d.next_attempt_at, d.sequence
             LIMIT p_limit) s;
    IF v_seen < p_limit THEN
        last_at := NULL; last_sequence := NULL;
    END IF;
    PERFORM FROM webhook_deliveries w
      WHERE w.tenant_id = p_tenant AND w.event_id = ANY (v_events) AND w.endpoint_id = p_endpoint
      ORDER BY w.tenant_id, w.event_id, w.endpoint_id
        FOR UPDATE OF w;
    WITH due AS (
        UPDATE webhook_deliveries d
           SET next_attempt_at = now(), schedule_start = d.attempts
         WHERE d.tenant_id = p_tenant AND d.event_id = ANY (v_events) AND d.endpoint_id = p_endpoint
           AND d.state = 'pending' AND d.next_attempt_at > now() AND NOT coalesce(d.leased_until > now(), false)
           AND d.schedule_start < d.attempts
        RETURNING d.resource_id, d.sequence),
    firsts AS (
        SELECT r.resource_id, min(r.sequence) AS sequence FROM due r GROUP BY r.resource_id)
    SELECT (SELECT count(*)::int FROM due), array_agg(f.resource_id), array_agg(f.sequence)
      INTO changed, v_resources, v_sequences
      FROM firsts f;
    PERFORM oncepay_webhook_due_behind(p_tenant, p_endpoint, v_resources, v_sequences, now());
    PERFORM oncepay_recover_webhook_progress(p_tenant, p_key, p_fingerprint, changed);
    RETURN NEXT;
END
$function$


