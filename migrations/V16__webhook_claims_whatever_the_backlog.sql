-- The claim's per-resource order check reaches a resource's earlier deliveries by that
-- resource's index, whatever the statistics say about the backlog.
--
-- A claim takes an endpoint's due deliveries in sequence order, each only if no earlier
-- delivery of its resource is pending (the minimum pending sequence of the resource is its
-- own). Written "AND o.state = 'pending'", that check could be answered from either partial
-- index: the resource's (tenant, endpoint, resource, sequence), one probe; or the endpoint's
-- (tenant, endpoint, sequence), walked from the front until the resource turns up. Analysed
-- while the backlog was empty (autovacuum's analyse after a drain), the planner expects one
-- pending row per endpoint and takes the second, once per candidate: every claim then walks
-- the whole pending queue, dead entries of the rows delivered since the last vacuum included,
-- sixteen times. The V12 trap, on the claim's side. Measured with pg_stat_statements over a
-- deliverer draining 40,000 events (2026-12-02 21:4x, /work notes): the claim's pick at 56 us
-- per event in a first drain and 144 in a second, 2,500 to 7,200 buffers per claim of 16
-- (EXPLAIN mid-drain); tests/api/webhooks.rs
-- a_claim_finds_each_resources_earlier_delivery_by_its_index_even_when_the_statistics_saw_an_empty_backlog:
-- 34,169 index fetches to claim 16 deliveries behind 2,000 waiting ones.
--
-- A pending delivery is exactly an unfinished one (every writer sets finished_at when it
-- moves a delivery out of 'pending', and only then); the constraint below makes that a rule.
-- The resource index is rebuilt on "finished_at IS NULL", and the check is written that way:
-- it proves that index's predicate and neither the endpoint's nor the leases' ("state =
-- 'pending'"), so the resource's index is its only way in. The record functions' lookups,
-- written "(state = 'pending') IS TRUE" (V12), prove none of them and stay on the key.
--
-- Locks webhook_deliveries while it validates the rule and builds the index (a scan of the
-- retention's rows: seconds for millions); replicas of the previous version keep working
-- with the new index, their claim's check as before.

ALTER TABLE webhook_deliveries ADD CONSTRAINT webhook_deliveries_finished_check
    CHECK ((state = 'pending') = (finished_at IS NULL));

DROP INDEX webhook_deliveries_resource_idx;
CREATE INDEX webhook_deliveries_resource_idx ON webhook_deliveries (tenant_id, endpoint_id, resource_id, sequence)
    WHERE finished_at IS NULL;

CREATE OR REPLACE FUNCTION oncepay_webhook_claim_fanned_out(p_limit int, p_per_endpoint int, p_lease_ms int)
RETURNS TABLE (tenant_id uuid, event_id uuid, endpoint_id uuid, attempt int, url text,
               secret_encrypted bytea, previous_secret_encrypted bytea, event_type text,
               data jsonb, created_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_pivot uuid := gen_random_uuid();
    v_nil uuid := '00000000-0000-0000-0000-000000000000';
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
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
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

        -- Another replica claiming for this endpoint holds its row: skip it this time.
        SELECT e.tenant_id, e.endpoint_id, e.url, e.secret_encrypted,
               CASE WHEN e.previous_secret_expires_at > now() THEN e.previous_secret_encrypted END AS previous
          INTO ep
          FROM webhook_endpoints e
         WHERE e.tenant_id = v_tenant AND e.endpoint_id = v_endpoint
           AND e.disabled_at IS NULL AND e.deleted_at IS NULL
           FOR NO KEY UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;

        SELECT count(*) INTO v_in_flight FROM webhook_deliveries d
         WHERE d.tenant_id = v_tenant AND d.endpoint_id = v_endpoint
           AND d.state = 'pending' AND d.leased_until IS NOT NULL AND d.leased_until > now();
        v_n := least(p_per_endpoint - v_in_flight, p_limit - v_taken);
        CONTINUE WHEN v_n <= 0;

        RETURN QUERY
        WITH picked AS (
            SELECT d.tenant_id, d.event_id, d.endpoint_id FROM webhook_deliveries d
             WHERE d.tenant_id = v_tenant AND d.endpoint_id = v_endpoint
               AND d.state = 'pending' AND d.next_attempt_at <= now()
               -- The first pending delivery of its resource to this endpoint. (A scalar
               -- subquery, run per candidate with all four columns of the resource index as
               -- its condition: V9's NOT EXISTS became an anti join that the planner, with a
               -- young table's statistics, ran as a scan of all the endpoint's pending rows
               -- per candidate: 3,084 buffers for 15 rows, measured under load. "Unfinished"
               -- rather than "pending", so that only the resource index can answer: V16.)
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
            RETURNING d.tenant_id, d.event_id, d.endpoint_id, d.attempts)
        SELECT l.tenant_id, l.event_id, l.endpoint_id, l.attempts, ep.url, ep.secret_encrypted,
               ep.previous, ev.event_type, ev.data, ev.created_at
          FROM leased l
          JOIN webhook_events ev ON ev.tenant_id = l.tenant_id AND ev.event_id = l.event_id;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_taken := v_taken + v_n;
    END LOOP;
END
$$;

-- A claim that fans out only when asked. The fan-out finds its events by the partial index
-- of awaiting ones, whose entries of the events it fanned out stay, dead, until the table's
-- next vacuum (autovacuum looks once a minute): a fan-out that finds nothing still steps over
-- every event fanned out since (0.5 ms per call after a 40,000-event drain, measured with
-- pg_stat_statements, while each worker claimed ~170 times a second). The workers of this
-- version fan out at most every few milliseconds (src/webhooks/delivery.rs, FAN_OUT_EVERY),
-- not on every claim; replicas of the previous version call the three-argument claim (V14),
-- which still fans out every time.
CREATE FUNCTION oncepay_webhook_claim(p_limit int, p_per_endpoint int, p_lease_ms int, p_fan_out boolean)
RETURNS TABLE (tenant_id uuid, event_id uuid, endpoint_id uuid, attempt int, url text,
               secret_encrypted bytea, previous_secret_encrypted bytea, event_type text,
               data jsonb, created_at timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    IF p_fan_out THEN
        PERFORM oncepay_webhook_fan_out(1000);
    END IF;
    RETURN QUERY SELECT * FROM oncepay_webhook_claim_fanned_out(p_limit, p_per_endpoint, p_lease_ms);
END
$$;
