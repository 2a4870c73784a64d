-- A recovery no longer runs as one transaction whose length grows with the outage (found
-- from outside, 2026-12-07: about 30,000 deliveries a second; one of 480,010 deliveries, an
-- endpoint down four days, hit the 15 s statement timeout on every try; one of 228,591 held
-- its rows and its endpoint for 7.1 s, while the results of every tenant's attempts, recorded
-- in one statement a batch, waited for it: other tenants' webhooks lagged 3-15 s).
--
-- The request now does its work in slices, each a statement (a transaction) of its own of
-- at most a given number of deliveries (`ONCEPAY_WEBHOOK_RECOVERY_SLICE`), before the keyed
-- transaction, which does what is left (those that changed meanwhile) and stores the answer
-- with the total. First the deliveries given up or cancelled are reopened, oldest first (a
-- resource's earlier event is never left given up behind its later one reopened: the claim
-- would send the later one first), then those waiting for a retry are made due, in the order
-- they were due. A delivery reopened or made due is due now, behind it in its resource's order
-- the later ones of that resource still pending: those due earlier (a refund retried while its
-- payment was given up or waited for a retry) are made due now too, so that in the claim's order (due time, then sequence,
-- V50) they stand after it, not before it as deliveries no claim can take (found from outside:
-- 6,670 such refunds at the head of a recovered endpoint's due deliveries were read by every
-- claim, 74 ms and 28,413 buffers a claim for 16 deliveries, and the endpoint drained at
-- 300-360 deliveries a second where V49's claim, in sequence order, drained 1,680).
-- A slice changes what the keyed transaction would have changed, the same way:
-- run twice (a retry after a failure part-way, or two requests with one key at once) it finds
-- those rows done and changes nothing more. What a keyed request's slices changed is added up
-- under its key and fingerprint (`webhook_recovery_progress`), in each slice's transaction,
-- and taken into the total by the keyed transaction: a retry after a failure part-way (a
-- client that gave up waiting: the CLI waits 10 s an attempt, and a recovery of 480,000
-- deliveries takes longer) answers the whole count, not what was left for it. A request
-- whose key is stored already runs no slice (src/webhooks/recovery.rs), so a replay changes
-- nothing. Progress no keyed transaction took (its request never came back) is purged with
-- the recoveries, after the events' retention (src/purge.rs).
--
-- The keyed transaction locks, before its endpoint, the pending deliveries its update may
-- change: those not due and those leased (an attempt out, whose record may hold them). It
-- locked every pending delivery since the time asked for, which after the slices were all of
-- them (all due now): the transaction the slices exist to keep short. A leased delivery whose
-- lease ran out is still locked: its record may be in progress (V35).
--
-- Replicas of the previous version call the keyed function with four arguments: kept, doing
-- the whole recovery in one transaction as before.

CREATE TABLE webhook_recovery_progress (
    tenant_id uuid NOT NULL,
    idempotency_key text NOT NULL,
    fingerprint bytea NOT NULL,
    deliveries bigint NOT NULL,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, idempotency_key, fingerprint)
);
COMMENT ON TABLE webhook_recovery_progress IS 'what the slices of a keyed recovery not finished yet changed (V51): taken by its keyed transaction, purged with the recoveries otherwise';

-- Adds a slice's count to its request's progress (`p_key` NULL: a keyless request, none).
CREATE FUNCTION oncepay_recover_webhook_progress(p_tenant uuid, p_key text, p_fingerprint bytea, p_changed int)
RETURNS void
LANGUAGE sql
AS $$
    INSERT INTO webhook_recovery_progress AS g (tenant_id, idempotency_key, fingerprint, deliveries, updated_at)
    SELECT p_tenant, p_key, p_fingerprint, p_changed, now()
     WHERE p_key IS NOT NULL AND p_fingerprint IS NOT NULL AND p_changed > 0
    ON CONFLICT (tenant_id, idempotency_key, fingerprint)
    DO UPDATE SET deliveries = g.deliveries + EXCLUDED.deliveries, updated_at = EXCLUDED.updated_at
$$;

-- Reopens the endpoint's given-up and cancelled deliveries created from `p_from`, after
-- `p_after` and up to `p_until` (NULL: no bound) that were never acknowledged, `held` for a
-- disabled endpoint; a delivery reopened is due now, and behind it in its resource's order the
-- later ones of that resource still pending and due earlier are made due now too (see above).
-- Gives how many it reopened. For the slices and the keyed transaction alike.
CREATE FUNCTION oncepay_recover_webhook_reopen_rows(p_tenant uuid, p_endpoint uuid, p_disabled boolean,
                                                    p_from timestamptz, p_after timestamptz, p_until timestamptz)
RETURNS int
LANGUAGE sql
SET enable_seqscan = off
AS $$
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
    pushed AS (
        UPDATE webhook_deliveries s SET next_attempt_at = now()
          FROM (SELECT r.resource_id, min(r.sequence) AS sequence FROM reopened r
                 WHERE r.state = 'pending' GROUP BY r.resource_id) r
         WHERE s.tenant_id = p_tenant AND s.endpoint_id = p_endpoint AND s.resource_id = r.resource_id
           AND s.sequence > r.sequence AND s.finished_at IS NULL AND s.state = 'pending'
           AND s.leased_until IS NULL AND s.next_attempt_at < now())
    SELECT count(*)::int FROM reopened;
$$;

-- Reopens the endpoint's given-up and cancelled deliveries created since `p_since` and after
-- `p_after` (the previous slice's last creation time; NULL on the first), at least `p_limit`
-- of them if there are as many (every delivery of the last creation time goes in one slice),
-- as the keyed function does. `last_created`: where the next slice starts; NULL when this
-- slice reached the end. `known`: false for no such endpoint of the tenant's (or deleted).
CREATE FUNCTION oncepay_recover_webhook_reopen(p_tenant uuid, p_endpoint uuid, p_since timestamptz,
                                               p_after timestamptz, p_limit int, p_key text, p_fingerprint bytea)
RETURNS TABLE (known boolean, changed int, last_created timestamptz)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    ep webhook_endpoints;
    v_from timestamptz := greatest(p_since, p_after);
    v_until timestamptz;
BEGIN
    SELECT e.* INTO ep FROM webhook_endpoints e
     WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint AND e.deleted_at IS NULL
       FOR SHARE;
    IF NOT FOUND THEN
        known := false; changed := 0; last_created := NULL;
        RETURN NEXT;
        RETURN;
    END IF;
    -- The slice's last creation time: that of its `p_limit`-th delivery.
    SELECT d.created_at INTO v_until FROM webhook_deliveries d
     WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint
       AND d.state IN ('given_up', 'cancelled') AND d.created_at >= v_from
       AND (p_after IS NULL OR d.created_at > p_after)
     ORDER BY d.created_at
    OFFSET p_limit - 1 LIMIT 1;
    changed := oncepay_recover_webhook_reopen_rows(p_tenant, p_endpoint, ep.disabled_at IS NOT NULL,
                                                    v_from, p_after, v_until);
    PERFORM oncepay_recover_webhook_progress(p_tenant, p_key, p_fingerprint, changed);
    known := true; last_created := v_until;
    RETURN NEXT;
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
-- there were). `last_at`/`last_sequence`: where the next slice starts; NULL when this slice
-- reached the end.
CREATE FUNCTION oncepay_recover_webhook_reschedule(p_tenant uuid, p_endpoint uuid, p_since timestamptz,
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
    pushed AS (
        UPDATE webhook_deliveries s SET next_attempt_at = now()
          FROM (SELECT r.resource_id, min(r.sequence) AS sequence FROM due r GROUP BY r.resource_id) r
         WHERE s.tenant_id = p_tenant AND s.endpoint_id = p_endpoint AND s.resource_id = r.resource_id
           AND s.sequence > r.sequence AND s.finished_at IS NULL AND s.state = 'pending'
           AND s.leased_until IS NULL AND s.next_attempt_at < now())
    SELECT count(*)::int INTO changed FROM due;
    PERFORM oncepay_recover_webhook_progress(p_tenant, p_key, p_fingerprint, changed);
    RETURN NEXT;
END
$$;

-- The keyed transaction: what the slices left, and the answer, with its key's progress and
-- `p_prior` (what a keyless request's slices changed) in its count.
CREATE FUNCTION oncepay_recover_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid,
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
            -- just restarted (by a slice, or another recovery at once): counted once.
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
               AND d.schedule_start < d.attempts;
            GET DIAGNOSTICS v_due = ROW_COUNT;
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
