-- An endpoint may name every event type the API lists (found from outside, 2026-12-07):
-- V23 added `top_up.refund_failed` to the domain of event types but not to the CHECK of
-- `webhook_endpoints.event_types` (V9's list of seven), so `POST /webhook-endpoints` naming it
-- answered 500 internal_error, every time, while an endpoint of every type (no `events`)
-- received it. The CHECK now casts the list to the domain's array (the cast fails on a type
-- the domain lacks), so that the domain is the one list of types: a type added to it can be
-- named at once. NULL is an endpoint of every type, as before.
--
-- The table holds a few rows a tenant; the new CHECK is validated while the ALTER holds its
-- lock, which only the endpoints' own writes and the claim's reads of this table wait for.

ALTER TABLE webhook_endpoints
    DROP CONSTRAINT webhook_endpoints_event_types_check,
    ADD CONSTRAINT webhook_endpoints_event_types_check
        CHECK (event_types IS NULL OR event_types::oncepay_webhook_event_type[] IS NOT NULL);
