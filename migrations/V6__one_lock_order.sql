-- One lock order for every statement that locks more than one account row: (tenant, account
-- id) compared as bytes. Batches of payments (src/batch.rs) sort their items so in Rust;
-- oncepay_transfer sorted its two rows by the database's collation, which on most production
-- databases (en_US.UTF-8, ICU) is not byte order ('a' < 'B' there, 'B' < 'a' in bytes), so a
-- batch and a transfer could take the same two rows in opposite orders and deadlock.
-- COLLATE "C" compares the UTF-8 bytes, as Rust's str does. Only the ORDER BY changes; the
-- signature stays, so replicas of the previous version go on calling it during a rollout.

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
