-- Every id oncepay draws for a new resource is a UUIDv7 (RFC 9562): 48 bits of Unix
-- milliseconds, then 74 random bits, where it was a UUIDv4 (122 random bits).
--
-- Why: a primary key of random UUIDs takes each insert to a random leaf page of its index.
-- After every checkpoint the first change to a page writes the whole page to the WAL (a
-- full-page image, 8 kB), and with a table larger than the few pages touched between two
-- checkpoints nearly every insert is such a first change. Measured on a database of 10.2
-- million payments, c=32 for 8 s after a CHECKPOINT (pg_walinspect, per relation): of
-- 24,500 payments, payments_pkey wrote 21,021 full-page images (122 MB of WAL, a third of
-- all), the key index 21,404 (the client's random keys), payments_account_list_idx 9,684 (a
-- random account's end of it); payments_list_idx, ordered by time, 3. A time-ordered id puts
-- each insert at the right edge of payments_pkey, as payments_list_idx's are. Three
-- alternated runs each, the same binary and database: WAL 539 / 552 / 517 -> 364 / 346 /
-- 370 MB, new payments 4,728 / 4,827 / 4,380 -> 5,332 / 4,916 / 5,364 a second, PostgreSQL
-- CPU a payment 233 / 224 / 255 -> 200 / 215 / 192 us.
--
-- The id's first 48 bits tell when it was drawn, to the millisecond: no more than a
-- resource's created_at already says. Its 74 random bits keep it as unguessable in practice
-- as any id needs to be (every read is scoped to its tenant anyway) and as unique: two draws
-- in the same millisecond collide with a probability of about 2^-74. Ids drawn in one
-- millisecond are not ordered among themselves; lists order by (created_at, id) as before.
--
-- Every new resource's id is drawn by oncepay_claim (payments, transfers, top-ups, webhook
-- endpoints: each operation's function claims its key with no id of its own) or by the
-- batch's set path (V28). Both are redefined here unchanged but for the draw
-- (gen_random_uuid() -> oncepay_uuid7()), with the same settings (V27: the claim has none,
-- the batch its three). A payment's event takes its payment's id; the other events' ids
-- (oncepay_emit_event's, for the other event types) stay gen_random_uuid()'s, being few.

-- gen_random_uuid()'s bytes after the sixth, behind the time's 48 bits, the version nibble
-- set from 4 (0100) to 7 (0111); the variant bits are gen_random_uuid()'s (10). About 0.8 us
-- more than gen_random_uuid() (a million of each: 1.87 against 1.07 s).
CREATE FUNCTION oncepay_uuid7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT encode(set_bit(set_bit(
               substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
               || substring(uuid_send(gen_random_uuid()) FROM 7),
           52, 1), 53, 1), 'hex')::uuid
$$;

-- V22's claim; a new resource's id is a UUIDv7.
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
        r.resource_id := coalesce(p_resource_id, oncepay_uuid7()::text);
        RETURN r;
    END IF;
    -- Three rounds at most: a duplicate's INSERT loses to the original and reads it in the
    -- next round; a row can also vanish (purge) or be renewed (derived key) in between. A
    -- fourth change would be a bug, answered as transient.
    FOR attempt IN 1..3 LOOP
        SELECT * INTO k FROM idempotency_keys i WHERE i.tenant_id = p_tenant AND i.key = p.key;
        IF NOT FOUND THEN
            setting := pg_advisory_xact_lock_shared(1330665288, uuid_hash(p_tenant))::text;
            r.resource_id := coalesce(p_resource_id, oncepay_uuid7()::text);
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
            r.resource_id := coalesce(p_resource_id, oncepay_uuid7()::text);
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

-- V28's batch; its payments' ids are UUIDv7s.
CREATE OR REPLACE FUNCTION oncepay_pay_batch(p_tenants uuid[], p_claims oncepay_claim_args[], p_accounts text[],
                                             p_amounts bigint[])
RETURNS TABLE (item int, outcome oncepay_outcome, decline oncepay_decline, expires_at timestamptz,
               resource payments)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET jit = off SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    v_independent boolean;
    v_wait int;
    v_go int[];           -- items whose key step 1 claimed, and keyless items
    v_ids uuid[];         -- their payments' ids
    v_expires timestamptz[];
    v_declined int[];     -- items of v_go whose debit failed
    v_answers oncepay_batch_answer[];
    c oncepay_claimed;
    r record;
    i int;
    setting text;
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

    IF cardinality(p_tenants) >= 6 THEN
        SELECT count(DISTINCT (p_tenants[g], p_accounts[g])) = count(*)
               AND count(DISTINCT (p_tenants[g], (p_claims[g]).key)) FILTER (WHERE (p_claims[g]).key IS NOT NULL)
                   = count((p_claims[g]).key)
               AND NOT bool_or(coalesce((p_claims[g]).derived, false)),
               max((p_claims[g]).inflight_wait_ms)
          INTO v_independent, v_wait
          FROM generate_series(1, cardinality(p_tenants)) AS g;
    END IF;

    IF NOT coalesce(v_independent, false) THEN
        SELECT array_agg(ROW(i.item, p.outcome, p.decline, p.expires_at, p.resource)::oncepay_batch_answer)
          INTO v_answers
          FROM generate_series(1, cardinality(p_tenants)) AS i(item)
         CROSS JOIN LATERAL oncepay_pay_in_batch(p_tenants[i.item], p_claims[i.item], p_accounts[i.item],
                                                 p_amounts[i.item]) AS p;
    ELSE
        -- 1. The keys.
        IF v_wait IS NOT NULL THEN
            setting := set_config('lock_timeout', v_wait || 'ms', true);
        END IF;
        WITH items AS MATERIALIZED (
            SELECT g.item, p_tenants[g.item] AS t, p_claims[g.item] AS c, oncepay_uuid7() AS id
              FROM generate_series(1, cardinality(p_tenants)) AS g(item)),
        claimed AS (
            INSERT INTO idempotency_keys AS k
                (tenant_id, key, fingerprint, operation, method, path, status, resource_id,
                 created_at, expires_at)
            SELECT it.t, (it.c).key, (it.c).fingerprint, (it.c).operation, (it.c).method, (it.c).path,
                   (it.c).success_status, it.id::text, now(), now() + make_interval(secs => (it.c).window_secs)
              FROM items it
             WHERE (it.c).key IS NOT NULL
             ORDER BY it.t, (it.c).key
            ON CONFLICT (tenant_id, key) DO NOTHING
            RETURNING k.tenant_id, k.key, k.expires_at)
        SELECT array_agg(it.item), array_agg(it.id), array_agg(k.expires_at)
          INTO v_go, v_ids, v_expires
          FROM items it LEFT JOIN claimed k ON k.tenant_id = it.t AND k.key = (it.c).key
         WHERE (it.c).key IS NULL OR k.key IS NOT NULL;
        IF v_wait IS NOT NULL THEN
            setting := set_config('lock_timeout', '0', true);
        END IF;

        IF v_go IS NOT NULL THEN
            -- 2. The accounts, locked in the one order, debited; the payments.
            WITH go AS MATERIALIZED (
                SELECT g.item, p_tenants[g.item] AS t, p_claims[g.item] AS c, p_accounts[g.item] AS a,
                       p_amounts[g.item] AS amt, g.id, g.expires_at
                  FROM unnest(v_go, v_ids, v_expires) AS g(item, id, expires_at)),
            locked AS MATERIALIZED (
                SELECT a.tenant_id, a.account_id FROM accounts a
                 WHERE (a.tenant_id, a.account_id) IN (SELECT go.t, go.a FROM go)
                 ORDER BY a.tenant_id, a.account_id COLLATE "C"
                   FOR NO KEY UPDATE OF a),
            debited AS (
                UPDATE accounts a SET balance = a.balance - go.amt
                  FROM go JOIN locked l ON l.tenant_id = go.t AND l.account_id = go.a
                 WHERE a.tenant_id = go.t AND a.account_id = go.a AND a.balance >= go.amt
                RETURNING go.item, a.balance),
            paid AS (
                INSERT INTO payments AS r (tenant_id, payment_id, account_id, amount, balance_after,
                                           idempotency_key, created_at)
                SELECT go.t, go.id, go.a, go.amt, d.balance, (go.c).key, now()
                  FROM go JOIN debited d ON d.item = go.item
                 ORDER BY go.item
                RETURNING r.*)
            SELECT array_agg(ROW(go.item, 'created', NULL, go.expires_at, ROW(p.*)::payments)::oncepay_batch_answer)
                       FILTER (WHERE p.payment_id IS NOT NULL),
                   array_agg(go.item) FILTER (WHERE p.payment_id IS NULL)
              INTO v_answers, v_declined
              FROM go LEFT JOIN paid p ON p.payment_id = go.id;

            -- 3. The declines.
            FOREACH i IN ARRAY coalesce(v_declined, '{}') LOOP
                c := oncepay_decline(p_tenants[i], p_claims[i], CASE
                    WHEN EXISTS (SELECT FROM accounts a WHERE a.tenant_id = p_tenants[i] AND a.account_id = p_accounts[i])
                    THEN 'insufficient_funds' ELSE 'account_not_found' END::oncepay_decline);
                v_answers := v_answers || ROW(i, c.outcome, c.decline, c.expires_at, NULL)::oncepay_batch_answer;
            END LOOP;
        END IF;

        -- 4. The keys that were there already.
        IF coalesce(cardinality(v_go), 0) < cardinality(p_tenants) THEN
            FOR i IN 1 .. cardinality(p_tenants) LOOP
                CONTINUE WHEN i = ANY (coalesce(v_go, '{}'));
                SELECT p.outcome, p.decline, p.expires_at, p.resource INTO r
                  FROM oncepay_pay_in_batch(p_tenants[i], p_claims[i], p_accounts[i], p_amounts[i]) AS p;
                v_answers := v_answers || ROW(i, r.outcome, r.decline, r.expires_at, r.resource)::oncepay_batch_answer;
            END LOOP;
        END IF;
    END IF;

    -- 5. The events, and the answers.
    RETURN QUERY
    WITH events AS (
        INSERT INTO webhook_events (tenant_id, event_id, event_type, resource_id, data, created_at,
                                    awaiting_fan_out)
        SELECT (a.resource).tenant_id, (a.resource).payment_id, 'payment.succeeded',
               (a.resource).payment_id::text, NULL, (a.resource).created_at, true
          FROM unnest(v_answers) AS a
         WHERE a.outcome = 'created' AND (a.resource).payment_id IS NOT NULL
           AND EXISTS (SELECT FROM webhook_endpoints e
                        WHERE e.tenant_id = (a.resource).tenant_id AND e.deleted_at IS NULL
                          AND (e.event_types IS NULL OR 'payment.succeeded' = ANY (e.event_types)))
         ORDER BY a.item)
    SELECT a.item, a.outcome, a.decline, a.expires_at, a.resource
      FROM unnest(v_answers) AS a
     ORDER BY a.item;
END
$$;
