-- A batch of replays is answered by a read-only database again, as it was before V20.
--
-- V20's oncepay_pay_batch writes its payments' events with an INSERT in the same statement as
-- the payments (a writable CTE). PostgreSQL refuses a statement that contains an INSERT in a
-- read-only transaction before it runs, even when it would insert no row: on a database
-- turned read-only by a failover (or a standby), a batch of replays, which writes nothing,
-- failed with 25006 (503) where the lone oncepay_pay answers them. Through a transaction-mode
-- pooler every payment goes through this function (oncepay_pay_many), so a replay during a
-- failover did too (tests/api/failover.rs, make test-pgbouncer).
--
-- Now a read-only transaction runs the payments' half of the statement alone: nothing can be
-- created there (a new key's claim is refused, 25006, as in oncepay_pay), so there is no event
-- to write. A writable one runs V20's statement unchanged. The test costs one setting read a
-- batch.
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
                        WHERE e.tenant_id = (paid.resource).tenant_id AND e.disabled_at IS NULL
                          AND e.deleted_at IS NULL
                          AND (e.event_types IS NULL OR 'payment.succeeded' = ANY (e.event_types)))
         ORDER BY paid.item)
    SELECT paid.item, paid.outcome, paid.decline, paid.expires_at, paid.resource
      FROM paid
     ORDER BY paid.item;
END
$$;
