CREATE OR REPLACE FUNCTION public.oncepay_top_up_claim_due(p_owner uuid, p_after_secs integer, p_lease_secs integer, p_limit integer, p_processors text[])
 RETURNS SETOF top_ups
 LANGUAGE sql
AS $function$
    WITH due AS (
        SELECT t.tenant_id, t.top_up_id FROM top_ups t
         WHERE (t.status = 'processing' OR t.refund_state = 'debited')
           AND t.processor = ANY (p_processors)
           AND CASE WHEN t.next_check_at IS NULL
                    THEN t.updated_at <= now() - make_interval(secs => p_after_secs)
                    ELSE t.next_check_at <= now() END
           AND (t.lease_expires_at IS NULL OR t.lease_expires_at <= now())
         ORDER BY coalesce(t.next_check_at, t.updated_at)
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED)
    UPDATE top_ups t
       SET lease_owner = p_owner, lease_expires_at = now() + make_interval(secs => p_lease_secs),
           attempts = t.attempts + 1, updated_at = now()
      FROM due
     WHERE t.tenant_id = due.tenant_id AND t.top_up_id = due.top_up_id
    RETURNING t.*;
$function$


