CREATE OR REPLACE FUNCTION public.oncepay_pay_batch(p_tenants uuid[], p_claims oncepay_claim_args[], p_accounts text[], p_amounts bigint[])
 RETURNS TABLE(item integer, outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource payments)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
BEGIN
    IF current_setting('transaction_read_only')::boolean THEN
        RETURN QUERY
        SELECT i.item, p.outcome, p.decline, p.expires_at, p.resource
          FROM generate_series(1, cardinality(p_tenants)) AS i(item)
         CROSS JOIN LATERAL oncepay_pay_in_batch(p_tenants[i.item], p_claims[i.item], p_accounts[i.item],
                                                 p_amounts[i.item]) AS p
         ORDER BY i.item;
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1330665288, h.h)
       FROM (SELECT DISTINCT uuid_hash(t) AS h FROM unnest(p_tenants) AS t ORDER BY 1) AS h;
    RETURN QUERY
    WITH paid AS (
        SELECT i.item, p.outcome, p.decline, p.expires_at, p.resource
          FROM generate_series(1, cardinality(p_tenants)) AS i(item)
         CROSS JOIN LATERAL oncepay_pay_in_batch(p_tenants[i.item], p_claims[i.item], p_accounts[i.item],
                                                 p_amounts[i.item]) AS p),
    events AS (
        INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at,
                                    awaiting_fan_out)
        SELECT (paid.resource).tenant_id, (paid.resource).payment_id, 'payment.succeeded',
               (paid.resource).payment_id::text, NULL, (paid.resource).created_at, true
          FROM paid
         WHERE paid.outcome = 'created' AND (paid.resource).payment_id IS NOT NULL
           AND EXISTS (SELECT FROM webhook_endpoints e
                        WHERE e.tenant_id = (paid.resource).tenant_id AND e.deleted_at IS NULL
                          AND (e.event_types IS NULL OR 'payment.succeeded' = ANY (e.event_types)))
         ORDER BY paid.item)
    SELECT paid.item, paid.outcome, paid.decline, paid.expires_at, paid.resource
      FROM paid
     ORDER BY paid.item;
END
$function$


