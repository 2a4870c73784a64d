CREATE OR REPLACE FUNCTION public.oncepay_recover_webhook_reopen(p_tenant uuid, p_endpoint uuid, p_since timestamp with time zone, p_after timestamp with time zone, p_limit integer, p_key text, p_fingerprint bytea)
 RETURNS TABLE(known boolean, changed integer, last_created timestamp with time zone)
 LANGUAGE plpgsql
 SET enable_seqscan TO 'off'
AS $function$
#variable_conflict use_column
DECLARE
    ep webhook_endpoints;
    v_from timestamptz := greatest(p_since, p_after);
    v_until timestamptz;
BEGIN
    SELECT e.* INTO ep FROM webhook_endpoints e
     WHERE e.tenant_id = p_tenant AND e.endpoint_id = p_endpoint AND e.deleted_at IS NULL
       FOR SHARE;
    IF NOT FOUND THEN
        known := false; changed := 0; last_created := NULL;
        RETURN NEXT;
        RETURN;
    END IF;
    -- The slice's last creation time: that of its `p_limit`-th delivery.
    SELECT d.created_at INTO v_until FROM webhook_deliveries d
     WHERE d.tenant_id = p_tenant AND d.endpoint_id = p_endpoint
       AND d.state IN ('given_up', 'cancelled') AND d.created_at >= v_from
       AND (p_after IS NULL OR d.created_at > p_after)
     ORDER BY d.created_at
    OFFSET p_limit - 1 LIMIT 1;
    changed := oncepay_recover_webhook_reopen_rows(p_tenant, p_endpoint, ep.disabled_at IS NOT NULL,
                                                    v_from, p_after, v_until);
    PERFORM oncepay_recover_webhook_progress(p_tenant, p_key, p_fingerprint, changed);
    known := true; last_created := v_until;
    RETURN NEXT;
END
$function$


