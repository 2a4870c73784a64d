CREATE OR REPLACE FUNCTION public.oncepay_pay_batch(p_tenants uuid[], p_claims oncepay_claim_args[], p_accounts text[], p_amounts bigint[])
 RETURNS TABLE(item integer, outcome oncepay_outcome, decline oncepay_decline, expires_at timestamp with time zone, resource payments)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
 SET enable_seqscan TO 'off'
AS $function$
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
$function$


