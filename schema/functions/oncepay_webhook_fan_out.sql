CREATE OR REPLACE FUNCTION public.oncepay_webhook_fan_out(p_limit integer)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_n int;
BEGIN
    -- "whfanout" in ASCII.
    IF NOT pg_try_advisory_xact_lock(8604244658212254068) THEN
        RETURN NULL;
    END IF;
    WITH fanned AS (
        UPDATE webhook_events ev
           SET awaiting_fan_out = CASE WHEN EXISTS (
                   SELECT FROM webhook_endpoints e
                    WHERE e.tenant_id = ev.tenant_id AND e.deleted_at IS NULL
                      AND (e.created_sequence IS NULL OR e.created_sequence < ev.sequence)
                      AND (e.event_types IS NULL OR ev.event_type = ANY (e.event_types)))
               THEN NULL ELSE false END
         WHERE ev.ctid = ANY (ARRAY(SELECT due.ctid FROM webhook_events due
                                     WHERE due.awaiting_fan_out
                                     ORDER BY due.sequence
                                     LIMIT p_limit))
           AND ev.awaiting_fan_out
        RETURNING ev.tenant_id, ev.event_id, ev.event_type, ev.resource_id, ev.created_at, ev.sequence),
    written AS (
        -- In event order: the identity that orders a resource's deliveries is taken row by row.
        INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, resource_id, next_attempt_at,
                                        created_at, state, finished_at)
        SELECT f.tenant_id, f.event_id, e.endpoint_id, f.resource_id,
               greatest(now(), (SELECT max(o.next_attempt_at) FROM webhook_deliveries o
                                 WHERE o.tenant_id = f.tenant_id AND o.endpoint_id = e.endpoint_id
                                   AND o.resource_id = f.resource_id AND o.finished_at IS NULL
                                   AND o.leased_until IS NULL)),
               f.created_at,
               CASE WHEN e.disabled_at IS NULL THEN 'pending' ELSE 'held' END,
               CASE WHEN e.disabled_at IS NULL THEN NULL ELSE now() END
          FROM fanned f
          JOIN webhook_endpoints e
            ON e.tenant_id = f.tenant_id AND e.deleted_at IS NULL
           AND (e.created_sequence IS NULL OR e.created_sequence < f.sequence)
           AND (e.event_types IS NULL OR f.event_type = ANY (e.event_types))
         ORDER BY f.sequence, e.endpoint_id
        RETURNING 1)
    SELECT count(*) INTO v_n FROM fanned;
    RETURN v_n;
END
$function$


