-- A client's retry of a top-up or refund that waits at the processor no longer puts the
-- completer's next look off (found from outside, 2026-12-07).
--
-- Each look at a PaymentIntent that waits (`processing`, `requires_action`) or a refund that
-- is `pending` counted: `checks + 1`, and the next look at the completer's window doubled per
-- look (at most an hour). A client retrying with its key as `Retry-After: 5` told it, eight
-- times in 40 s, moved the completer's next look 59:59 away: when Stripe then charged the
-- card and the client had stopped asking, the account waited up to an hour for its credit
-- and `oncepay audit` reported "charged, not credited" meanwhile. The client's looks now
-- record what they saw but count nothing, and never move the next look later than it was.
-- New overloads (`p_counted`): a replica of the previous version calls the old signatures,
-- which stay as they are.

CREATE FUNCTION oncepay_top_up_wait(p_tenant uuid, p_top_up uuid, p_owner uuid,
                                    p_processor_status text, p_next_check_secs integer, p_counted boolean)
RETURNS top_ups
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET processor_status = p_processor_status, checks = t.checks + p_counted::integer,
           next_check_at = CASE
               WHEN p_counted OR t.next_check_at IS NULL THEN now() + make_interval(secs => p_next_check_secs)
               ELSE least(t.next_check_at, now() + make_interval(secs => p_next_check_secs))
           END,
           lease_expires_at = now(), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.status = 'processing'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;

CREATE FUNCTION oncepay_top_up_refund_wait(p_tenant uuid, p_top_up uuid, p_owner uuid, p_refund text,
                                           p_refund_status text, p_next_check_secs integer, p_counted boolean)
RETURNS top_ups
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    r top_ups;
BEGIN
    UPDATE top_ups t
       SET processor_refund_id = p_refund, refund_status = p_refund_status, checks = t.checks + p_counted::integer,
           next_check_at = CASE
               WHEN p_counted OR t.next_check_at IS NULL THEN now() + make_interval(secs => p_next_check_secs)
               ELSE least(t.next_check_at, now() + make_interval(secs => p_next_check_secs))
           END,
           lease_expires_at = now(), updated_at = now()
     WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up AND t.refund_state = 'debited'
       AND t.lease_owner = p_owner
    RETURNING t.* INTO r;
    IF NOT FOUND THEN
        SELECT t.* INTO r FROM top_ups t WHERE t.tenant_id = p_tenant AND t.top_up_id = p_top_up;
    END IF;
    RETURN r;
END
$$;
