-- A recovery waits for a delivery being recorded at that moment, and reopens what the record
-- gave up (found by the probes of 2026-12-06, left by V33).
--
-- V33's recover locked the endpoint (FOR SHARE), then brought its pending deliveries forward
-- with FOR UPDATE SKIP LOCKED: a delivery whose attempt's record was in progress (its row
-- locked for that transaction, milliseconds) was skipped, the recovery answered without it,
-- and the record then gave the event up for good when that attempt was the schedule's last
-- (or left it waiting for a retry hours away). Waiting instead would have closed a cycle: the
-- record locks its deliveries, then (when it judges the endpoint's failures) the endpoint.
--
-- Now the recovery takes its locks in the record's order: first the endpoint's pending
-- deliveries since `since`, in the order of (tenant, event, endpoint) as the record sorts
-- them, waiting for any record in progress; then the endpoint FOR SHARE. Each of its
-- statements after that sees what such a record committed: a delivery it gave up is reopened
-- with the others, one it set to retry later is brought forward. A cycle is still possible
-- with calls that lock the endpoint before its deliveries (disable, enable, delete, and a
-- record disabling the endpoint for failing), and with a record whose batch holds a 2xx and a
-- failure of the same endpoint (its 2xx rows are locked first, out of that order), each at the
-- same moment on the same endpoint: PostgreSQL's deadlock detector ends such a cycle after
-- deadlock_timeout, and the loser's error is transient (40P01): the deliverer records again,
-- the client retries its recovery (tests/api/recovery.rs).

CREATE OR REPLACE FUNCTION oncepay_recover_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid,
                                                 p_since timestamptz)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource webhook_recoveries)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
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
$$;
