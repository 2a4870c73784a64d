-- Webhooks (issue 20, contract section 4c): a transactional outbox and its deliveries.
--
-- An event is written by the operation's own SQL function, in the effect's transaction, by
-- one call: oncepay_emit_event(tenant, type, resource id, data). A change that commits has
-- its event; one that rolls back has none; a replay runs no effect and so writes none
-- (batched payments call the same oncepay_pay, so a batch emits one event per new payment).
-- An event is only written when at least one enabled endpoint of the tenant subscribes to its
-- type: a tenant without endpoints pays one index probe per change and the outbox stays empty.
--
-- The same call writes one delivery row per subscribed endpoint. Workers on every replica
-- claim due deliveries by STATE (pending, due, not leased) with FOR UPDATE SKIP LOCKED, never
-- by a cursor over a sequence: a sequence value is taken before commit, so a cursor would
-- skip the rows of transactions that commit late (tests/api/webhooks.rs measures that none
-- is skipped under concurrent writers). A claimed delivery is leased (next_attempt_at moves
-- past the HTTP timeout); a replica killed mid-delivery leaves the lease to run out, and
-- another replica sends the same event again with the same webhook-id.
--
-- New event types (top_up.succeeded, top_up.failed, top_up.refunded) need no schema change:
-- the top-up functions call oncepay_emit_event(p_tenant, 'top_up.succeeded', id, data) where
-- their change happens (oncepay_webhook_event_type already names the top-up types).

ALTER TYPE oncepay_operation ADD VALUE IF NOT EXISTS 'create_webhook_endpoint';
ALTER TYPE oncepay_operation ADD VALUE IF NOT EXISTS 'rotate_webhook_secret';

-- The event types a tenant may subscribe to (POST /webhook-endpoints refuses others: 400).
CREATE DOMAIN oncepay_webhook_event_type AS text CHECK (VALUE IN (
    'payment.succeeded', 'payment.refunded', 'deposit.succeeded', 'transfer.succeeded',
    'top_up.succeeded', 'top_up.failed', 'top_up.refunded'));

-- The secret is stored encrypted (AES-256-GCM, nonce || ciphertext) with a key that only the
-- processes hold (ONCEPAY_WEBHOOK_SECRET_KEY, docs/security.md): a dump of this table alone
-- cannot sign. During a rotation the previous secret signs too, until it expires.
CREATE TABLE webhook_endpoints (
    tenant_id                  uuid        NOT NULL REFERENCES tenants (tenant_id),
    endpoint_id                uuid        NOT NULL,
    url                        text        NOT NULL,
    event_types                text[],  -- NULL: every type
    secret_encrypted           bytea       NOT NULL,
    previous_secret_encrypted  bytea,
    previous_secret_expires_at timestamptz,
    idempotency_key            text,
    created_at                 timestamptz NOT NULL,
    disabled_at                timestamptz,
    disabled_reason            text,
    deleted_at                 timestamptz,
    CONSTRAINT webhook_endpoints_pkey PRIMARY KEY (tenant_id, endpoint_id),
    CONSTRAINT webhook_endpoints_event_types_check CHECK (event_types <@ ARRAY[
        'payment.succeeded', 'payment.refunded', 'deposit.succeeded', 'transfer.succeeded',
        'top_up.succeeded', 'top_up.failed', 'top_up.refunded']::text[])
);

-- The outbox. No foreign keys on the hot tables: a key share lock per payment on the
-- endpoint row would make the claim's row lock wait on payments.
CREATE TABLE webhook_events (
    tenant_id   uuid        NOT NULL,
    event_id    uuid        NOT NULL,
    event_type  text        NOT NULL,  -- written through oncepay_emit_event's typed parameter
    resource_id text        NOT NULL,
    data        jsonb       NOT NULL,
    created_at  timestamptz NOT NULL,
    CONSTRAINT webhook_events_pkey PRIMARY KEY (tenant_id, event_id)
);

-- One row per (event, endpoint). state: pending (to send, or being sent while leased_until
-- is ahead), delivered (a 2xx), given_up (failed for the whole schedule), cancelled (the
-- endpoint was deleted or disabled). sequence orders the events of one resource: the
-- change that makes a later event (a refund) starts after the earlier one committed (it
-- reads the payment), so its sequence is higher.
CREATE TABLE webhook_deliveries (
    tenant_id       uuid        NOT NULL,
    event_id        uuid        NOT NULL,
    endpoint_id     uuid        NOT NULL,
    sequence        bigint      GENERATED ALWAYS AS IDENTITY,
    resource_id     text        NOT NULL,
    state           text        NOT NULL DEFAULT 'pending',
    attempts        int         NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL,
    leased_until    timestamptz,
    created_at      timestamptz NOT NULL,
    finished_at     timestamptz,
    last_status     smallint,
    last_error      text,
    CONSTRAINT webhook_deliveries_pkey PRIMARY KEY (tenant_id, event_id, endpoint_id),
    CONSTRAINT webhook_deliveries_state_check
        CHECK (state IN ('pending', 'delivered', 'given_up', 'cancelled'))
) WITH (fillfactor = 80);

-- The claim's scan: due pending rows only (the index stays as small as the backlog).
CREATE INDEX webhook_deliveries_due_idx ON webhook_deliveries (next_attempt_at)
    WHERE state = 'pending';
-- Per-resource order: is an earlier event of this resource still pending for this endpoint?
CREATE INDEX webhook_deliveries_resource_idx ON webhook_deliveries (tenant_id, endpoint_id, resource_id, sequence)
    WHERE state = 'pending';
-- The purge: finished deliveries by age.
CREATE INDEX webhook_deliveries_finished_idx ON webhook_deliveries (finished_at)
    WHERE finished_at IS NOT NULL;

-- Every attempt: when, how long, what status, the answer's first bytes, or the error.
CREATE TABLE webhook_attempts (
    tenant_id     uuid        NOT NULL,
    event_id      uuid        NOT NULL,
    endpoint_id   uuid        NOT NULL,
    attempt       int         NOT NULL,
    started_at    timestamptz NOT NULL,
    latency_ms    int         NOT NULL,
    status        smallint,
    response_head text,
    error         text,
    replica       text,
    CONSTRAINT webhook_attempts_pkey PRIMARY KEY (tenant_id, event_id, endpoint_id, attempt)
);

-- Times in events as the API answers them (RFC 3339, UTC, microseconds).
CREATE FUNCTION oncepay_json_time(t timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
$$;

-- The one call that emits an event, from inside the change's transaction. Returns the
-- event's id, or NULL when no enabled endpoint of the tenant subscribes to the type.
CREATE FUNCTION oncepay_emit_event(p_tenant uuid, p_type oncepay_webhook_event_type,
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
    INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at)
    VALUES (p_tenant, v_event, p_type, p_resource_id, p_data, now());
    INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, resource_id, next_attempt_at, created_at)
    SELECT p_tenant, v_event, e.endpoint_id, p_resource_id, now(), now()
      FROM webhook_endpoints e
     WHERE e.tenant_id = p_tenant AND e.disabled_at IS NULL AND e.deleted_at IS NULL
       AND (e.event_types IS NULL OR p_type = ANY (e.event_types));
    RETURN v_event;
END
$$;

-- The events' data: the resource right after the change, with the fields of its GET (a
-- deposit, which has no GET, with those of its answer).
CREATE FUNCTION oncepay_payment_event_data(r payments) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', r.payment_id, 'account', r.account_id, 'amount', r.amount,
        'status', CASE WHEN r.refunded_at IS NULL THEN 'succeeded' ELSE 'refunded' END,
        'created_at', oncepay_json_time(r.created_at),
        'refunded_at', oncepay_json_time(r.refunded_at))
$$;

-- The operations of V5/V6 with their event: same signatures (replicas of the previous
-- version keep calling them during a rollout), one added call in the 'created' branch.

CREATE OR REPLACE FUNCTION oncepay_pay(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
    v_balance bigint;
    v_event uuid;
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
            v_event := oncepay_emit_event(p_tenant, 'payment.succeeded', c.resource_id,
                                          oncepay_payment_event_data(resource));
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM payments r
         WHERE r.tenant_id = p_tenant AND r.payment_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

CREATE OR REPLACE FUNCTION oncepay_refund(p_tenant uuid, p oncepay_claim_args, p_payment uuid)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, p_payment::text);
    v_pay record;
    v_balance bigint;
    v_event uuid;
BEGIN
    IF c.outcome = 'created' THEN
        SELECT r.account_id, r.amount, r.refunded_at INTO v_pay
          FROM payments r WHERE r.tenant_id = p_tenant AND r.payment_id = p_payment
           FOR UPDATE;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, 'not_found');
        ELSIF v_pay.refunded_at IS NOT NULL THEN
            c := oncepay_decline(p_tenant, p, 'already_refunded');
        ELSE
            UPDATE accounts a SET balance = a.balance + v_pay.amount
             WHERE a.tenant_id = p_tenant AND a.account_id = v_pay.account_id
            RETURNING a.balance INTO v_balance;
            UPDATE payments r SET refunded_at = now(), balance_after_refund = v_balance
             WHERE r.tenant_id = p_tenant AND r.payment_id = p_payment
            RETURNING r.* INTO resource;
            v_event := oncepay_emit_event(p_tenant, 'payment.refunded', p_payment::text,
                                          oncepay_payment_event_data(resource));
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM payments r
         WHERE r.tenant_id = p_tenant AND r.payment_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

CREATE OR REPLACE FUNCTION oncepay_deposit(p_tenant uuid, p oncepay_claim_args, p_account text, p_amount bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource deposits)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
    v_balance bigint;
    v_event uuid;
BEGIN
    IF c.outcome = 'created' THEN
        UPDATE accounts a SET balance = a.balance + p_amount
         WHERE a.tenant_id = p_tenant AND a.account_id = p_account
        RETURNING a.balance INTO v_balance;
        IF NOT FOUND THEN
            c := oncepay_decline(p_tenant, p, 'account_not_found');
        ELSE
            INSERT INTO deposits AS r (tenant_id, deposit_id, account_id, amount, balance_after, idempotency_key, created_at)
            VALUES (p_tenant, c.resource_id::uuid, p_account, p_amount, v_balance, p.key, now())
            RETURNING r.* INTO resource;
            v_event := oncepay_emit_event(p_tenant, 'deposit.succeeded', c.resource_id,
                jsonb_build_object('id', resource.deposit_id, 'account', resource.account_id,
                                   'amount', resource.amount, 'balance', resource.balance_after,
                                   'created_at', oncepay_json_time(resource.created_at)));
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM deposits r
         WHERE r.tenant_id = p_tenant AND r.deposit_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

CREATE OR REPLACE FUNCTION oncepay_transfer(p_tenant uuid, p oncepay_claim_args, p_from text, p_to text, p_amount bigint)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource transfers)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed;
    v_locked int;
    v_from bigint;
    v_to bigint;
    v_event uuid;
BEGIN
    -- Rust refuses this before calling (400); the SQL does not trust it to.
    IF p_from = p_to THEN
        RAISE EXCEPTION 'a transfer needs two different accounts' USING ERRCODE = 'check_violation';
    END IF;
    c := oncepay_claim(p_tenant, p, NULL);
    IF c.outcome = 'created' THEN
        SELECT count(*) INTO v_locked FROM (
            SELECT FROM accounts a
             WHERE a.tenant_id = p_tenant AND a.account_id IN (p_from, p_to)
             ORDER BY a.account_id COLLATE "C"
               FOR UPDATE) AS locked;
        IF v_locked < 2 THEN
            c := oncepay_decline(p_tenant, p, 'account_not_found');
        ELSE
            UPDATE accounts a SET balance = a.balance - p_amount
             WHERE a.tenant_id = p_tenant AND a.account_id = p_from AND a.balance >= p_amount
            RETURNING a.balance INTO v_from;
            IF NOT FOUND THEN
                c := oncepay_decline(p_tenant, p, 'insufficient_funds');
            ELSE
                UPDATE accounts a SET balance = a.balance + p_amount
                 WHERE a.tenant_id = p_tenant AND a.account_id = p_to
                RETURNING a.balance INTO v_to;
                INSERT INTO transfers AS r (tenant_id, transfer_id, from_account_id, to_account_id, amount,
                                            from_balance_after, to_balance_after, idempotency_key, created_at)
                VALUES (p_tenant, c.resource_id::uuid, p_from, p_to, p_amount, v_from, v_to, p.key, now())
                RETURNING r.* INTO resource;
                v_event := oncepay_emit_event(p_tenant, 'transfer.succeeded', c.resource_id,
                    jsonb_build_object('id', resource.transfer_id, 'from', resource.from_account_id,
                                       'to', resource.to_account_id, 'amount', resource.amount,
                                       'created_at', oncepay_json_time(resource.created_at)));
            END IF;
        END IF;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM transfers r
         WHERE r.tenant_id = p_tenant AND r.transfer_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

-- POST /webhook-endpoints: an idempotent operation like the others (its key row, replayed
-- answer: the replay shows the same secret, decrypted again by the process). The URL and
-- the secret are checked and made by Rust; the SQL stores them.
CREATE FUNCTION oncepay_create_webhook_endpoint(p_tenant uuid, p oncepay_claim_args, p_url text,
                                                p_event_types text[], p_secret_encrypted bytea)
RETURNS TABLE (outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource webhook_endpoints)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    c oncepay_claimed := oncepay_claim(p_tenant, p, NULL);
BEGIN
    IF c.outcome = 'created' THEN
        INSERT INTO webhook_endpoints AS r (tenant_id, endpoint_id, url, event_types, secret_encrypted,
                                            idempotency_key, created_at)
        VALUES (p_tenant, c.resource_id::uuid, p_url, p_event_types,
                p_secret_encrypted, p.key, now())
        RETURNING r.* INTO resource;
    ELSIF c.resource_id IS NOT NULL THEN
        SELECT r.* INTO resource FROM webhook_endpoints r
         WHERE r.tenant_id = p_tenant AND r.endpoint_id = c.resource_id::uuid;
    END IF;
    outcome := c.outcome; decline := c.decline; expires_at := c.expires_at;
    RETURN NEXT;
END
$$;

-- POST /webhook-endpoints/{id}/rotate-secret: the new secret signs from now on; the one it
-- replaces keeps signing too (a second signature in every message) for p_overlap_secs, so
-- that receivers can switch without refusing a message. A deleted endpoint, or another
-- tenant's: the stored decline not_found.
CREATE FUNCTION oncepay_rotate_webhook_secret(p_tenant uuid, p oncepay_claim_args, p_endpoint uuid,
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
               secret_encrypted = p_secret_encrypted
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

-- The claim of the delivery workers (src/webhooks/delivery.rs), one statement. Endpoints
-- with due work are locked one at a time (SKIP LOCKED: replicas take different endpoints),
-- so the count of an endpoint's deliveries in flight is exact across replicas and never
-- exceeds p_per_endpoint. A delivery is due when it is pending, its time has come, and no
-- earlier event of the same resource is still pending for the same endpoint (order per
-- resource: the next waits for the previous to be delivered or given up).
CREATE FUNCTION oncepay_webhook_claim(p_limit int, p_per_endpoint int, p_lease_ms int)
RETURNS TABLE (tenant_id uuid, event_id uuid, endpoint_id uuid, attempt int, url text,
               secret_encrypted bytea, previous_secret_encrypted bytea, event_type text,
               data jsonb, created_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    ep record;
    v_in_flight int;
    v_taken int := 0;
    v_n int;
BEGIN
    FOR ep IN
        SELECT e.tenant_id, e.endpoint_id, e.url, e.secret_encrypted,
               CASE WHEN e.previous_secret_expires_at > now() THEN e.previous_secret_encrypted END AS previous
          FROM webhook_endpoints e
         WHERE (e.tenant_id, e.endpoint_id) IN (
                   SELECT DISTINCT d.tenant_id, d.endpoint_id FROM webhook_deliveries d
                    WHERE d.state = 'pending' AND d.next_attempt_at <= now())
           AND e.disabled_at IS NULL AND e.deleted_at IS NULL
           FOR NO KEY UPDATE SKIP LOCKED
    LOOP
        EXIT WHEN v_taken >= p_limit;
        SELECT count(*) INTO v_in_flight FROM webhook_deliveries d
         WHERE d.tenant_id = ep.tenant_id AND d.endpoint_id = ep.endpoint_id
           AND d.state = 'pending' AND d.leased_until > now();
        v_n := least(p_per_endpoint - v_in_flight, p_limit - v_taken);
        CONTINUE WHEN v_n <= 0;
        RETURN QUERY
        WITH picked AS (
            SELECT d.tenant_id, d.event_id, d.endpoint_id FROM webhook_deliveries d
             WHERE d.tenant_id = ep.tenant_id AND d.endpoint_id = ep.endpoint_id
               AND d.state = 'pending' AND d.next_attempt_at <= now()
               AND NOT EXISTS (SELECT FROM webhook_deliveries o
                                WHERE o.tenant_id = d.tenant_id AND o.endpoint_id = d.endpoint_id
                                  AND o.resource_id = d.resource_id AND o.state = 'pending'
                                  AND o.sequence < d.sequence)
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

-- One attempt's result. p_outcome: 'delivered', 'retry' (at p_next_attempt_at), 'given_up'
-- (the schedule is spent: the endpoint is disabled), 'gone' (410: the endpoint is
-- disabled). A result of an attempt whose lease ran out and was taken over by another
-- replica is recorded but changes the delivery only if it is a delivery.
CREATE FUNCTION oncepay_webhook_record(p_tenant uuid, p_event uuid, p_endpoint uuid, p_attempt int,
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
           AND d.state = 'pending';
        RETURN FOUND;
    END IF;
    UPDATE webhook_deliveries d
       SET leased_until = NULL, last_status = p_status, last_error = p_error,
           next_attempt_at = coalesce(p_next_attempt_at, now()),
           state = CASE WHEN p_outcome = 'retry' THEN 'pending' ELSE 'given_up' END,
           finished_at = CASE WHEN p_outcome = 'retry' THEN NULL ELSE now() END
     WHERE d.tenant_id = p_tenant AND d.event_id = p_event AND d.endpoint_id = p_endpoint
       AND d.state = 'pending' AND d.attempts = p_attempt;
    v_current := FOUND;
    IF v_current AND p_outcome IN ('given_up', 'gone') THEN
        PERFORM oncepay_webhook_disable(p_tenant, p_endpoint,
            CASE WHEN p_outcome = 'gone' THEN 'gone' ELSE 'failing' END);
    END IF;
    RETURN v_current;
END
$$;

-- Disables (410 Gone, or the whole schedule failed) or deletes an endpoint: its pending
-- deliveries are cancelled, so nothing waits for it any more.
CREATE FUNCTION oncepay_webhook_disable(p_tenant uuid, p_endpoint uuid, p_reason text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_reason = 'deleted' THEN
        UPDATE webhook_endpoints e SET deleted_at = now()
         WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint AND e.deleted_at IS NULL;
    ELSE
        UPDATE webhook_endpoints e SET disabled_at = now(), disabled_reason = p_reason
         WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint
           AND e.disabled_at IS NULL AND e.deleted_at IS NULL;
    END IF;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE webhook_deliveries d SET state = 'cancelled', finished_at = now(), leased_until = NULL
     WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint AND d.state = 'pending';
    RETURN true;
END
$$;
