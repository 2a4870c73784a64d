-- Results are recorded by primary key, whatever the statistics say about the backlog.
--
-- The two record functions settle deliveries by (tenant, event, endpoint) "AND state =
-- 'pending'". That condition lets the planner use the pending-only partial indexes
-- (webhook_deliveries_endpoint_idx, _leased_idx), and a queue table's statistics are taken
-- when its backlog happens to be empty (autovacuum analyses it right after a drain): the
-- planner then expects one pending row and scans every pending row of the endpoint instead of
-- looking up the primary key, per attempt recorded. Measured in `make bench` (2026-12-02
-- 07:20, 07:45 and a run with auto_explain): the second drain of each run went at 300-410
-- events/s against 1,150-1,820 in the first, at 1.5-2.9 ms of PostgreSQL CPU per event
-- against 0.23-0.29; auto_explain showed `oncepay_webhook_record_many`'s UPDATE walking
-- webhook_deliveries_endpoint_idx over 13,154 pending rows to settle 16 (210,448 rows removed by
-- the join filter, 5,724 buffers, 113 ms). Written as "(state = 'pending') IS TRUE", the
-- condition means the same but proves nothing about a partial index's predicate, so the primary
-- key is the only way in (tests/api/webhooks.rs,
-- results_are_recorded_by_key_even_when_the_statistics_saw_an_empty_backlog: 2,000 index
-- fetches to record 16 deliveries before, within the test's bound of two per delivery after).

CREATE OR REPLACE FUNCTION oncepay_webhook_record(p_tenant uuid, p_event uuid, p_endpoint uuid, p_attempt int,
                                       p_started_at timestamptz, p_latency_ms int, p_status smallint,
                                       p_response_head text, p_error text, p_replica text,
                                       p_outcome text, p_next_attempt_at timestamptz)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_current boolean;
BEGIN
    INSERT INTO webhook_attempts (tenant_id, event_id, endpoint_id, attempt, started_at, latency_ms,
                                  status, response_head, error, replica)
    VALUES (p_tenant, p_event, p_endpoint, p_attempt, p_started_at, p_latency_ms, p_status,
            p_response_head, p_error, p_replica)
    ON CONFLICT DO NOTHING;
    IF p_outcome = 'delivered' THEN
        UPDATE webhook_deliveries d
           SET state = 'delivered', finished_at = now(), leased_until = NULL,
               last_status = p_status, last_error = NULL
         WHERE d.tenant_id = p_tenant AND d.event_id = p_event AND d.endpoint_id = p_endpoint
           AND (d.state = 'pending') IS TRUE;
        RETURN FOUND;
    END IF;
    UPDATE webhook_deliveries d
       SET leased_until = NULL, last_status = p_status, last_error = p_error,
           next_attempt_at = coalesce(p_next_attempt_at, now()),
           state = CASE WHEN p_outcome = 'retry' THEN 'pending' ELSE 'given_up' END,
           finished_at = CASE WHEN p_outcome = 'retry' THEN NULL ELSE now() END
     WHERE d.tenant_id = p_tenant AND d.event_id = p_event AND d.endpoint_id = p_endpoint
       AND (d.state = 'pending') IS TRUE AND d.attempts = p_attempt;
    v_current := FOUND;
    IF v_current AND p_outcome IN ('given_up', 'gone') THEN
        PERFORM oncepay_webhook_disable(p_tenant, p_endpoint,
            CASE WHEN p_outcome = 'gone' THEN 'gone' ELSE 'failing' END);
    END IF;
    RETURN v_current;
END
$$;

CREATE OR REPLACE FUNCTION oncepay_webhook_record_many(p_tenant uuid[], p_event uuid[], p_endpoint uuid[],
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
           AND d.endpoint_id = delivered.endpoint_id AND (d.state = 'pending') IS TRUE
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
