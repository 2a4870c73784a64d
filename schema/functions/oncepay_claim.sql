CREATE OR REPLACE FUNCTION public.oncepay_claim(p_tenant uuid, p oncepay_claim_args, p_resource_id text)
 RETURNS oncepay_claimed
 LANGUAGE plpgsql
AS $function$
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
$function$


