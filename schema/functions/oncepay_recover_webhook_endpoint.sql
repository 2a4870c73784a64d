CREATE OR REPLACE FUNCTION public.oncepay_recover_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid, p_since timestamp with time zone)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource webhook_recoveries)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
    ep webhook_endpoints;
    v_reopened int;
    v_due int;
BEGIN
    IF c.outcome = 'created' THEN
        -- The deliveries a record may hold, waited for, in the record's order.
        PERFORM FROM webhook_deliveries w
          WHERE w.tenant_id = p_tenant AND w.endpoint_id = p_endpoint AND w.state = 'pending'
            AND w.created_at >= p_since
          ORDER BY w.tenant_id, w.event_id, w.endpoint_id
            FOR UPDATE OF w;
        SELECT e.* INTO ep FROM webhook_endpoints e
         WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint AND e.deleted_at IS NULL
           FOR SHARE;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, 'not_found');
        ELSE
            UPDATE webhook_deliveries d
               SET state = CASE WHEN ep.disabled_at IS NULL THEN 'pending' ELSE 'held' END,
                   finished_at = CASE WHEN ep.disabled_at IS NULL THEN NULL ELSE now() END,
                   next_attempt_at = now(), leased_until = NULL, schedule_start = d.attempts
             WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint
               AND d.state IN ('given_up', 'cancelled') AND d.created_at >= p_since
               AND NOT EXISTS (SELECT FROM webhook_attempts a
                                WHERE a.tenant_id = d.tenant_id AND a.event_id = d.event_id
                                  AND a.endpoint_id = d.endpoint_id AND a.status BETWEEN 200 AND 299);
            GET DIAGNOSTICS v_reopened = ROW_COUNT;
            -- One whose attempt is out (leased) has its schedule restarted under that attempt:
            -- if it fails, the record sends it again at once (V33).
            UPDATE webhook_deliveries d
               SET next_attempt_at = CASE WHEN d.leased_until > now() THEN d.next_attempt_at ELSE now() END,
                   schedule_start = d.attempts
             WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'pending'
               AND d.created_at >= p_since
               AND (d.next_attempt_at > now() OR d.leased_until > now());
            GET DIAGNOSTICS v_due = ROW_COUNT;
            INSERT INTO webhook_recoveries AS r (tenant_id, recovery_id, endpoint_id, since, deliveries,
                                                 idempotency_key, created_at)
            VALUES (p_tenant, c.resource_id::uuid, p_endpoint, p_since, v_reopened + v_due, p.key, now())
            RETURNING r.* INTO resource;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM webhook_recoveries r
         WHERE r.tenant_id = p_tenant AND r.recovery_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


CREATE OR REPLACE FUNCTION public.oncepay_recover_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid, p_since timestamp with time zone, p_prior integer)
 RETURNS TABLE(outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource webhook_recoveries)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
 SET enable_bitmapscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
    ep webhook_endpoints;
    v_reopened int;
    v_due int;
    v_progress bigint;
    v_resources text[];
    v_sequences bigint[];
BEGIN
    IF c.outcome = 'created' THEN
        DELETE FROM webhook_recovery_progress g
         WHERE g.tenant_id = p_tenant AND g.idempotency_key = p.key AND g.fingerprint = p.fingerprint
        RETURNING g.deliveries INTO v_progress;
        -- The deliveries the update below may change that a record may hold, waited for, in
        -- the record's order. Found by the two indexes that hold them, by plain index scans:
        -- after the slices every pending delivery is due, and the statistics do not know it
        -- yet (they were taken before the recovery), so the planner chose a bitmap scan of all
        -- the endpoint's pending deliveries: 130-150 ms at 450,000, against 0.2 ms.
        PERFORM FROM webhook_deliveries w
          WHERE w.tenant_id = p_tenant AND w.endpoint_id = p_endpoint AND w.state = 'pending'
            AND w.created_at >= p_since
            AND w.event_id = ANY (ARRAY(
                    (SELECT n.event_id FROM webhook_deliveries n
                     WHERE n.tenant_id = p_tenant AND n.endpoint_id = p_endpoint AND n.state = 'pending'
                       AND n.next_attempt_at > now()
                       ORDER BY n.next_attempt_at, n.sequence)
                    UNION ALL
                    SELECT l.event_id FROM webhook_deliveries l
                     WHERE l.tenant_id = p_tenant AND l.endpoint_id = p_endpoint AND l.state = 'pending'
                       AND l.leased_until IS NOT NULL))
          ORDER BY w.tenant_id, w.event_id, w.endpoint_id
            FOR UPDATE OF w;
        SELECT e.* INTO ep FROM webhook_endpoints e
         WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint AND e.deleted_at IS NULL
           FOR SHARE;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, 'not_found');
        ELSE
            v_reopened := oncepay_recover_webhook_reopen_rows(p_tenant, p_endpoint, ep.disabled_at IS NOT NULL,
                                                              p_since, NULL, NULL);
            -- One whose attempt is out (leased) has its schedule restarted under that attempt:
            -- if it fails, the record sends it again at once (V33). Not one whose schedule was
            -- just restarted (by a slice, or another recovery at once): counted once. Nor one
            -- whose attempt out is its schedule's first, which is not about to be given up: a
            -- delivery this request's slice reopened and a deliverer took at once was counted
            -- again (seen in `make test`: 20 of 16). The later deliveries of the resources of
            -- those made due come behind them (see the header; not due, they were locked above).
            WITH due AS (
                UPDATE webhook_deliveries d
                   SET next_attempt_at = CASE WHEN d.leased_until > now() THEN d.next_attempt_at ELSE now() END,
                       schedule_start = d.attempts
                 WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'pending'
                   AND d.created_at >= p_since
                   AND d.event_id = ANY (ARRAY(
                           (SELECT n.event_id FROM webhook_deliveries n
                            WHERE n.tenant_id = p_tenant AND n.endpoint_id = p_endpoint AND n.state = 'pending'
                              AND n.next_attempt_at > now()
                              ORDER BY n.next_attempt_at, n.sequence)
                           UNION ALL
                           SELECT l.event_id FROM webhook_deliveries l
                            WHERE l.tenant_id = p_tenant AND l.endpoint_id = p_endpoint AND l.state = 'pending'
                              AND l.leased_until > now()))
                   AND (d.next_attempt_at > now() OR d.leased_until > now())
                   AND d.schedule_start < d.attempts - CASE WHEN d.leased_until > now() THEN 1 ELSE 0 END
                RETURNING d.resource_id, d.sequence, d.leased_until > now() AS leased),
            firsts AS (
                SELECT r.resource_id, min(r.sequence) AS sequence FROM due r
                 WHERE NOT coalesce(r.leased, false) GROUP BY r.resource_id)
            SELECT (SELECT count(*)::int FROM due), array_agg(f.resource_id), array_agg(f.sequence)
              INTO v_due, v_resources, v_sequences
              FROM firsts f;
            PERFORM oncepay_webhook_due_behind(p_tenant, p_endpoint, v_resources, v_sequences, now());
            INSERT INTO webhook_recoveries AS r (tenant_id, recovery_id, endpoint_id, since, deliveries,
                                                 idempotency_key, created_at)
            VALUES (p_tenant, c.resource_id::uuid, p_endpoint, p_since,
                    least(coalesce(v_progress, 0) + p_prior + v_reopened + v_due, 2147483647), p.key, now())
            RETURNING r.* INTO resource;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM webhook_recoveries r
         WHERE r.tenant_id = p_tenant AND r.recovery_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$function$


