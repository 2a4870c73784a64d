-- A webhook endpoint's backlog of retries no longer costs the database a core (found from
-- outside, 2026-12-07: an endpoint down for two days had 142,617 pending deliveries, nearly
-- none of them due; every claim's look at it read all of them, in sequence order, to find
-- none: 107 ms and 37,707 buffers a claim, 56.6 s of PostgreSQL's time a minute, for the
-- ~31 hours its retries last; 0.52 s a minute once the backlog was gone).
--
-- A new partial index holds the pending deliveries of each endpoint by when they are due,
-- then by sequence. The claim takes an endpoint's deliveries due first, the oldest first
-- among those due at once (one resource's events still go in their order, each the first
-- unfinished of its resource), so it reads the due ones only; and an endpoint with none due
-- is passed by one descent of that index (its earliest due time), without its row's lock or
-- the count of its attempts in flight (a tenant of 300 failing endpoints whose retries were
-- not due cost every claim 300 such visits). Fresh deliveries are due at their fan-out, so a
-- healthy endpoint's go oldest first as before, and so do an enabled or recovered
-- endpoint's (all due at once).
--
-- Each delivery's row versions (fan-out, lease, record) add an entry to this index as to
-- the table's other seven (no update of a delivery is HOT: the leased index names
-- `leased_until`). The build reads the whole of `webhook_deliveries` under a SHARE lock, so
-- fan-outs, claims and records wait until the migration commits: on a large table, build it
-- first with `CREATE INDEX CONCURRENTLY` under the same name (docs/operations.md, V50); this
-- then finds it. Replicas of every version call the function.

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                WHERE NOT i.indisvalid AND c.relname = 'webhook_deliveries_due_idx') THEN
        RAISE EXCEPTION 'invalid index webhook_deliveries_due_idx (a CREATE INDEX CONCURRENTLY that failed): DROP INDEX it, then migrate again';
    END IF;
END
$$;

CREATE INDEX IF NOT EXISTS webhook_deliveries_due_idx ON webhook_deliveries (tenant_id, endpoint_id, next_attempt_at, sequence)
    WHERE state = 'pending';

CREATE OR REPLACE FUNCTION oncepay_webhook_claim_scheduled(p_limit integer, p_per_endpoint integer, p_lease_ms integer, p_fan_out boolean, p_tenants uuid[], p_tenant_rooms integer[], p_room integer,
                                                           p_tenant_shares integer[], p_tenant_busy integer[], p_endpoints uuid[], p_endpoint_in_flight integer[])
 RETURNS TABLE(tenant_id uuid, event_id uuid, endpoint_id uuid, attempt integer, url text, secret_encrypted bytea, previous_secret_encrypted bytea, event_type text, data jsonb, created_at timestamp with time zone, schedule_attempt integer)
 LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_pivot uuid := gen_random_uuid();
    v_nil uuid := '00000000-0000-0000-0000-000000000000';
    v_past uuid := 'ffffffff-ffff-ffff-ffff-ffffffffffff';
    v_tenant uuid := v_pivot;
    v_wrapped boolean := false;
    v_next record;
    v_after record;
    -- What the last descent found past v_tenant: 0 nothing known, 1 v_next holds the next
    -- tenant's first endpoint with pending deliveries, 2 there is none.
    v_ahead smallint := 0;
    -- The tenant's endpoints with pending deliveries, in the order they are visited.
    v_cands uuid[];
    v_endpoint uuid;
    ep record;
    v_in_flight int;
    v_taken int := 0;
    v_n int;
    -- Endpoints looked at: bounds a claim's work when many endpoints are at their bound.
    v_seen int := 0;
    v_room int;
    -- The tenant's share of this replica's slots, how many of its endpoints have attempts in
    -- flight here (those claimed in this call included), and how many it has enabled.
    v_share int;
    v_busy int;
    v_endpoints int;
    -- This endpoint's attempts in flight here, and what it may take.
    v_mine int;
    v_endpoint_room int;
    -- When this endpoint's first pending delivery is due.
    v_due_at timestamptz;
    -- The rest of a long list, and the row that follows it when it is another tenant's.
    v_more uuid[];
    v_after_tenant text;
    v_after_endpoint text;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    IF p_fan_out THEN
        PERFORM oncepay_webhook_fan_out(1000);
    END IF;
    WHILE v_taken < p_limit AND v_seen < 1000 LOOP
        -- The next tenant with pending deliveries after v_tenant, and its first endpoint
        -- with some: one descent, unless the previous tenant's collection ended on it.
        IF v_ahead = 0 THEN
            SELECT d.tenant_id, d.endpoint_id INTO v_next FROM webhook_deliveries d
             WHERE d.state = 'pending' AND (d.tenant_id, d.endpoint_id) > (v_tenant, v_past)
             ORDER BY d.tenant_id, d.endpoint_id
             LIMIT 1;
            v_ahead := CASE WHEN FOUND THEN 1 ELSE 2 END;
        END IF;
        IF v_ahead = 2 THEN
            v_ahead := 0;
            EXIT WHEN v_wrapped;
            -- From the start, up to the pivot. The nil tenant itself is no tenant.
            v_wrapped := true;
            v_tenant := v_nil;
            CONTINUE;
        END IF;
        v_ahead := 0;
        EXIT WHEN v_wrapped AND v_next.tenant_id >= v_pivot;
        v_tenant := v_next.tenant_id;
        v_room := coalesce(p_tenant_rooms[array_position(p_tenants, v_tenant)], p_room);
        -- The tenant has its share: to the next tenant.
        CONTINUE WHEN v_room <= 0;
        v_share := coalesce(p_tenant_shares[array_position(p_tenants, v_tenant)], p_room);
        v_busy := coalesce(p_tenant_busy[array_position(p_tenants, v_tenant)], 0);
        SELECT greatest(count(*), 1) INTO v_endpoints FROM webhook_endpoints e
         WHERE e.tenant_id = v_tenant AND e.disabled_at IS NULL AND e.deleted_at IS NULL;

        -- Its other endpoints with pending deliveries: one descent each. The descent that
        -- ends the list finds what follows the tenant: the outer loop takes it from there
        -- (claiming this tenant's deliveries changes no other tenant's rows; a row another
        -- replica finished meanwhile costs a visit that claims nothing, as a stale descent
        -- would).
        v_cands := ARRAY[v_next.endpoint_id];
        LOOP
            EXIT WHEN cardinality(v_cands) >= 8;
            SELECT d.tenant_id, d.endpoint_id INTO v_after FROM webhook_deliveries d
             WHERE d.state = 'pending'
               AND (d.tenant_id, d.endpoint_id) > (v_tenant, v_cands[cardinality(v_cands)])
             ORDER BY d.tenant_id, d.endpoint_id
             LIMIT 1;
            IF NOT FOUND THEN
                v_ahead := 2;
                EXIT;
            END IF;
            IF v_after.tenant_id <> v_tenant THEN
                v_next := v_after;
                v_ahead := 1;
                EXIT;
            END IF;
            v_cands := v_cands || v_after.endpoint_id;
        END LOOP;
        -- Eight endpoints and more: the rest of the list in one statement, the same descents
        -- as rescans of one plan (V49), up to 1000 in all. Its last row, when it is another
        -- tenant's, is handed over as the loop's would be.
        IF v_ahead = 0 AND cardinality(v_cands) < 1000 THEN
            WITH RECURSIVE found(tenant_id, endpoint_id, n) AS (
                SELECT v_tenant, v_cands[cardinality(v_cands)], cardinality(v_cands)
                UNION ALL
                SELECT nx.tenant_id, nx.endpoint_id, found.n + 1
                  FROM found CROSS JOIN LATERAL (
                       SELECT d.tenant_id, d.endpoint_id FROM webhook_deliveries d
                        WHERE d.state = 'pending'
                          AND (d.tenant_id, d.endpoint_id) > (found.tenant_id, found.endpoint_id)
                        ORDER BY d.tenant_id, d.endpoint_id
                        LIMIT 1) nx
                 WHERE found.tenant_id = v_tenant AND found.n < 1000)
            SELECT array_agg(f.endpoint_id ORDER BY f.n) FILTER (WHERE f.tenant_id = v_tenant AND f.n > cardinality(v_cands)),
                   min(f.tenant_id::text) FILTER (WHERE f.tenant_id <> v_tenant),
                   min(f.endpoint_id::text) FILTER (WHERE f.tenant_id <> v_tenant)
              INTO v_more, v_after_tenant, v_after_endpoint
              FROM found f;
            v_cands := v_cands || v_more;
            IF v_after_tenant IS NOT NULL THEN
                SELECT v_after_tenant::uuid AS tenant_id, v_after_endpoint::uuid AS endpoint_id INTO v_next;
                v_ahead := 1;
            ELSIF cardinality(v_cands) < 1000 THEN
                v_ahead := 2;
            END IF;
        END IF;
        IF cardinality(v_cands) > 1 THEN
            SELECT array_agg(e.endpoint_id
                             ORDER BY e.failing_since IS NOT NULL,
                                      coalesce(p_endpoint_in_flight[array_position(p_endpoints, e.endpoint_id)], 0),
                                      CASE WHEN e.failing_since IS NOT NULL THEN random() END,
                                      e.endpoint_id)
              INTO v_cands
              FROM webhook_endpoints e
             WHERE e.tenant_id = v_tenant AND e.endpoint_id = ANY (v_cands);
        END IF;

        FOREACH v_endpoint IN ARRAY coalesce(v_cands, '{}'::uuid[])
        LOOP
            EXIT WHEN v_room <= 0 OR v_taken >= p_limit OR v_seen >= 1000;
            v_seen := v_seen + 1;
            -- Nothing of it due: to the next endpoint, by one descent of the due index (the
            -- first entry of the endpoint's), without its row's lock, the count of its attempts
            -- in flight or a look at its backlog (V50). Asked as the earliest due time, not as
            -- "any due now?": planned generically, the latter guessed a third of the rows due
            -- and scanned the whole table to find none (found from outside: 30 ms a look at
            -- an endpoint holding half the table).
            SELECT min(d.next_attempt_at) INTO v_due_at FROM webhook_deliveries d
             WHERE d.tenant_id = v_tenant AND d.endpoint_id = v_endpoint AND d.state = 'pending';
            CONTINUE WHEN v_due_at IS NULL OR v_due_at > now();

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
                -- Pending deliveries of a disabled or deleted endpoint: fanned out by a
                -- transaction that saw it enabled while the disable (or delete) committed,
                -- whose UPDATE of the pending rows could not see them. Left, they waited for
                -- ever (V37). Held or cancelled now, as the disable would have left them; its
                -- row lock is ours.
                UPDATE webhook_deliveries d
                   SET state = CASE WHEN ep.deleted_at IS NOT NULL THEN 'cancelled' ELSE 'held' END,
                       finished_at = now(), leased_until = NULL
                 WHERE d.tenant_id = v_tenant AND d.endpoint_id = v_endpoint AND d.state = 'pending';
                CONTINUE;
            END IF;

            SELECT count(*) INTO v_in_flight FROM webhook_deliveries d
             WHERE d.tenant_id = v_tenant AND d.endpoint_id = v_endpoint
               AND d.state = 'pending' AND d.leased_until IS NOT NULL AND d.leased_until > now();
            -- Within its tenant's share, an endpoint is what a tenant is within the replica's
            -- slots: with m of the tenant's endpoints busy here, each holds at most
            -- share/(m+1), and an endpoint not busy may take share/(m+2), so a share stays free
            -- for the next one (V39); never split in more parts than the tenant has endpoints
            -- (one alone takes the whole share).
            v_mine := coalesce(p_endpoint_in_flight[array_position(p_endpoints, v_endpoint)], 0);
            v_endpoint_room := CASE WHEN v_mine > 0 THEN greatest(1, v_share / least(v_busy + 1, v_endpoints)) - v_mine
                                    ELSE greatest(1, v_share / least(v_busy + 2, v_endpoints)) END;
            v_n := least(p_per_endpoint - v_in_flight, p_limit - v_taken, v_room, v_endpoint_room);
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
                 -- Due first, by the due index: an endpoint's deliveries not due are never read
                 -- (V50; by sequence, a claim read its whole backlog to find none due); among
                 -- those due at once (a fan-out, a recovery, an enable), the oldest first.
                 ORDER BY d.next_attempt_at, d.sequence
                 LIMIT v_n
                   FOR UPDATE SKIP LOCKED),
            leased AS (
                UPDATE webhook_deliveries d
                   SET attempts = d.attempts + 1,
                       -- A lease that ran out unrecorded: that attempt was lost with its
                       -- process. This one takes its step of the schedule (its number is
                       -- new, so a late record of the lost one is not applied to it); under
                       -- a schedule restarted while it was out (V33), the new schedule's first.
                       schedule_start = CASE WHEN d.leased_until IS NOT NULL AND d.schedule_start < d.attempts
                                             THEN d.schedule_start + 1 ELSE d.schedule_start END,
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
            IF v_n > 0 AND v_mine = 0 THEN
                v_busy := v_busy + 1;
            END IF;
        END LOOP;
    END LOOP;
END
$$;
