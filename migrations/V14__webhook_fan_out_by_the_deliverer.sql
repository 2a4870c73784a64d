-- The outbox's cost to the change that writes it (issue 20): one row, not one per endpoint.
--
-- Until now oncepay_emit_event wrote the event and, in the same transaction, one delivery per
-- subscribed endpoint: a second heap row and three more index entries (the delivery's key,
-- its endpoint's and its resource's pending indexes) on every payment of a tenant with an
-- endpoint. Measured with pgbench on oncepay_pay alone (c=8, 15 s steps side by side): a
-- tenant with one endpoint paid at 0.82 of one without; writing only the event, 0.96; the
-- event with the index below, 0.90-0.97 (noisy).
--
-- Now the change's transaction writes only the event, marked awaiting_fan_out, and the
-- deliverers write its deliveries (oncepay_webhook_fan_out, called at the start of every
-- claim). Still no event of a change is lost or invented: the event commits or rolls back with
-- its change, as before, and is fanned out only once committed.
--
-- Fan-out by state, not by a cursor: the awaiting events are found by the partial index below,
-- so an event whose transaction committed late (its sequence taken long before) is fanned out
-- when it becomes visible, never skipped. Order per resource: one fan-out at a time (an
-- advisory lock, tried: a deliverer that finds it taken claims what is already fanned out),
-- each in one statement, taking the awaiting events in sequence order. A resource's later
-- event (a refund) is written by a transaction that began after the earlier one committed, so
-- its sequence is higher and any snapshot that sees it sees the earlier one too: the earlier
-- event's deliveries are written by the same fan-out or an earlier one, and take a lower
-- delivery sequence, which is what the claim orders a resource's deliveries by.
--
-- Which endpoints get an event: those enabled and subscribed to its type when it is fanned out
-- that were registered no later than the change (an endpoint created after a change does not
-- receive it). The change's transaction still looks for one such endpoint before writing the
-- event, so a tenant without endpoints pays one index probe and writes nothing. An event that
-- no endpoint takes by its fan-out (every endpoint deleted or disabled meanwhile) stays for
-- GET /events until the purge deletes it after the retention (webhook_events_unsent_idx).
--
-- A fan-out commits like a claim, without waiting for the WAL flush: a crash that takes it
-- back leaves its events awaiting, and they are fanned out again (a delivery already sent
-- from the lost fan-out is sent again with the same webhook-id: a duplicate, never a loss).
--
-- Compatible with replicas of the previous version during a rollout: they call the same
-- functions (oncepay_emit_event, oncepay_webhook_claim) with the same signatures.

-- Both columns are added without a default (no rewrite of a week of events under an exclusive
-- lock); events written before this migration have their deliveries and stay NULL.
CREATE SEQUENCE webhook_events_sequence_seq AS bigint;
ALTER TABLE webhook_events ADD COLUMN sequence bigint, ADD COLUMN awaiting_fan_out boolean;
ALTER SEQUENCE webhook_events_sequence_seq OWNED BY webhook_events.sequence;
ALTER TABLE webhook_events ALTER COLUMN sequence SET DEFAULT nextval('webhook_events_sequence_seq');
-- awaiting_fan_out: true until fanned out; then NULL (deliveries written) or false (no
-- endpoint took it: only the purge reads it again).
COMMENT ON COLUMN webhook_events.awaiting_fan_out IS
    'true: committed, deliveries not yet written; NULL: fanned out (or written before V14); false: fanned out to no endpoint';

-- The fan-out's scan: awaiting events in sequence order. Appended to at its right edge.
CREATE INDEX webhook_events_awaiting_idx ON webhook_events (sequence) WHERE awaiting_fan_out;
-- Events fanned out to no endpoint, by age, for the purge (empty in the usual case).
CREATE INDEX webhook_events_unsent_idx ON webhook_events (created_at) WHERE NOT awaiting_fan_out;

-- Every fan-out changes the rows it takes (leaving dead entries in the awaiting index that
-- the next fan-out's scan crosses until VACUUM): vacuumed often, like the deliveries (V11).
ALTER TABLE webhook_events SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
                                autovacuum_vacuum_cost_delay = 0);

CREATE OR REPLACE FUNCTION oncepay_emit_event(p_tenant uuid, p_type oncepay_webhook_event_type,
                                              p_resource_id text, p_data jsonb)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_event uuid;
BEGIN
    IF NOT EXISTS (SELECT FROM webhook_endpoints e
                    WHERE e.tenant_id = p_tenant AND e.disabled_at IS NULL AND e.deleted_at IS NULL
                      AND (e.event_types IS NULL OR p_type = ANY (e.event_types))) THEN
        RETURN NULL;
    END IF;
    v_event := gen_random_uuid();
    INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at, awaiting_fan_out)
    VALUES (p_tenant, v_event, p_type, p_resource_id, p_data, now(), true);
    RETURN v_event;
END
$$;

-- Writes the deliveries of at most p_limit awaiting events, oldest sequence first, unless
-- another transaction is fanning out (then returns NULL at once). Returns the events fanned out.
CREATE FUNCTION oncepay_webhook_fan_out(p_limit int)
RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    v_n int;
BEGIN
    -- "whfanout" in ASCII.
    IF NOT pg_try_advisory_xact_lock(8604244658212254068) THEN
        RETURN NULL;
    END IF;
    WITH due AS (
        SELECT ev.tenant_id, ev.event_id FROM webhook_events ev
         WHERE ev.awaiting_fan_out
         ORDER BY ev.sequence
         LIMIT p_limit),
    fanned AS (
        UPDATE webhook_events ev
           SET awaiting_fan_out = CASE WHEN EXISTS (
                   SELECT FROM webhook_endpoints e
                    WHERE e.tenant_id = ev.tenant_id AND e.disabled_at IS NULL AND e.deleted_at IS NULL
                      AND e.created_at <= ev.created_at
                      AND (e.event_types IS NULL OR ev.event_type = ANY (e.event_types)))
               THEN NULL ELSE false END
          FROM due
         WHERE ev.tenant_id = due.tenant_id AND ev.event_id = due.event_id AND ev.awaiting_fan_out
        RETURNING ev.tenant_id, ev.event_id, ev.event_type, ev.resource_id, ev.created_at, ev.sequence),
    written AS (
        -- In event order: the identity that orders a resource's deliveries is taken row by row.
        INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, resource_id, next_attempt_at, created_at)
        SELECT f.tenant_id, f.event_id, e.endpoint_id, f.resource_id, now(), f.created_at
          FROM fanned f
          JOIN webhook_endpoints e
            ON e.tenant_id = f.tenant_id AND e.disabled_at IS NULL AND e.deleted_at IS NULL
           AND e.created_at <= f.created_at
           AND (e.event_types IS NULL OR f.event_type = ANY (e.event_types))
         ORDER BY f.sequence, e.endpoint_id
        RETURNING 1)
    SELECT count(*) INTO v_n FROM fanned;
    RETURN v_n;
END
$$;

-- The claim: the fan-out first, then V11's claim, renamed (its body unchanged): the
-- deliverers that claim are the ones that fan out.
ALTER FUNCTION oncepay_webhook_claim(int, int, int) RENAME TO oncepay_webhook_claim_fanned_out;

CREATE FUNCTION oncepay_webhook_claim(p_limit int, p_per_endpoint int, p_lease_ms int)
RETURNS TABLE (tenant_id uuid, event_id uuid, endpoint_id uuid, attempt int, url text,
               secret_encrypted bytea, previous_secret_encrypted bytea, event_type text,
               data jsonb, created_at timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM oncepay_webhook_fan_out(1000);
    RETURN QUERY SELECT * FROM oncepay_webhook_claim_fanned_out(p_limit, p_per_endpoint, p_lease_ms);
END
$$;
