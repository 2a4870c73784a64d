-- Lists, the event log, delivery attempts, resend and recover (issue 39, contract section 4d).
--
-- 1. Every list reads one index in its order. A list is ordered by (created_at, id), newest
--    first, and pages by the (created_at, id) of an item it answered (the cursor is that
--    item's id, looked up within the tenant): one index descent and as many entries as the
--    page holds, however deep the page. Rows written while a client pages land before the
--    first page or, committed late with an earlier created_at, once in a later page: a row
--    that existed when the paging began is answered exactly once. Each index below serves one
--    list (or one of its filters); each costs the rows' inserts one entry, which is why the
--    other filters (a payment's status, an event's type, an attempt's outcome) are conditions
--    on the list's index rather than indexes of their own. The purge of events goes through
--    their list index too, tenant by tenant (src/purge.rs): no index on created_at alone.
--
--    Built with CREATE INDEX (a migration runs in one transaction, where CREATE INDEX
--    CONCURRENTLY is refused): the table's writes wait while its index is built. On a large
--    table build them beforehand with CREATE INDEX CONCURRENTLY under the same names
--    (docs/operations.md gives the statements): IF NOT EXISTS then skips them. A concurrent
--    build that failed leaves an invalid index of that name, which IF NOT EXISTS would skip
--    too: the check below refuses to go on while one is there.
--
-- 2. Events are kept ONCEPAY_EVENT_RETENTION_DAYS, delivered or not, and their deliveries and
--    attempts with them: the purge no longer deletes a delivery a key retention after it
--    finished, so "never received" (recover) and the attempts list can be answered for as long
--    as the event is kept. A delivery still held or pending when its event is purged goes with
--    it (logged and counted by the purge).
--
-- 3. Resend and recover reopen a delivery: its row goes back to pending (held for a disabled
--    endpoint) with its own sequence, so it is sent in its place among its resource's events
--    that are not yet delivered (the claim takes a resource's unfinished delivery of lowest
--    sequence first), with its event's id as webhook-id. schedule_start keeps the attempts made
--    before the reopening: attempt numbers go on (an attempt row's key), the retry schedule
--    starts again. The claim returns the attempt's place in the schedule
--    (oncepay_webhook_claim_scheduled); the previous version's claim, same signature, wraps it
--    and answers the attempt number alone: a replica of that version gives up a reopened
--    delivery after one failed attempt, until it is replaced. Enabling an endpoint now
--    restarts its held deliveries' schedule too.
--
--    Both are operations of the table (their key claimed in the same transaction as the
--    reopening). They lock the endpoint's row in share mode first, so that enabling, disabling
--    or deleting it cannot interleave, then the deliveries: a delivery being recorded right now
--    is not waited for (a resend: NOWAIT, 55P03, the request answered 409 and retried; a
--    recover: its pending rows SKIP LOCKED, they are being attempted anyway), so that no
--    record, which locks deliveries then the endpoint, waits on them in a cycle.

ALTER TYPE oncepay_operation ADD VALUE IF NOT EXISTS 'resend_webhook_event';
ALTER TYPE oncepay_operation ADD VALUE IF NOT EXISTS 'recover_webhook_endpoint';

DO $$
DECLARE
    v_invalid text;
BEGIN
    SELECT string_agg(c.relname, ', ') INTO v_invalid
      FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
     WHERE NOT i.indisvalid
       AND c.relname IN ('payments_list_idx', 'payments_account_list_idx', 'transfers_list_idx',
                         'transfers_from_list_idx', 'transfers_to_list_idx', 'top_ups_list_idx',
                         'accounts_list_idx', 'webhook_events_list_idx', 'webhook_attempts_list_idx',
                         'webhook_deliveries_failed_idx');
    IF v_invalid IS NOT NULL THEN
        RAISE EXCEPTION 'invalid index % (a CREATE INDEX CONCURRENTLY that failed): DROP INDEX it, then migrate again',
            v_invalid;
    END IF;
END
$$;

CREATE INDEX IF NOT EXISTS payments_list_idx ON payments (tenant_id, created_at, payment_id);
CREATE INDEX IF NOT EXISTS payments_account_list_idx ON payments (tenant_id, account_id, created_at, payment_id);
CREATE INDEX IF NOT EXISTS transfers_list_idx ON transfers (tenant_id, created_at, transfer_id);
-- A transfer of an account is on either side: the list merges these two.
CREATE INDEX IF NOT EXISTS transfers_from_list_idx ON transfers (tenant_id, from_account_id, created_at, transfer_id);
CREATE INDEX IF NOT EXISTS transfers_to_list_idx ON transfers (tenant_id, to_account_id, created_at, transfer_id);
CREATE INDEX IF NOT EXISTS top_ups_list_idx ON top_ups (tenant_id, created_at, top_up_id);
CREATE INDEX IF NOT EXISTS accounts_list_idx ON accounts (tenant_id, created_at, account_id);
CREATE INDEX IF NOT EXISTS webhook_events_list_idx ON webhook_events (tenant_id, created_at, event_id);
-- An endpoint's attempts, newest first; an attempt's id is its event's and its number.
CREATE INDEX IF NOT EXISTS webhook_attempts_list_idx
    ON webhook_attempts (tenant_id, endpoint_id, started_at, event_id, attempt);
-- Recover: an endpoint's deliveries that ended without a 2xx, by their event's time (few).
CREATE INDEX IF NOT EXISTS webhook_deliveries_failed_idx ON webhook_deliveries (tenant_id, endpoint_id, created_at)
    WHERE state IN ('given_up', 'cancelled');

ALTER TABLE webhook_deliveries ADD COLUMN schedule_start int NOT NULL DEFAULT 0;
COMMENT ON COLUMN webhook_deliveries.schedule_start IS
    'attempts made before the delivery was last reopened (resend, recover, enable): its retry schedule starts again after them';

-- One row per POST /webhook-endpoints/{id}/recover that was processed: what it made due again
-- (its answer, replayed from here). Purged with the events.
CREATE TABLE webhook_recoveries (
    tenant_id       uuid        NOT NULL,
    recovery_id     uuid        NOT NULL,
    endpoint_id     uuid        NOT NULL,
    since           timestamptz NOT NULL,
    deliveries      int         NOT NULL,
    idempotency_key text,
    created_at      timestamptz NOT NULL,
    CONSTRAINT webhook_recoveries_pkey PRIMARY KEY (tenant_id, recovery_id)
);
CREATE INDEX webhook_recoveries_created_idx ON webhook_recoveries (created_at);

-- V22's claim, answering also the attempt's place in the retry schedule (1 for the first
-- attempt after a reopening).
CREATE FUNCTION oncepay_webhook_claim_scheduled(p_limit int, p_per_endpoint int, p_lease_ms int, p_fan_out boolean,
                                                p_tenants uuid[], p_tenant_rooms int[], p_room int)
RETURNS TABLE (tenant_id uuid, event_id uuid, endpoint_id uuid, attempt int, url text,
               secret_encrypted bytea, previous_secret_encrypted bytea, event_type text,
               data jsonb, created_at timestamptz, schedule_attempt int)
LANGUAGE plpgsql AS $$
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

-- The previous version's claim, same signature: the same claim, without the schedule's place.
CREATE OR REPLACE FUNCTION oncepay_webhook_claim(p_limit int, p_per_endpoint int, p_lease_ms int, p_fan_out boolean,
                                                 p_tenants uuid[], p_tenant_rooms int[], p_room int)
RETURNS TABLE (tenant_id uuid, event_id uuid, endpoint_id uuid, attempt int, url text,
               secret_encrypted bytea, previous_secret_encrypted bytea, event_type text,
               data jsonb, created_at timestamptz)
LANGUAGE sql AS $$
    SELECT c.tenant_id, c.event_id, c.endpoint_id, c.attempt, c.url, c.secret_encrypted,
           c.previous_secret_encrypted, c.event_type, c.data, c.created_at
      FROM oncepay_webhook_claim_scheduled(p_limit, p_per_endpoint, p_lease_ms, p_fan_out, p_tenants,
                                           p_tenant_rooms, p_room) AS c
$$;

-- V22's enabling, same signature; the held deliveries start their retry schedule again.
CREATE OR REPLACE FUNCTION oncepay_enable_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource webhook_endpoints)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_endpoint::text);
BEGIN
    IF c.outcome = 'created' THEN
        UPDATE webhook_endpoints r
           SET disabled_at = NULL, disabled_reason = NULL, failing_since = NULL
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = p_endpoint AND r.deleted_at IS NULL
        RETURNING r.* INTO resource;
        IF NOT FOUND THEN
            resource := NULL;
            c := oncepay_decline(p_tenant, p, 'not_found');
        ELSE
            UPDATE webhook_deliveries d
               SET state = 'pending', finished_at = NULL, next_attempt_at = now(), schedule_start = d.attempts
             WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'held';
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM webhook_endpoints r
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

-- POST /webhook-endpoints/{id}/events/{event_id}/resend: one more delivery of the event to the
-- endpoint, due now, with a new retry schedule (see the header). A delivery already pending is
-- made due now (unless an attempt of it is out); one held (the endpoint disabled) stays held.
-- An event not fanned out yet, which the endpoint will receive, needs nothing. Any other event
-- (unknown, another tenant's, one the endpoint does not receive), or an unknown or deleted
-- endpoint: not_found. The key's resource is the event.
CREATE FUNCTION oncepay_resend_webhook_event(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid, p_event uuid)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz, resource uuid)
LANGUAGE plpgsql AS $$
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

-- POST /webhook-endpoints/{id}/recover: every event since p_since that the endpoint was given
-- (a delivery row: subscribed, created after the endpoint) and that never got a 2xx is made due
-- now with a new retry schedule: a delivery given up or cancelled is reopened (held for a
-- disabled endpoint), one still pending and waiting for its next attempt is due now. The
-- answer is the recovery's row, with the number of deliveries it made due.
CREATE FUNCTION oncepay_recover_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid,
                                                 p_since timestamptz)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource webhook_recoveries)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
    ep webhook_endpoints;
    v_reopened int;
    v_due int;
BEGIN
    IF c.outcome = 'created' THEN
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
            -- By row address, the rows locked first: an attempt out now is not waited for.
            UPDATE webhook_deliveries d SET next_attempt_at = now(), schedule_start = d.attempts
             WHERE d.ctid = ANY (ARRAY(
                       SELECT w.ctid FROM webhook_deliveries w
                        WHERE w.tenant_id = p_tenant AND w.endpoint_id = p_endpoint AND w.state = 'pending'
                          AND w.created_at >= p_since AND w.next_attempt_at > now()
                          AND (w.leased_until IS NULL OR w.leased_until <= now())
                          FOR UPDATE SKIP LOCKED));
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
