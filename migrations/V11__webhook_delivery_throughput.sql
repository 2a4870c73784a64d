-- Webhook delivery that keeps up with the payments it reports (issue 20).
--
-- V9's claim was correct but its cost grew with the backlog, and the backlog is exactly what
-- it had to drain: every claim listed the endpoints with due work by a DISTINCT over every due
-- delivery (`webhook_deliveries_due_idx`, one entry per pending row), and counted an endpoint's
-- attempts in flight by reading every pending row of that endpoint. Measured in `make ha`:
-- with one endpoint and ~300 payments a second, 867 events delivered in ~270 s, the backlog
-- growing without bound. Here each step of a claim costs an index descent, whatever the
-- backlog:
--
-- * the endpoints with pending work are found by a skip scan of
--   `webhook_deliveries_endpoint_idx` (tenant, endpoint, sequence): one descent per endpoint,
--   starting at a random endpoint and wrapping round, so a claim that fills up early does not
--   always serve the same endpoints first;
-- * an endpoint's deliveries are taken in `sequence` order from the same index: in the steady
--   state the walk reads the attempts in flight and then the ones it takes;
-- * the attempts in flight are counted in `webhook_deliveries_leased_idx`, which holds only
--   leased rows (a few per endpoint).
--
-- `webhook_deliveries_due_idx` (next_attempt_at) has no reader left and goes.
--
-- Results are recorded many at once (`oncepay_webhook_record_many`): a worker records every
-- attempt that ended since its last round trip in one statement, then claims again at once.
--
-- A claim and a record commit without waiting for the WAL flush (or a synchronous standby):
-- `synchronous_commit = off` for their own transactions only. What a crash can take back is
-- bookkeeping that delivery is already at least once about: a lease lost leaves its delivery
-- due again, so it may be sent twice; a result lost is attempted again. Either way the
-- receiver gets the same `webhook-id` and deduplicates by it. The event itself is written by
-- the change's own transaction, which keeps the server's setting: no event can be lost. (A
-- result lost after its successor on the same resource was sent may make that resource's
-- first event arrive again after the second: a duplicate, never a first delivery out of
-- order.) Measured in `make bench-quick`: the delivery commits were most of what an
-- endpoint cost the payments' PostgreSQL.

DROP INDEX webhook_deliveries_due_idx;

-- A queue table: every delivery is inserted pending and updated once to delivered, leaving a
-- dead entry in the pending-only indexes that every claim's walk of that endpoint crosses
-- until VACUUM removes it. Left to the default (a fifth of the table dead, and the table
-- holds the retention's week of delivered rows), claims slowed from ~1 ms to tens of
-- milliseconds after 60,000 deliveries (measured: 973 buffers for one probe of an empty
-- queue). Vacuumed after every 5,000 changed rows instead, without the cost-based pause.
ALTER TABLE webhook_deliveries SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
                                    autovacuum_vacuum_cost_delay = 0);
CREATE INDEX webhook_deliveries_endpoint_idx ON webhook_deliveries (tenant_id, endpoint_id, sequence)
    WHERE state = 'pending';
CREATE INDEX webhook_deliveries_leased_idx ON webhook_deliveries (tenant_id, endpoint_id, leased_until)
    WHERE state = 'pending' AND leased_until IS NOT NULL;

-- Claims at most p_limit due deliveries, at most p_per_endpoint in flight per endpoint over
-- all replicas, the next event of a resource only once the previous one is delivered or given
-- up; each claimed row is leased for p_lease_ms (its next attempt moves past the lease, so a
-- replica that dies mid-attempt leaves it to another once the lease has run out).
CREATE OR REPLACE FUNCTION oncepay_webhook_claim(p_limit int, p_per_endpoint int, p_lease_ms int)
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
               -- per candidate: 3,084 buffers for 15 rows, measured under load.)
               AND (SELECT min(o.sequence) FROM webhook_deliveries o
                     WHERE o.tenant_id = d.tenant_id AND o.endpoint_id = d.endpoint_id
                       AND o.resource_id = d.resource_id AND o.state = 'pending') = d.sequence
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

-- The results of many attempts at once; the arrays are parallel, one element per attempt.
-- Returns, per attempt, whether it settled its delivery (a stale attempt, whose lease another
-- replica took over, changes nothing but a delivery). Set-based for what nearly every
-- attempt is, a delivery: one INSERT of the attempts and one UPDATE of the deliveries; the
-- other outcomes (a retry, a schedule spent, 410) go one by one through V9's
-- oncepay_webhook_record, whose own insert of the attempt then finds it there.
CREATE FUNCTION oncepay_webhook_record_many(p_tenant uuid[], p_event uuid[], p_endpoint uuid[],
                                            p_attempt int[], p_started_at timestamptz[],
                                            p_latency_ms int[], p_status smallint[],
                                            p_response_head text[], p_error text[], p_replica text,
                                            p_outcome text[], p_next_attempt_at timestamptz[])
RETURNS TABLE (event_id uuid, endpoint_id uuid, applied boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    i int;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    INSERT INTO webhook_attempts (tenant_id, event_id, endpoint_id, attempt, started_at, latency_ms,
                                  status, response_head, error, replica)
    SELECT a.*, p_replica
      FROM unnest(p_tenant, p_event, p_endpoint, p_attempt, p_started_at, p_latency_ms, p_status,
                  p_response_head, p_error) AS a
    ON CONFLICT DO NOTHING;
    RETURN QUERY
    WITH delivered AS (
        SELECT u.tenant_id, u.event_id, u.endpoint_id, u.status
          FROM unnest(p_tenant, p_event, p_endpoint, p_status, p_outcome)
               AS u(tenant_id, event_id, endpoint_id, status, outcome)
         WHERE u.outcome = 'delivered'),
    settled AS (
        UPDATE webhook_deliveries d
           SET state = 'delivered', finished_at = now(), leased_until = NULL,
               last_status = delivered.status, last_error = NULL
          FROM delivered
         WHERE d.tenant_id = delivered.tenant_id AND d.event_id = delivered.event_id
           AND d.endpoint_id = delivered.endpoint_id AND d.state = 'pending'
        RETURNING d.event_id, d.endpoint_id)
    SELECT delivered.event_id, delivered.endpoint_id,
           EXISTS (SELECT FROM settled s
                    WHERE s.event_id = delivered.event_id AND s.endpoint_id = delivered.endpoint_id)
      FROM delivered;
    -- The rest in one order, so that two replicas recording overlapping attempts (a lease
    -- taken over) cannot wait on each other in a cycle.
    FOR i IN SELECT s.i FROM generate_subscripts(p_event, 1) AS s(i)
              WHERE p_outcome[s.i] <> 'delivered'
              ORDER BY p_tenant[s.i], p_event[s.i], p_endpoint[s.i]
    LOOP
        event_id := p_event[i];
        endpoint_id := p_endpoint[i];
        applied := oncepay_webhook_record(p_tenant[i], p_event[i], p_endpoint[i], p_attempt[i],
                                          p_started_at[i], p_latency_ms[i], p_status[i],
                                          p_response_head[i], p_error[i], p_replica,
                                          p_outcome[i], p_next_attempt_at[i]);
        RETURN NEXT;
    END LOOP;
END
$$;
