-- Webhooks that no receiver and no tenant can break (issue 35, contract section 4c).
--
-- 1. An event is never lost to an endpoint created at the same moment. Until now a change
--    wrote its event when its check (a statement of its own, with its own snapshot) saw a
--    subscribed endpoint, and the fan-out gave the event to the endpoints whose created_at
--    was not after the event's: both now(), the start of their transactions. A payment that
--    began before the endpoint's creation, waited (on a locked account), saw the endpoint once
--    it went on, and committed after the creation had answered 201, wrote its event with the
--    earlier time, and the fan-out left the endpoint out (measured three times of three).
--    Now a tenant's changes and the creation of its endpoints exclude each other: every change
--    that may write an event takes the tenant's events lock in share mode before it writes
--    anything (oncepay_claim, before it claims a key; the batch, before its statement; the
--    top-ups' final phases, first), and a creation takes it exclusively before it claims its
--    key. A creation therefore waits for the tenant's changes in flight and holds back new ones
--    until it commits: a change either ends before the endpoint exists, or begins after it
--    committed, and then its check sees it. The endpoint takes its place in the events'
--    sequence after the lock (created_sequence), and the fan-out gives an event to the
--    endpoints created before it in that order (created_sequence < the event's sequence, both
--    drawn under the lock), not by clock. The lock is an advisory lock (no row, no WAL), two
--    keys: the class 1330665288 ("OPWH") and uuid_hash(tenant); a replay takes none.
--    Every transaction takes its tenant locks before any row lock, the batch in key order, so
--    no wait between them and row locks can form a cycle.
--
-- 2. A message given up is that message alone. Giving up after the whole schedule no longer
--    disables the endpoint: the endpoint is disabled by 410 Gone, or when none of its attempts
--    succeeded for the caller's disable-after (ONCEPAY_WEBHOOK_DISABLE_AFTER_SECS) while
--    attempts kept failing: failing_since is the start of the first failed attempt since the
--    last success, written only when that changes. A disabled endpoint's deliveries are kept,
--    in the state 'held' (out of the claim's indexes; finished_at is when they were held, so the
--    purge removes them after the retention), and the fan-out keeps writing held deliveries
--    for it; oncepay_enable_webhook_endpoint makes them pending again. A failure on oncepay's
--    own side (a secret the replica cannot decrypt) is recorded as 'deferred': the attempt is
--    given back (attempts - 1), no attempt row, nothing counted against the receiver.
--
-- 3. Fair shares: at most p_max_endpoints endpoints per tenant (checked under the exclusive
--    lock: exact), declined as too_many_endpoints; the claim takes per tenant at most the room
--    the worker gives it (its share of the worker's slots), and skips a tenant without room.
--
-- 4. A replay of an endpoint's creation or of a rotation shows a secret only if it is still the
--    one that request made (secret_from_key): never a later one.
--
-- Replicas of the previous version call the same functions by the same signatures; those whose
-- signatures change here keep their old ones as wrappers with the defaults (16 endpoints, five
-- days), so that a rollout follows the new rules from the migration on.

ALTER TYPE oncepay_decline ADD VALUE IF NOT EXISTS 'too_many_endpoints';
ALTER TYPE oncepay_operation ADD VALUE IF NOT EXISTS 'enable_webhook_endpoint';

ALTER TABLE webhook_endpoints
    ADD COLUMN created_sequence bigint,
    ADD COLUMN failing_since timestamptz,
    ADD COLUMN secret_from_key text;
COMMENT ON COLUMN webhook_endpoints.created_sequence IS
    'the events'' sequence when the endpoint was created: it receives the events of higher sequence (NULL: created before V22, receives every event fanned out since)';
COMMENT ON COLUMN webhook_endpoints.failing_since IS
    'start of the first failed attempt since the last successful one; NULL while attempts succeed';
COMMENT ON COLUMN webhook_endpoints.secret_from_key IS
    'the idempotency key of the request that made the current secret (creation or rotation); its replay shows the secret, others do not';

ALTER TABLE webhook_deliveries
    DROP CONSTRAINT webhook_deliveries_state_check,
    ADD CONSTRAINT webhook_deliveries_state_check
        CHECK (state IN ('pending', 'delivered', 'given_up', 'cancelled', 'held')) NOT VALID;
ALTER TABLE webhook_deliveries VALIDATE CONSTRAINT webhook_deliveries_state_check;
-- A disabled endpoint's kept deliveries, for its enabling or deletion (empty in the usual case).
CREATE INDEX webhook_deliveries_held_idx ON webhook_deliveries (tenant_id, endpoint_id, sequence)
    WHERE state = 'held';

-- The claim of V5, with the tenant's events lock taken in share mode before a key is claimed
-- (a new key, a keyless request, a derived key renewed); a replay or a refusal takes none.
-- As an assignment, so that plpgsql evaluates it as a simple expression (V5's note).
CREATE OR REPLACE FUNCTION oncepay_claim(p_tenant uuid, p oncepay_claim_args, p_resource_id text)
RETURNS oncepay_claimed
LANGUAGE plpgsql AS $$
DECLARE
    k idempotency_keys%ROWTYPE;
    r oncepay_claimed;
    claimed boolean;
    setting text;
BEGIN
    IF p.key IS NULL THEN
        setting := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
        r.outcome := 'created';
        r.resource_id := coalesce(p_resource_id, gen_random_uuid()::text);
        RETURN r;
    END IF;
    -- Three rounds at most: a duplicate's INSERT loses to the original and reads it in the
    -- next round; a row can also vanish (purge) or be renewed (derived key) in between. A
    -- fourth change would be a bug, answered as transient.
    FOR attempt IN 1..3 LOOP
        SELECT * INTO k FROM idempotency_keys i WHERE i.tenant_id = p_tenant AND i.key = p.key;
        IF NOT FOUND THEN
            setting := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
            r.resource_id := coalesce(p_resource_id, gen_random_uuid()::text);
            setting := set_config('lock_timeout', p.inflight_wait_ms || 'ms', true);
            INSERT INTO idempotency_keys AS i
                (tenant_id, key, fingerprint, operation, method, path, status, resource_id,
                 created_at, expires_at)
            VALUES (p_tenant, p.key, p.fingerprint, p.operation, p.method, p.path,
                    p.success_status, r.resource_id, now(),
                    now() + make_interval(secs => p.window_secs))
            ON CONFLICT (tenant_id, key) DO NOTHING
            RETURNING i.expires_at INTO r.expires_at;
            claimed := FOUND;
            setting := set_config('lock_timeout', '0', true);
            IF claimed THEN
                r.outcome := 'created';
                RETURN r;
            END IF;
            r.resource_id := NULL;
            CONTINUE;  -- lost to a concurrent original: read what it committed
        END IF;

        IF k.expires_at <= now() THEN
            IF NOT p.derived THEN
                r.outcome := 'expired';
                RETURN r;
            END IF;
            -- A derived key past its window starts afresh. Replicas racing here serialise
            -- on the row lock; the losers re-check and replay.
            setting := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
            r.resource_id := coalesce(p_resource_id, gen_random_uuid()::text);
            setting := set_config('lock_timeout', p.inflight_wait_ms || 'ms', true);
            UPDATE idempotency_keys i
               SET fingerprint = p.fingerprint, operation = p.operation, method = p.method,
                   path = p.path, status = p.success_status, resource_id = r.resource_id,
                   error_code = NULL, created_at = now(),
                   expires_at = now() + make_interval(secs => p.window_secs)
             WHERE i.tenant_id = p_tenant AND i.key = p.key AND i.expires_at <= now()
            RETURNING i.expires_at INTO r.expires_at;
            claimed := FOUND;
            setting := set_config('lock_timeout', '0', true);
            IF claimed THEN
                r.outcome := 'created';
                RETURN r;
            END IF;
            r.resource_id := NULL;
            CONTINUE;  -- another replica renewed it first: replay what it committed
        END IF;

        IF k.fingerprint <> p.fingerprint THEN
            r.outcome := 'key_reused';
            RETURN r;
        END IF;
        -- A replay answers a result as committed. If that commit's wait for the synchronous
        -- standbys was cut short (its session terminated, as a switchover does), it is
        -- visible on this primary alone and a failover would take it away after the client
        -- was told it happened. With synchronous standbys, this transaction writes a record
        -- so that its commit waits until they hold everything up to it, the replayed key row
        -- included. Without them there is nothing to wait for, and a replay writes nothing.
        IF current_setting('synchronous_standby_names') <> '' THEN
            PERFORM pg_logical_emit_message(true, 'oncepay', 'replay');
        END IF;
        r.outcome := 'replayed';
        r.decline := k.error_code;
        r.resource_id := k.resource_id;
        r.expires_at := k.expires_at;
        RETURN r;
    END LOOP;
    RAISE EXCEPTION 'idempotency key changed three times during one claim'
        USING ERRCODE = 'serialization_failure';
END
$$;

-- Subscribed now means "not deleted": a disabled endpoint's events are kept (held).
CREATE OR REPLACE FUNCTION oncepay_emit_event(p_tenant uuid, p_type oncepay_webhook_event_type,
                                              p_resource_id text, p_data jsonb)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_event uuid;
BEGIN
    IF NOT EXISTS (SELECT FROM webhook_endpoints e
                    WHERE e.tenant_id = p_tenant AND e.deleted_at IS NULL
                      AND (e.event_types IS NULL OR p_type = ANY (e.event_types))) THEN
        RETURN NULL;
    END IF;
    v_event := gen_random_uuid();
    INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at, awaiting_fan_out)
    VALUES (p_tenant, v_event, p_type, p_resource_id, p_data, now(), true);
    RETURN v_event;
END
$$;

-- V19's oncepay_pay, same signature; its event check counts disabled endpoints (kept events).
-- The claim took the tenant's events lock, so the check's snapshot sees every endpoint
-- created before this payment could write.
CREATE OR REPLACE FUNCTION oncepay_pay(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
    v_balance bigint;
BEGIN
    IF c.outcome = 'created' THEN
        UPDATE accounts a SET balance = a.balance - p_amount
         WHERE a.tenant_id = p_tenant AND a.account_id = p_account AND a.balance >= p_amount
        RETURNING a.balance INTO v_balance;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, CASE
                WHEN EXISTS (SELECT FROM accounts a WHERE a.tenant_id = p_tenant AND a.account_id = p_account)
                THEN 'insufficient_funds' ELSE 'account_not_found' END::oncepay_decline);
        ELSE
            INSERT INTO payments AS r (tenant_id, payment_id, account_id, amount, balance_after, idempotency_key, created_at)
            VALUES (p_tenant, c.resource_id::uuid, p_account, p_amount, v_balance, p.key, now())
            RETURNING r.* INTO resource;
            IF EXISTS (SELECT FROM webhook_endpoints e
                        WHERE e.tenant_id = p_tenant AND e.deleted_at IS NULL
                          AND (e.event_types IS NULL OR 'payment.succeeded' = ANY (e.event_types))) THEN
                INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at,
                                            awaiting_fan_out)
                VALUES (p_tenant, resource.payment_id, 'payment.succeeded', c.resource_id,
                        NULL, resource.created_at, true);
            END IF;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM payments r
         WHERE r.tenant_id = p_tenant AND r.payment_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

-- V21's batch, same signature. Its statement's snapshot is taken when the statement starts,
-- before the items' claims run: the tenants' events locks are taken by a statement of their
-- own first (in key order), so that the events' check sees every endpoint created before.
CREATE OR REPLACE FUNCTION oncepay_pay_batch(p_tenants uuid[], p_claims oncepay_claim_args[], p_accounts text[],
                                             p_amounts bigint[])
RETURNS TABLE (item int, outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET jit = off AS $$
#variable_conflict use_column
BEGIN
    IF current_setting('transaction_read_only')::boolean THEN
        RETURN QUERY
        SELECT i.item, p.outcome, p.decline, p.expires_at, p.resource
          FROM generate_series(1, cardinality(p_tenants)) AS i(item)
         CROSS JOIN LATERAL oncepay_pay_in_batch(p_tenants[i.item], p_claims[i.item], p_accounts[i.item],
                                                 p_amounts[i.item]) AS p
         ORDER BY i.item;
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1330665288, h.h)
       FROM (SELECT DISTINCT uuid_hash(t) AS h FROM unnest(p_tenants) AS t ORDER BY 1) AS h;
    RETURN QUERY
    WITH paid AS (
        SELECT i.item, p.outcome, p.decline, p.expires_at, p.resource
          FROM generate_series(1, cardinality(p_tenants)) AS i(item)
         CROSS JOIN LATERAL oncepay_pay_in_batch(p_tenants[i.item], p_claims[i.item], p_accounts[i.item],
                                                 p_amounts[i.item]) AS p),
    events AS (
        INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at,
                                    awaiting_fan_out)
        SELECT (paid.resource).tenant_id, (paid.resource).payment_id, 'payment.succeeded',
               (paid.resource).payment_id::text, NULL, (paid.resource).created_at, true
          FROM paid
         WHERE paid.outcome = 'created' AND (paid.resource).payment_id IS NOT NULL
           AND EXISTS (SELECT FROM webhook_endpoints e
                        WHERE e.tenant_id = (paid.resource).tenant_id AND e.deleted_at IS NULL
                          AND (e.event_types IS NULL OR 'payment.succeeded' = ANY (e.event_types)))
         ORDER BY paid.item)
    SELECT paid.item, paid.outcome, paid.decline, paid.expires_at, paid.resource
      FROM paid
     ORDER BY paid.item;
END
$$;

-- The top-ups' final phases of V8, same signatures, with the tenant's events lock taken
-- first: their event is written by a trigger (V10) after they have locked the top-up and the
-- account, too late to take it without risking a cycle of waits.
CREATE OR REPLACE FUNCTION oncepay_top_up_succeed(p_tenant uuid, p_top_up uuid, p_intent text)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
    v_balance bigint;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    SELECT t.* INTO r FROM top_ups t
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up FOR UPDATE;
    IF NOT FOUND OR r.status <> 'processing' THEN
        RETURN r;
    END IF;
    IF r.processor_payment_id IS DISTINCT FROM p_intent THEN
        RAISE EXCEPTION 'top-up % succeeded with PaymentIntent %, not its own %',
            p_top_up, p_intent, r.processor_payment_id;
    END IF;
    UPDATE accounts a SET balance = a.balance + r.amount
     WHERE a.tenant_id = p_tenant AND a.account_id = r.account_id
    RETURNING a.balance INTO v_balance;
    UPDATE top_ups t
       SET status = 'succeeded', recovery_point = 'finished', balance_after = v_balance,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up
    RETURNING t.* INTO r;
    RETURN r;
END
$$;

CREATE OR REPLACE FUNCTION oncepay_top_up_fail(p_tenant uuid, p_top_up uuid, p_failure text,
                                               p_decline_code text, p_status smallint)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    UPDATE top_ups t
       SET status = 'failed', recovery_point = 'finished', failure_code = p_failure,
           decline_code = p_decline_code, lease_owner = NULL, lease_expires_at = NULL,
           updated_at = now(), finished_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
        RETURN r;
    END IF;
    IF r.idempotency_key IS NOT NULL THEN
        UPDATE idempotency_keys k
           SET status = p_status, error_code = p_failure::oncepay_decline
         WHERE k.tenant_id = p_tenant AND k.key = r.idempotency_key
           AND k.resource_id = p_top_up::text;
    END IF;
    RETURN r;
END
$$;

CREATE OR REPLACE FUNCTION oncepay_top_up_refunded(p_tenant uuid, p_top_up uuid, p_refund text)
RETURNS top_ups
LANGUAGE plpgsql AS $$
DECLARE
    r top_ups;
    setting text := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
BEGIN
    UPDATE top_ups t
       SET status = 'refunded', refund_state = 'refunded', processor_refund_id = p_refund,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), refunded_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.refund_state = 'debited'
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

-- POST /webhook-endpoints: the tenant's events lock exclusively first (see the header), then
-- the claim; at most p_max_endpoints endpoints not deleted (a decline, stored and replayed).
CREATE FUNCTION oncepay_create_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_url text,
                                                p_event_types text[], p_secret_encrypted bytea,
                                                p_max_endpoints int)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource webhook_endpoints)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    setting text := pg_advisory_xact_lock(1330665288, uuid_hash(p_tenant))::text;
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
BEGIN
    IF c.outcome = 'created' THEN
        IF (SELECT count(*) FROM webhook_endpoints e
             WHERE e.tenant_id = p_tenant AND e.deleted_at IS NULL) >= p_max_endpoints THEN
            c := oncepay_decline(p_tenant, p, 'too_many_endpoints');
        ELSE
            INSERT INTO webhook_endpoints AS r (tenant_id, endpoint_id, url, event_types, secret_encrypted,
                                                idempotency_key, created_at, created_sequence,
                                                secret_from_key)
            VALUES (p_tenant, c.resource_id::uuid, p_url, p_event_types, p_secret_encrypted, p.key, now(),
                    nextval('webhook_events_sequence_seq'), p.key)
            RETURNING r.* INTO resource;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM webhook_endpoints r
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

-- The previous version's call: the default cap.
CREATE OR REPLACE FUNCTION oncepay_create_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_url text,
                                                           p_event_types text[], p_secret_encrypted bytea)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource webhook_endpoints)
LANGUAGE sql AS $$
    SELECT * FROM oncepay_create_webhook_endpoint(p_tenant, p, p_url, p_event_types, p_secret_encrypted, 16)
$$;

-- V9's rotation, same signature; it records which request made the secret.
CREATE OR REPLACE FUNCTION oncepay_rotate_webhook_secret(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid,
                                                         p_secret_encrypted bytea, p_overlap_secs int)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource webhook_endpoints)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_endpoint::text);
BEGIN
    IF c.outcome = 'created' THEN
        UPDATE webhook_endpoints r
           SET previous_secret_encrypted = r.secret_encrypted,
               previous_secret_expires_at = now() + make_interval(secs => p_overlap_secs),
               secret_encrypted = p_secret_encrypted,
               secret_from_key = p.key
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = p_endpoint AND r.deleted_at IS NULL
        RETURNING r.* INTO resource;
        IF NOT FOUND THEN
            resource := NULL;
            c := oncepay_decline(p_tenant, p, 'not_found');
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM webhook_endpoints r
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

-- POST /webhook-endpoints/{id}/enable: the endpoint resumes, its held deliveries pending again
-- (due now, in their sequence: a resource's order is kept). Enabling an enabled endpoint
-- changes nothing but its failure count; a deleted one, or another tenant's: not_found.
CREATE FUNCTION oncepay_enable_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid)
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
               SET state = 'pending', finished_at = NULL, next_attempt_at = now()
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

-- Disables (410 Gone, or failing for the disable-after) or deletes an endpoint. A deleted
-- endpoint's deliveries are cancelled; a disabled one's are held, to be sent once it is
-- enabled again.
CREATE OR REPLACE FUNCTION oncepay_webhook_disable(p_tenant uuid, p_endpoint uuid, p_reason text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_reason = 'deleted' THEN
        UPDATE webhook_endpoints e SET deleted_at = now()
         WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint AND e.deleted_at IS NULL;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        UPDATE webhook_deliveries d SET state = 'cancelled', finished_at = now(), leased_until = NULL
         WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'pending';
        UPDATE webhook_deliveries d SET state = 'cancelled', finished_at = now()
         WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'held';
        RETURN true;
    END IF;
    UPDATE webhook_endpoints e SET disabled_at = now(), disabled_reason = p_reason
     WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint
       AND e.disabled_at IS NULL AND e.deleted_at IS NULL;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE webhook_deliveries d SET state = 'held', finished_at = now(), leased_until = NULL
     WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'pending';
    RETURN true;
END
$$;

-- V15's fan-out: an event goes to every endpoint not deleted, subscribed to its type, created
-- before it in the events' sequence (see the header); a disabled endpoint's delivery is
-- written held.
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
        SELECT f.tenant_id, f.event_id, e.endpoint_id, f.resource_id, now(), f.created_at,
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

-- The claim of V16 (and V18's rendering of the data), with a room per tenant: at most
-- p_tenant_rooms[i] deliveries of tenant p_tenants[i], and p_room of any other tenant. The
-- worker gives each tenant its share of its free slots (src/webhooks/delivery.rs); a tenant
-- without room is stepped over whole. The endpoints are walked in (tenant, endpoint) order
-- from a random tenant, so that one tenant's endpoints are visited in one stretch.
CREATE FUNCTION oncepay_webhook_claim(p_limit int, p_per_endpoint int, p_lease_ms int, p_fan_out boolean,
                                      p_tenants uuid[], p_tenant_rooms int[], p_room int)
RETURNS TABLE (tenant_id uuid, event_id uuid, endpoint_id uuid, attempt int, url text,
               secret_encrypted bytea, previous_secret_encrypted bytea, event_type text,
               data jsonb, created_at timestamptz)
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
            RETURNING d.tenant_id, d.event_id, d.endpoint_id, d.attempts)
        SELECT l.tenant_id, l.event_id, l.endpoint_id, l.attempts, ep.url, ep.secret_encrypted,
               ep.previous, ev.event_type, coalesce(ev.data, oncepay_event_data(ev)), ev.created_at
          FROM leased l
          JOIN webhook_events ev ON ev.tenant_id = l.tenant_id AND ev.event_id = l.event_id;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_taken := v_taken + v_n;
        v_room := v_room - v_n;
    END LOOP;
END
$$;

-- The results of many attempts at once, the arrays parallel (one element per attempt); per
-- attempt, whether it settled its delivery (a stale attempt, whose lease another replica took
-- over, changes nothing but a delivery). p_outcome: 'delivered'; 'retry' (at
-- p_next_attempt_at) and 'given_up' (the schedule spent: this delivery alone), both a failure
-- of the receiver's; 'gone' (410: the endpoint is disabled, this delivery held with the
-- others); 'deferred' (oncepay's own failure: the attempt is given back, no attempt row, due
-- again at p_next_attempt_at, nothing counted against the receiver). Then each endpoint's
-- health, in key order: a 2xx ends its failing stretch; a failure starts one, or disables the
-- endpoint when it has lasted p_disable_after_secs.
CREATE FUNCTION oncepay_webhook_record_results(p_tenant uuid[], p_event uuid[], p_endpoint uuid[],
                                               p_attempt int[], p_started_at timestamptz[],
                                               p_latency_ms int[], p_status smallint[],
                                               p_response_head text[], p_error text[], p_replica text,
                                               p_outcome text[], p_next_attempt_at timestamptz[],
                                               p_disable_after_secs int)
RETURNS TABLE (event_id uuid, endpoint_id uuid, applied boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    i int;
    v_current boolean[] := array_fill(false, ARRAY[cardinality(p_event)]);
    ep record;
    v_failing_since timestamptz;
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
                   next_attempt_at = coalesce(p_next_attempt_at[i], now())
             WHERE d.tenant_id = p_tenant[i] AND d.event_id = p_event[i] AND d.endpoint_id = p_endpoint[i]
               AND (d.state = 'pending') IS TRUE AND d.attempts = p_attempt[i];
        ELSE
            UPDATE webhook_deliveries d
               SET leased_until = NULL, last_status = p_status[i], last_error = p_error[i],
                   next_attempt_at = coalesce(p_next_attempt_at[i], now()),
                   state = CASE WHEN p_outcome[i] = 'given_up' THEN 'given_up' ELSE 'pending' END,
                   finished_at = CASE WHEN p_outcome[i] = 'given_up' THEN now() END
             WHERE d.tenant_id = p_tenant[i] AND d.event_id = p_event[i] AND d.endpoint_id = p_endpoint[i]
               AND (d.state = 'pending') IS TRUE AND d.attempts = p_attempt[i];
        END IF;
        v_current[i] := FOUND;
        event_id := p_event[i];
        endpoint_id := p_endpoint[i];
        applied := v_current[i];
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
            UPDATE webhook_endpoints e SET failing_since = ep.failed_at
             WHERE e.tenant_id = ep.tenant_id AND e.endpoint_id = ep.endpoint_id
               AND e.failing_since IS NULL AND e.disabled_at IS NULL AND e.deleted_at IS NULL;
            IF NOT FOUND THEN
                SELECT e.failing_since INTO v_failing_since FROM webhook_endpoints e
                 WHERE e.tenant_id = ep.tenant_id AND e.endpoint_id = ep.endpoint_id
                   AND e.disabled_at IS NULL AND e.deleted_at IS NULL;
                IF v_failing_since <= now() - make_interval(secs => p_disable_after_secs) THEN
                    PERFORM oncepay_webhook_disable(ep.tenant_id, ep.endpoint_id, 'failing');
                END IF;
            END IF;
        END IF;
    END LOOP;
END
$$;

-- The previous version's record functions, same signatures, through the one above with the
-- default disable-after (five days): a given-up message no longer disables their endpoints.
CREATE OR REPLACE FUNCTION oncepay_webhook_record_many(p_tenant uuid[], p_event uuid[], p_endpoint uuid[],
                                                       p_attempt int[], p_started_at timestamptz[],
                                                       p_latency_ms int[], p_status smallint[],
                                                       p_response_head text[], p_error text[], p_replica text,
                                                       p_outcome text[], p_next_attempt_at timestamptz[])
RETURNS TABLE (event_id uuid, endpoint_id uuid, applied boolean)
LANGUAGE sql AS $$
    SELECT * FROM oncepay_webhook_record_results(p_tenant, p_event, p_endpoint, p_attempt, p_started_at,
                                                 p_latency_ms, p_status, p_response_head, p_error,
                                                 p_replica, p_outcome, p_next_attempt_at, 432000)
$$;

CREATE OR REPLACE FUNCTION oncepay_webhook_record(p_tenant uuid, p_event uuid, p_endpoint uuid, p_attempt int,
                                                  p_started_at timestamptz, p_latency_ms int, p_status smallint,
                                                  p_response_head text, p_error text, p_replica text,
                                                  p_outcome text, p_next_attempt_at timestamptz)
RETURNS boolean
LANGUAGE sql AS $$
    SELECT r.applied
      FROM oncepay_webhook_record_results(ARRAY[p_tenant], ARRAY[p_event], ARRAY[p_endpoint], ARRAY[p_attempt],
                                          ARRAY[p_started_at], ARRAY[p_latency_ms], ARRAY[p_status],
                                          ARRAY[p_response_head], ARRAY[p_error], p_replica,
                                          ARRAY[p_outcome], ARRAY[p_next_attempt_at], 432000) AS r
$$;
