CREATE OR REPLACE FUNCTION public.oncepay_webhook_due_behind(p_tenant uuid, p_endpoint uuid, p_resources text[], p_sequences bigint[], p_due timestamp with time zone)
 RETURNS void
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
BEGIN
    -- Each resource's later deliveries by a look-up of their own (a lateral subquery the
    -- planner cannot flatten), then updated by row address: as a join, planned on the
    -- statistics of a small table, it read every pending delivery of the endpoint into a hash
    -- for each call (seen before release). Updated by the row address alone: with any other
    -- condition on the row the planner took the endpoint's range of the resource index
    -- instead. A row another transaction holds is passed, not waited for (SKIP LOCKED): a
    -- record moves rows out of the order in which a recovery's keyed transaction and a disable
    -- lock them, and waiting could close a cycle; a row passed, or changed meanwhile, stays
    -- due earlier: it costs claims a read, never its order.
    UPDATE webhook_deliveries s SET next_attempt_at = p_due
     WHERE s.ctid = ANY (ARRAY(
               SELECT later.ctid
                 FROM unnest(p_resources, p_sequences) AS r(resource_id, sequence)
                 CROSS JOIN LATERAL (
                       SELECT o.ctid FROM webhook_deliveries o
                        WHERE o.tenant_id = p_tenant AND o.endpoint_id = p_endpoint
                          AND o.resource_id = r.resource_id AND o.sequence > r.sequence
                          AND o.finished_at IS NULL AND o.leased_until IS NULL
                          AND (o.next_attempt_at < p_due
                               OR (o.next_attempt_at > p_due AND o.attempts <= o.schedule_start))
                       OFFSET 0
                          FOR UPDATE OF o SKIP LOCKED) later));
END
$function$


