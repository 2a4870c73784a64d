-- A key whose request is still running is told apart from a key never used (found from
-- outside, 2026-12-07).
--
-- `GET /idempotency-keys/{key}` reads the key's row, which a payment inserts in the
-- transaction that debits the account: until it commits the row is invisible, and the lookup
-- answered 404 "no such resource" for a payment that was running (3.6 s behind a locked
-- account in the probe): a recovery tool that took that for "never used" and paid again under
-- a new key would charge twice. This function asks the unique index, as a duplicate request
-- does: it inserts a placeholder row for the key and waits at most `p_wait_ms` for a
-- transaction holding the same key; the insert is always undone (a subtransaction). It
-- answers `in_flight` (another transaction holds the key), `present` (a row was committed
-- meanwhile: read it again) or `absent` (no request holds it). A new function: replicas of
-- the previous version do not call it.

CREATE FUNCTION oncepay_key_in_flight(p_tenant uuid, p_key text, p_wait_ms integer)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    v_inserted int := 0;
BEGIN
    PERFORM set_config('lock_timeout', p_wait_ms || 'ms', true);
    BEGIN
        INSERT INTO idempotency_keys (tenant_id, key, fingerprint, method, path, status, created_at, expires_at,
                                      operation)
        VALUES (p_tenant, p_key, decode(repeat('00', 32), 'hex'), 'POST', '', 200, now(), now(), 'pay')
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS v_inserted = ROW_COUNT;
        -- Undoes the placeholder, whatever happened.
        RAISE EXCEPTION USING ERRCODE = 'P0001';
    EXCEPTION
        WHEN lock_not_available THEN
            RETURN 'in_flight';
        WHEN raise_exception THEN
            RETURN CASE WHEN v_inserted = 1 THEN 'absent' ELSE 'present' END;
    END;
END
$$;
