CREATE OR REPLACE FUNCTION public.oncepay_key_in_flight(p_tenant uuid, p_key text, p_wait_ms integer)
 RETURNS text
 LANGUAGE plpgsql
AS $function$
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
$function$


