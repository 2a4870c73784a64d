CREATE OR REPLACE FUNCTION public.oncepay_webhook_record_results(p_tenant uuid[], p_event uuid[], p_endpoint uuid[], p_attempt integer[], p_started_at timestamp with time zone[], p_latency_ms integer[], p_status smallint[], p_response_head text[], p_error text[], p_replica text, p_outcome text[], p_next_attempt_at timestamp with time zone[], p_disable_after_secs integer)
 RETURNS TABLE(event_id uuid, endpoint_id uuid, applied boolean)
 LANGUAGE sql
AS $function$
    SELECT r.event_id, r.endpoint_id, r.applied
      FROM oncepay_webhook_record_results(p_tenant, p_event, p_endpoint, p_attempt, p_started_at, p_latency_ms,
                                          p_status, p_response_head, p_error, p_replica, p_outcome,
                                          p_next_attempt_at, p_disable_after_secs, 39617) r
     WHERE NOT r.disabled_for_failing
$function$


CREATE OR REPLACE FUNCTION public.oncepay_webhook_record_results(p_tenant uuid[], p_event uuid[], p_endpoint uuid[], p_attempt integer[], p_started_at timestamp with time zone[], p_latency_ms integer[], p_status smallint[], p_response_head text[], p_error text[], p_replica text, p_outcome text[], p_next_attempt_at timestamp with time zone[], p_disable_after_secs integer, p_pause_secs integer)
 RETURNS TABLE(tenant uuid, event_id uuid, endpoint_id uuid, applied boolean, disabled_for_failing boolean, gave_up boolean)
 LANGUAGE plpgsql
AS $function$
#variable_conflict use_column
DECLARE
    i int;
    v_current boolean[] := array_fill(false, ARRAY[cardinality(p_event)]);
    ep record;
    v_failing_since timestamptz;
    v_previous timestamptz;
    v_live boolean;
    v_gave_up boolean;
    v_resource text;
    v_sequence bigint;
    v_due timestamptz;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    INSERT INTO webhook_attempts (tenant_id, event_id, endpoint_id, attempt, started_at, latency_ms,
                                  status, response_head, error, replica)
    SELECT a.tenant_id, a.event_id, a.endpoint_id, a.attempt, a.started_at, a.latency_ms, a.status,
           a.response_head, a.error, p_replica
      FROM unnest(p_tenant, p_event, p_endpoint, p_attempt, p_started_at, p_latency_ms, p_status,
                  p_response_head, p_error, p_outcome)
           AS a(tenant_id, event_id, endpoint_id, attempt, started_at, latency_ms, status,
                response_head, error, outcome)
     WHERE a.outcome <> 'deferred'
       -- Its event still there, and kept there until this commits (the purge skips an event
       -- locked here; one the purge holds is waited for and then found gone).
       AND EXISTS (SELECT FROM webhook_events e
                    WHERE e.tenant_id = a.tenant_id AND e.event_id = a.event_id
                      FOR KEY SHARE)
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
    SELECT delivered.tenant_id, delivered.event_id, delivered.endpoint_id,
           EXISTS (SELECT FROM settled s
                    WHERE s.event_id = delivered.event_id AND s.endpoint_id = delivered.endpoint_id),
           false, false
      FROM delivered;
    IF 'delivered' = ANY (p_outcome) THEN
        -- A 2xx ends the endpoint's failing stretch (written only when there is one).
        UPDATE webhook_endpoints e SET failing_since = NULL
          FROM (SELECT DISTINCT u.tenant_id, u.endpoint_id
                  FROM unnest(p_tenant, p_endpoint, p_outcome) AS u(tenant_id, endpoint_id, outcome)
                 WHERE u.outcome = 'delivered') AS ok
         WHERE e.tenant_id = ok.tenant_id AND e.endpoint_id = ok.endpoint_id AND e.failing_since IS NOT NULL;
    END IF;
    IF p_outcome <@ ARRAY['delivered'] THEN
        RETURN;
    END IF;
    -- The rest in one order, so that two replicas recording overlapping attempts (a lease
    -- taken over) cannot wait on each other in a cycle.
    FOR i IN SELECT s.i FROM generate_subscripts(p_event, 1) AS s(i)
              WHERE p_outcome[s.i] <> 'delivered'
              ORDER BY p_tenant[s.i], p_event[s.i], p_endpoint[s.i]
    LOOP
        IF p_outcome[i] = 'deferred' THEN
            UPDATE webhook_deliveries d
               SET attempts = d.attempts - 1, leased_until = NULL,
                   schedule_start = least(d.schedule_start, d.attempts - 1),
                   next_attempt_at = coalesce(p_next_attempt_at[i], now())
             WHERE d.tenant_id = p_tenant[i] AND d.event_id = p_event[i] AND d.endpoint_id = p_endpoint[i]
               AND (d.state = 'pending') IS TRUE AND d.attempts = p_attempt[i]
            RETURNING d.resource_id, d.sequence, d.next_attempt_at INTO v_resource, v_sequence, v_due;
            v_gave_up := false;
        ELSE
            -- schedule_start at or past this attempt: a recovery restarted the schedule while
            -- it was out, so its failure is the end of nothing: the delivery goes again now.
            UPDATE webhook_deliveries d
               SET leased_until = NULL, last_status = p_status[i], last_error = p_error[i],
                   next_attempt_at = CASE WHEN d.schedule_start >= p_attempt[i] THEN now()
                                          ELSE coalesce(p_next_attempt_at[i], now()) END,
                   state = CASE WHEN p_outcome[i] = 'given_up' AND d.schedule_start < p_attempt[i]
                                THEN 'given_up' ELSE 'pending' END,
                   finished_at = CASE WHEN p_outcome[i] = 'given_up' AND d.schedule_start < p_attempt[i]
                                      THEN now() END
             WHERE d.tenant_id = p_tenant[i] AND d.event_id = p_event[i] AND d.endpoint_id = p_endpoint[i]
               AND (d.state = 'pending') IS TRUE AND d.attempts = p_attempt[i]
            RETURNING d.state = 'given_up', d.resource_id, d.sequence,
                      CASE WHEN d.state = 'pending' THEN d.next_attempt_at END
                 INTO v_gave_up, v_resource, v_sequence, v_due;
        END IF;
        v_current[i] := FOUND;
        IF v_current[i] AND v_due IS NOT NULL THEN
            PERFORM oncepay_webhook_due_behind(p_tenant[i], p_endpoint[i], ARRAY[v_resource],
                                               ARRAY[v_sequence], v_due);
        END IF;
        tenant := p_tenant[i];
        event_id := p_event[i];
        endpoint_id := p_endpoint[i];
        applied := v_current[i];
        disabled_for_failing := false;
        gave_up := coalesce(v_gave_up, false);
        RETURN NEXT;
    END LOOP;
    -- The endpoints' failures, one endpoint at a time in key order. A stale attempt's failure
    -- is not counted (its lease was taken over: its delivery is being tried again).
    FOR ep IN
        SELECT u.tenant_id, u.endpoint_id,
               bool_or(u.outcome = 'delivered') AS succeeded,
               bool_or(u.outcome = 'gone' AND u.current) AS gone,
               min(u.started_at) FILTER (WHERE u.outcome IN ('retry', 'given_up') AND u.current) AS failed_at
          FROM unnest(p_tenant, p_endpoint, p_outcome, p_started_at, v_current)
               AS u(tenant_id, endpoint_id, outcome, started_at, current)
         GROUP BY u.tenant_id, u.endpoint_id
         ORDER BY u.tenant_id, u.endpoint_id
    LOOP
        IF ep.gone THEN
            PERFORM oncepay_webhook_disable(ep.tenant_id, ep.endpoint_id, 'gone');
        ELSIF NOT ep.succeeded AND ep.failed_at IS NOT NULL THEN
            SELECT e.failing_since INTO v_failing_since FROM webhook_endpoints e
             WHERE e.tenant_id = ep.tenant_id AND e.endpoint_id = ep.endpoint_id
               AND e.disabled_at IS NULL AND e.deleted_at IS NULL;
            v_live := FOUND;
            IF v_live AND v_failing_since IS NOT NULL THEN
                -- The attempt before this call's first failure (webhook_attempts_list_idx):
                -- none for longer than the pause, and nothing was being retried in between.
                SELECT max(a.started_at) INTO v_previous FROM webhook_attempts a
                 WHERE a.tenant_id = ep.tenant_id AND a.endpoint_id = ep.endpoint_id
                   AND a.started_at < ep.failed_at;
                IF v_previous IS NULL OR v_previous < ep.failed_at - make_interval(secs => p_pause_secs) THEN
                    v_failing_since := NULL;
                END IF;
            END IF;
            IF NOT v_live THEN
                NULL;  -- disabled or deleted meanwhile: nothing to judge
            ELSIF v_failing_since IS NULL THEN
                UPDATE webhook_endpoints e SET failing_since = ep.failed_at
                 WHERE e.tenant_id = ep.tenant_id AND e.endpoint_id = ep.endpoint_id
                   AND e.disabled_at IS NULL AND e.deleted_at IS NULL;
            ELSIF v_failing_since <= now() - make_interval(secs => p_disable_after_secs) THEN
                PERFORM oncepay_webhook_disable(ep.tenant_id, ep.endpoint_id, 'failing');
                tenant := ep.tenant_id;
                event_id := NULL;
                endpoint_id := ep.endpoint_id;
                applied := false;
                disabled_for_failing := true;
                gave_up := false;
                RETURN NEXT;
            END IF;
        END IF;
    END LOOP;
END
$function$


