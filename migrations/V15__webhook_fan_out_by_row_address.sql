-- The fan-out (migrations/V14) reaches its events by their row addresses, so its cost does not
-- grow with the events table.
--
-- V14's statement joined the batch of awaiting events (taken by the partial index) back to
-- webhook_events on its key, and the planner chose by the table's statistics: a hash join over
-- a sequential scan of the whole table (kept a week: every event, fanned out or not) when they
-- were fresh, worse plans when they were stale (right after a bulk of inserts or a TRUNCATE).
-- Measured on 30,000 awaiting events behind a 31,000-row table, 1,000 per call: 0.78 ms per
-- event with stale statistics, 0.024 once analysed, the seq scan still reading every page; in
-- make bench (17:51) one round's backlog drained at 2711 events/s and the next at 543, with
-- 1.6 ms of PostgreSQL CPU per event. By row address (a TID scan) the plan is the same
-- whatever the statistics: the partial index yields the batch, each row is read once.
--
-- A row address is safe here: only a fan-out updates an awaiting event, one at a time (the
-- advisory lock), and the purge deletes only events that are not awaiting; the UPDATE still
-- re-checks awaiting_fan_out on the row it reaches.

CREATE OR REPLACE FUNCTION oncepay_webhook_fan_out(p_limit int)
RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    v_n int;
BEGIN
    -- "whfanout" in ASCII.
    IF NOT pg_try_advisory_xact_lock(8604244658212254068) THEN
        RETURN NULL;
    END IF;
    WITH fanned AS (
        UPDATE webhook_events ev
           SET awaiting_fan_out = CASE WHEN EXISTS (
                   SELECT FROM webhook_endpoints e
                    WHERE e.tenant_id = ev.tenant_id AND e.disabled_at IS NULL AND e.deleted_at IS NULL
                      AND e.created_at <= ev.created_at
                      AND (e.event_types IS NULL OR ev.event_type = ANY (e.event_types)))
               THEN NULL ELSE false END
         WHERE ev.ctid = ANY (ARRAY(SELECT due.ctid FROM webhook_events due
                                     WHERE due.awaiting_fan_out
                                     ORDER BY due.sequence
                                     LIMIT p_limit))
           AND ev.awaiting_fan_out
        RETURNING ev.tenant_id, ev.event_id, ev.event_type, ev.resource_id, ev.created_at, ev.sequence),
    written AS (
        -- In event order: the identity that orders a resource's deliveries is taken row by row.
        INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, resource_id, next_attempt_at, created_at)
        SELECT f.tenant_id, f.event_id, e.endpoint_id, f.resource_id, now(), f.created_at
          FROM fanned f
          JOIN webhook_endpoints e
            ON e.tenant_id = f.tenant_id AND e.disabled_at IS NULL AND e.deleted_at IS NULL
           AND e.created_at <= f.created_at
           AND (e.event_types IS NULL OR f.event_type = ANY (e.event_types))
         ORDER BY f.sequence, e.endpoint_id
        RETURNING 1)
    SELECT count(*) INTO v_n FROM fanned;
    RETURN v_n;
END
$$;
