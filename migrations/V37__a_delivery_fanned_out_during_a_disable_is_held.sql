-- A delivery fanned out while its endpoint was being disabled or deleted no longer stays
-- pending for ever (found by a 45-minute soak of two replicas, 2026-12-06).
--
-- The fan-out (run by the claim, in its transaction) writes a delivery `pending` for an
-- endpoint its snapshot sees enabled; a disable or delete committing meanwhile moves the
-- endpoint's pending deliveries to `held` or `cancelled`, but its UPDATE cannot see the
-- fan-out's row, not yet committed. The row then stayed `pending` with no attempt: the claim
-- skips disabled and deleted endpoints, and `oncepay_webhook_oldest_pending_seconds` grew a
-- second a second (one of thirty disables in the soak; `OncepayWebhookEventsOld` would have
-- fired two hours later and stayed, its runbook pointing at the workers). The claim now looks
-- at such an endpoint's row (locked, as before) and moves its pending deliveries to where the
-- disable would have left them: `held` (released by enable) or `cancelled`. The same
-- signature and result: a replica of the previous version calls this body.

CREATE OR REPLACE FUNCTION oncepay_webhook_claim_scheduled(p_limit integer, p_per_endpoint integer, p_lease_ms integer, p_fan_out boolean, p_tenants uuid[], p_tenant_rooms integer[], p_room integer)
 RETURNS TABLE(tenant_id uuid, event_id uuid, endpoint_id uuid, attempt integer, url text, secret_encrypted bytea, previous_secret_encrypted bytea, event_type text, data jsonb, created_at timestamp with time zone, schedule_attempt integer)
 LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_pivot uuid := gen_random_uuid();
    v_nil uuid := '00000000-0000-0000-0000-000000000000';
    v_past uuid := 'ffffffff-ffff-ffff-ffff-ffffffffffff';
    v_tenant uuid := v_pivot;
    v_endpoint uuid := v_nil;
    v_wrapped boolean := false;
    v_next record;
    ep record;
    v_in_flight int;
    v_taken int := 0;
    v_n int;
    -- Endpoints looked at: bounds a claim's work when many endpoints are at their bound.
    v_seen int := 0;
    v_room_of uuid;
    v_room int;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    IF p_fan_out THEN
        PERFORM oncepay_webhook_fan_out(1000);
    END IF;
    WHILE v_taken < p_limit AND v_seen < 1000 LOOP
        -- The next endpoint with pending deliveries after (v_tenant, v_endpoint): one descent.
        SELECT d.tenant_id, d.endpoint_id INTO v_next FROM webhook_deliveries d
         WHERE d.state = 'pending' AND (d.tenant_id, d.endpoint_id) > (v_tenant, v_endpoint)
         ORDER BY d.tenant_id, d.endpoint_id
         LIMIT 1;
        IF NOT FOUND THEN
            EXIT WHEN v_wrapped;
            -- From the start, up to the pivot. (nil, nil) itself is no endpoint.
            v_wrapped := true;
            v_tenant := v_nil;
            v_endpoint := v_nil;
            CONTINUE;
        END IF;
        EXIT WHEN v_wrapped AND v_next.tenant_id >= v_pivot;
        v_tenant := v_next.tenant_id;
        v_endpoint := v_next.endpoint_id;
        v_seen := v_seen + 1;
        IF v_room_of IS DISTINCT FROM v_tenant THEN
            v_room_of := v_tenant;
            v_room := coalesce(p_tenant_rooms[array_position(p_tenants, v_tenant)], p_room);
        END IF;
        IF v_room <= 0 THEN
            -- The tenant has its share: past its last endpoint, to the next tenant.
            v_endpoint := v_past;
            CONTINUE;
        END IF;

        -- Another replica claiming for this endpoint holds its row: skip it this time.
        SELECT e.tenant_id, e.endpoint_id, e.url, e.secret_encrypted,
               CASE WHEN e.previous_secret_expires_at > now() THEN e.previous_secret_encrypted END AS previous,
               e.disabled_at, e.deleted_at
          INTO ep
          FROM webhook_endpoints e
         WHERE e.tenant_id = v_tenant AND e.endpoint_id = v_endpoint
           FOR NO KEY UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        IF ep.disabled_at IS NOT NULL OR ep.deleted_at IS NOT NULL THEN
            -- Pending deliveries of a disabled or deleted endpoint: fanned out by a transaction
            -- that saw it enabled while the disable (or delete) committed, whose UPDATE of the
            -- pending rows could not see them. Left, they waited for ever (V37). Held or
            -- cancelled now, as the disable would have left them; its row lock is ours.
            UPDATE webhook_deliveries d
               SET state = CASE WHEN ep.deleted_at IS NOT NULL THEN 'cancelled' ELSE 'held' END,
                   finished_at = now(), leased_until = NULL
             WHERE d.tenant_id = v_tenant AND d.endpoint_id = v_endpoint AND d.state = 'pending';
            CONTINUE;
        END IF;

        SELECT count(*) INTO v_in_flight FROM webhook_deliveries d
         WHERE d.tenant_id = v_tenant AND d.endpoint_id = v_endpoint
           AND d.state = 'pending' AND d.leased_until IS NOT NULL AND d.leased_until > now();
        v_n := least(p_per_endpoint - v_in_flight, p_limit - v_taken, v_room);
        CONTINUE WHEN v_n <= 0;

        RETURN QUERY
        WITH picked AS (
            SELECT d.tenant_id, d.event_id, d.endpoint_id FROM webhook_deliveries d
             WHERE d.tenant_id = v_tenant AND d.endpoint_id = v_endpoint
               AND d.state = 'pending' AND d.next_attempt_at <= now()
               -- The first unfinished delivery of its resource to this endpoint, by the
               -- resource's index alone (V11, V16).
               AND (SELECT min(o.sequence) FROM webhook_deliveries o
                     WHERE o.tenant_id = d.tenant_id AND o.endpoint_id = d.endpoint_id
                       AND o.resource_id = d.resource_id AND o.finished_at IS NULL) = d.sequence
             ORDER BY d.sequence
             LIMIT v_n
               FOR UPDATE SKIP LOCKED),
        leased AS (
            UPDATE webhook_deliveries d
               SET attempts = d.attempts + 1,
                   leased_until = now() + make_interval(secs => p_lease_ms / 1000.0),
                   next_attempt_at = now() + make_interval(secs => p_lease_ms / 1000.0)
              FROM picked
             WHERE d.tenant_id = picked.tenant_id AND d.event_id = picked.event_id
               AND d.endpoint_id = picked.endpoint_id
            RETURNING d.tenant_id, d.event_id, d.endpoint_id, d.attempts, d.schedule_start)
        SELECT l.tenant_id, l.event_id, l.endpoint_id, l.attempts, ep.url, ep.secret_encrypted,
               ep.previous, ev.event_type, coalesce(ev.data, oncepay_event_data(ev)), ev.created_at,
               l.attempts - l.schedule_start
          FROM leased l
          JOIN webhook_events ev ON ev.tenant_id = l.tenant_id AND ev.event_id = l.event_id;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_taken := v_taken + v_n;
        v_room := v_room - v_n;
    END LOOP;
END
$$;
