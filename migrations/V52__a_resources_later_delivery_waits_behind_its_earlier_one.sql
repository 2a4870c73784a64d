-- A resource's later webhook delivery waits behind its earlier one in the claim's order, in the
-- steady state too (found from outside, 2026-12-07: an endpoint down for days had 6,670
-- refunds due for hours, each behind its payment waiting for a retry; the claim, in due order
-- since V50, read all of them every time to take none: 34 ms a claim in the steady state, 74
-- ms after a recovery, which V51 mended for recoveries only).
--
-- The rule: a pending delivery not leased is never due before its resource's earlier pending
-- delivery to the same endpoint that waits for a retry; one not failing on its own (no
-- attempt since its schedule started) is due when that one is. Kept where a due time moves:
-- - the fan-out writes a delivery due at the latest due time of its resource's earlier
--   pending deliveries not leased, or now;
-- - a record that leaves a delivery pending (a failure to retry, a deferral) moves the later
--   ones of its resource with it;
-- - a recovery or a resend that makes a delivery due now brings the later ones of its
--   resource that waited only for it (they would otherwise wait for its old retry time
--   after it is delivered), and those due earlier behind it, as V51 did for recoveries.
-- One with an attempt out (leased) is passed: it is likely to succeed, and if it fails its
-- record moves the rest. The claim is unchanged: it still takes only the first unfinished
-- delivery of a resource, and a delivery behind one in flight is read until that one's record.
-- `oncepay_webhook_due_behind` does the moving, by the resource index, in PL/pgSQL with one
-- generic plan, so that its statement is planned once a session (as a SQL function, or with
-- custom plans, it was planned at every call: 0.3-1 ms of each failure's record, seen before
-- release). Its look-ups, and the fan-out's, ask for a pending delivery as `finished_at IS
-- NULL` (the same, by the table's check), never as `state = 'pending'`, so that the resource
-- index is the only one the planner can take: with `state = 'pending'`, on the statistics of
-- a small table, it took the due index (backwards, for the fan-out's max) and read the
-- endpoint's whole backlog for each delivery (seen before release: 40 rounds of 500 payments
-- whose attempts all fail, 150 of them refunded while out, ran over 10 minutes, cancelled).
--
-- Measured here with psql on two databases, one at V51, one at this version, each built by
-- those 40 rounds through these functions (20,000 payments waiting for a retry, 6,000 refunds
-- behind them): the rounds took 4.5 s under V51 and 5.8 s now (the records' moves); a claim
-- that finds nothing due took 24-28 ms under V51 (every refund read) and 0.7-0.8 ms now, in
-- three alternated runs of 20.
--
-- The keyed recovery also no longer restarts, nor counts, an attempt out on its schedule's first
-- step: one that its own slice had reopened, taken by a deliverer before the keyed
-- transaction, was counted twice (seen in `make test`, one run in three: 20 of 16).
--
-- Deliveries already stored against the rule are put behind once, below: one statement over
-- the pending deliveries waiting for a retry (2.7 s here for 220,000 pending deliveries of one
-- endpoint, 20,000 refunds among them behind their payments; the rows it changes are locked
-- until the migration commits, and claims skip them meanwhile). Replicas of the
-- previous version keep writing fan-outs due now, and their records do not move the later
-- ones: a claim reads such rows as before until every replica runs this version.

CREATE FUNCTION oncepay_webhook_due_behind(p_tenant uuid, p_endpoint uuid, p_resources text[],
                                           p_sequences bigint[], p_due timestamptz)
RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
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
$$;

-- V15's fan-out: an event goes to every endpoint not deleted, subscribed to its type, created
-- before it in the events' sequence; a disabled endpoint's delivery is written held. Due now,
-- or when its resource's earlier delivery waiting for a retry is (see the header): by the
-- resource index, a lookup that finds nothing for a resource's first event.
CREATE OR REPLACE FUNCTION oncepay_webhook_fan_out(p_limit int)
RETURNS int
LANGUAGE plpgsql AS $$
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
$$;

-- V36's record; a delivery it leaves pending moves the later ones of its resource with it
-- (see the header).
CREATE OR REPLACE FUNCTION oncepay_webhook_record_results(p_tenant uuid[], p_event uuid[], p_endpoint uuid[],
                                               p_attempt int[], p_started_at timestamptz[],
                                               p_latency_ms int[], p_status smallint[],
                                               p_response_head text[], p_error text[], p_replica text,
                                               p_outcome text[], p_next_attempt_at timestamptz[],
                                               p_disable_after_secs int, p_pause_secs int)
RETURNS TABLE (tenant uuid, event_id uuid, endpoint_id uuid, applied boolean, disabled_for_failing boolean,
               gave_up boolean)
LANGUAGE plpgsql AS $$
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
$$;

-- Reopens the endpoint's given-up and cancelled deliveries created from `p_from`, after
-- `p_after` and up to `p_until` (NULL: no bound) that were never acknowledged, `held` for a
-- disabled endpoint; a delivery reopened is due now, the later ones of its resource behind it
-- (see the header). Gives how many it reopened. For the slices and the keyed transaction
-- alike.
CREATE OR REPLACE FUNCTION oncepay_recover_webhook_reopen_rows(p_tenant uuid, p_endpoint uuid, p_disabled boolean,
                                                    p_from timestamptz, p_after timestamptz, p_until timestamptz)
RETURNS int
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    v_resources text[];
    v_sequences bigint[];
    v_n int;
BEGIN
    WITH reopened AS (
        UPDATE webhook_deliveries d
           SET state = CASE WHEN p_disabled THEN 'held' ELSE 'pending' END,
               finished_at = CASE WHEN p_disabled THEN now() END,
               next_attempt_at = now(), leased_until = NULL, schedule_start = d.attempts
         WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint
           AND d.state IN ('given_up', 'cancelled') AND d.created_at >= p_from
           AND (p_after IS NULL OR d.created_at > p_after)
           AND (p_until IS NULL OR d.created_at <= p_until)
           AND NOT EXISTS (SELECT FROM webhook_attempts a
                            WHERE a.tenant_id = d.tenant_id AND a.event_id = d.event_id
                              AND a.endpoint_id = d.endpoint_id AND a.status BETWEEN 200 AND 299)
        RETURNING d.resource_id, d.sequence, d.state),
    firsts AS (
        SELECT r.resource_id, min(r.sequence) AS sequence FROM reopened r
         WHERE r.state = 'pending' GROUP BY r.resource_id)
    SELECT (SELECT count(*)::int FROM reopened), array_agg(f.resource_id), array_agg(f.sequence)
      INTO v_n, v_resources, v_sequences
      FROM firsts f;
    PERFORM oncepay_webhook_due_behind(p_tenant, p_endpoint, v_resources, v_sequences, now());
    RETURN v_n;
END
$$;

-- Makes due, as the keyed function does, the endpoint's pending deliveries created since
-- `p_since` that wait for a retry: at most `p_limit` of those due after (`p_after_at`,
-- `p_after_sequence`) (the previous slice's last; NULL on the first), in the order they were
-- due, their locks taken first in the order a record takes them. One with an attempt out
-- (leased) is left to the keyed transaction, which restarts its schedule under that attempt
-- (V33) and counts it: counted here too, it was counted twice. One whose schedule was just
-- restarted (`schedule_start` = `attempts`: no attempt since) is not changed again: a slice of
-- another request that began later and committed first set it due at its own start, later
-- than this one's `now()`, and it was counted twice (found from outside: a retry sent while
-- its first request still ran, both requests' slices at once, answered 1,835 more than
-- there were). The later deliveries of their resources come behind them (see the header).
-- `last_at`/`last_sequence`: where the next slice starts; NULL when this slice reached the end.
CREATE OR REPLACE FUNCTION oncepay_recover_webhook_reschedule(p_tenant uuid, p_endpoint uuid, p_since timestamptz,
                                                   p_after_at timestamptz, p_after_sequence bigint, p_limit int,
                                                   p_key text, p_fingerprint bytea)
RETURNS TABLE (changed int, last_at timestamptz, last_sequence bigint)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_events uuid[];
    v_seen int;
    v_resources text[];
    v_sequences bigint[];
BEGIN
    SELECT array_agg(s.event_id) FILTER (WHERE s.created_at >= p_since AND NOT s.leased), count(*),
           (array_agg(s.next_attempt_at ORDER BY s.next_attempt_at DESC, s.sequence DESC))[1],
           (array_agg(s.sequence ORDER BY s.next_attempt_at DESC, s.sequence DESC))[1]
      INTO v_events, v_seen, last_at, last_sequence
      FROM (SELECT d.event_id, d.created_at, d.next_attempt_at, d.sequence,
                   coalesce(d.leased_until > now(), false) AS leased
              FROM webhook_deliveries d
             WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'pending'
               AND d.next_attempt_at > now()
               AND (d.next_attempt_at, d.sequence) > (coalesce(p_after_at, '-infinity'), coalesce(p_after_sequence, 0))
             ORDER BY d.next_attempt_at, d.sequence
             LIMIT p_limit) s;
    IF v_seen < p_limit THEN
        last_at := NULL; last_sequence := NULL;
    END IF;
    PERFORM FROM webhook_deliveries w
      WHERE w.tenant_id = p_tenant AND w.event_id = ANY (v_events) AND w.endpoint_id = p_endpoint
      ORDER BY w.tenant_id, w.event_id, w.endpoint_id
        FOR UPDATE OF w;
    WITH due AS (
        UPDATE webhook_deliveries d
           SET next_attempt_at = now(), schedule_start = d.attempts
         WHERE d.tenant_id = p_tenant AND d.event_id = ANY (v_events) AND d.endpoint_id = p_endpoint
           AND d.state = 'pending' AND d.next_attempt_at > now() AND NOT coalesce(d.leased_until > now(), false)
           AND d.schedule_start < d.attempts
        RETURNING d.resource_id, d.sequence),
    firsts AS (
        SELECT r.resource_id, min(r.sequence) AS sequence FROM due r GROUP BY r.resource_id)
    SELECT (SELECT count(*)::int FROM due), array_agg(f.resource_id), array_agg(f.sequence)
      INTO changed, v_resources, v_sequences
      FROM firsts f;
    PERFORM oncepay_webhook_due_behind(p_tenant, p_endpoint, v_resources, v_sequences, now());
    PERFORM oncepay_recover_webhook_progress(p_tenant, p_key, p_fingerprint, changed);
    RETURN NEXT;
END
$$;

-- The keyed transaction: what the slices left, and the answer, with its key's progress and
-- `p_prior` (what a keyless request's slices changed) in its count.
CREATE OR REPLACE FUNCTION oncepay_recover_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid,
                                                 p_since timestamptz, p_prior int)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource webhook_recoveries)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
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
$$;

-- POST /webhook-endpoints/{id}/events/{event_id}/resend: one more delivery of the event to the
-- endpoint, due now, with a new retry schedule (see the header). A delivery already pending is
-- made due now; one whose attempt is out is refused as in progress (above); one held (the
-- endpoint disabled) stays held. A delivery made due brings the later ones of its resource
-- behind it (see the header).
-- An event not fanned out yet, which the endpoint will receive, needs nothing. Any other event
-- (unknown, another tenant's, one the endpoint does not receive), or an unknown or deleted
-- endpoint: not_found. The key's resource is the event.
CREATE OR REPLACE FUNCTION oncepay_resend_webhook_event(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid,
                                                        p_event uuid)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz, resource uuid)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_event::text);
    ep webhook_endpoints;
    d webhook_deliveries;
    ev webhook_events;
BEGIN
    IF c.outcome = 'created' THEN
        SELECT e.* INTO ep FROM webhook_endpoints e
         WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint AND e.deleted_at IS NULL
           FOR SHARE;
        IF FOUND THEN
            SELECT w.* INTO d FROM webhook_deliveries w
             WHERE w.tenant_id = p_tenant AND w.event_id = p_event AND w.endpoint_id = p_endpoint
               FOR UPDATE NOWAIT;
            IF FOUND THEN
                IF d.state IN ('delivered', 'given_up', 'cancelled') THEN
                    UPDATE webhook_deliveries w
                       SET state = CASE WHEN ep.disabled_at IS NULL THEN 'pending' ELSE 'held' END,
                           finished_at = CASE WHEN ep.disabled_at IS NULL THEN NULL ELSE now() END,
                           next_attempt_at = now(), leased_until = NULL, schedule_start = w.attempts
                     WHERE w.tenant_id = p_tenant AND w.event_id = p_event AND w.endpoint_id = p_endpoint;
                ELSIF d.state = 'pending' AND (d.leased_until IS NULL OR d.leased_until <= now()) THEN
                    UPDATE webhook_deliveries w SET next_attempt_at = now(), schedule_start = w.attempts
                     WHERE w.tenant_id = p_tenant AND w.event_id = p_event AND w.endpoint_id = p_endpoint;
                    PERFORM oncepay_webhook_due_behind(p_tenant, p_endpoint, ARRAY[d.resource_id],
                                                       ARRAY[d.sequence], now());
                ELSIF d.state = 'pending' THEN
                    RAISE EXCEPTION 'an attempt of this event to this endpoint is out; resend once it is settled'
                        USING ERRCODE = 'lock_not_available';
                END IF;
            ELSE
                SELECT e.* INTO ev FROM webhook_events e WHERE e.tenant_id = p_tenant AND e.event_id = p_event;
                IF NOT (FOUND AND ev.awaiting_fan_out IS TRUE
                        AND (ep.created_sequence IS NULL OR ep.created_sequence < ev.sequence)
                        AND (ep.event_types IS NULL OR ev.event_type = ANY (ep.event_types))) THEN
                    c := oncepay_decline(p_tenant, p, 'not_found');
                END IF;
            END IF;
        ELSE
            c := oncepay_decline(p_tenant, p, 'not_found');
        END IF;
        IF c.outcome = 'created' THEN
            resource := p_event;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        resource := c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;


-- Deliveries stored against the rule: put behind the first unfinished delivery of their
-- resource when it waits for a retry.
UPDATE webhook_deliveries s SET next_attempt_at = h.next_attempt_at
  FROM webhook_deliveries h
 WHERE h.state = 'pending' AND h.leased_until IS NULL AND h.next_attempt_at > now()
   AND h.sequence = (SELECT min(o.sequence) FROM webhook_deliveries o
                      WHERE o.tenant_id = h.tenant_id AND o.endpoint_id = h.endpoint_id
                        AND o.resource_id = h.resource_id AND o.finished_at IS NULL)
   AND s.tenant_id = h.tenant_id AND s.endpoint_id = h.endpoint_id AND s.resource_id = h.resource_id
   AND s.sequence > h.sequence AND s.finished_at IS NULL AND s.leased_until IS NULL
   AND s.next_attempt_at < h.next_attempt_at;
