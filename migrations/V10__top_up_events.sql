-- Top-up events (contract section 4c): `top_up.succeeded`, `top_up.failed`, `top_up.refunded`,
-- each written in the transaction that makes the change.
--
-- A top-up reaches each of its final states in exactly one place (V8: oncepay_top_up_succeed,
-- oncepay_top_up_fail, oncepay_top_up_refunded), and always by an UPDATE of `top_ups.status`
-- away from what it was. The event is emitted by a trigger on that UPDATE rather than by a
-- copy of the three functions here: the functions stay the one definition of the phases, and a
-- later change to them cannot drop the event. The trigger fires only when the status changes
-- (`WHEN`), so a lease taken or given back, a recovery point or an attempt counted writes
-- nothing; a replay, which reads the row, writes nothing; a rolled-back change rolls its event
-- back with it. Top-ups are few next to payments: a row trigger costs them nothing measurable.
--
-- The data is the top-up as `GET /top-ups/{id}` shows it right after the change.

CREATE FUNCTION oncepay_top_up_event_data(r top_ups) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', r.top_up_id, 'account', r.account_id, 'amount', r.amount, 'currency', r.currency,
        'status', r.status, 'processor_payment_id', r.processor_payment_id,
        'failure_code', r.failure_code, 'created_at', oncepay_json_time(r.created_at))
$$;

CREATE FUNCTION oncepay_top_up_emit_event() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM oncepay_emit_event(NEW.tenant_id,
                               ('top_up.' || NEW.status)::oncepay_webhook_event_type,
                               NEW.top_up_id::text, oncepay_top_up_event_data(NEW));
    RETURN NULL;
END
$$;

CREATE TRIGGER top_ups_emit_event
    AFTER UPDATE OF status ON top_ups
    FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status AND NEW.status IN ('succeeded', 'failed', 'refunded'))
    EXECUTE FUNCTION oncepay_top_up_emit_event();
