-- V26's `SET enable_seqscan = off` on the functions the server calls, not on those only they
-- call.
--
-- A function's SET clause costs PostgreSQL 15 about 8,000 instructions a call (on the way out
-- it walks every setting to restore the one it changed). `make sql-callgrind` against the
-- revision before V26: +16,651 a replay (oncepay_pay, then oncepay_claim: two such calls),
-- +15,279 a payment in a batch of eight (oncepay_pay_in_batch and oncepay_claim for each),
-- +26,585 a pooled replay. A setting stays in force for every function a function calls, and
-- PL/pgSQL plans a called function's statements under it, so the functions only ever called
-- from functions that set it need no clause of their own:
--
-- - oncepay_pay_in_batch is called by oncepay_pay_batch alone;
-- - oncepay_claim is called by every operation's function: those of V26, and the five of the
--   webhook endpoints below, which take the setting now (they had none, and a plan of
--   oncepay_claim made under one of them would have been kept for all: a connection keeps one
--   plan per statement of a function, whoever called it first).
--
-- After (same measurement): +8,526 a replay, +2,346 a payment in a batch of eight, +15,204 a
-- payment alone (the webhook endpoints' check by index, where a scan of an empty table is
-- cheaper), +18,300 a pooled replay.
--
-- A new function that calls oncepay_claim must be declared `SET enable_seqscan = off`
-- (ARCHITECTURE.md, Traps).
ALTER FUNCTION oncepay_claim(uuid, oncepay_claim_args, text) RESET enable_seqscan;

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = current_schema()::regnamespace
                AND p.proname = 'oncepay_pay_in_batch'
    LOOP
        EXECUTE format('ALTER FUNCTION %s RESET enable_seqscan', f);
    END LOOP;
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = current_schema()::regnamespace
                AND p.proname = ANY (ARRAY[
                    'oncepay_create_webhook_endpoint', 'oncepay_enable_webhook_endpoint',
                    'oncepay_recover_webhook_endpoint', 'oncepay_resend_webhook_event',
                    'oncepay_rotate_webhook_secret'])
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET enable_seqscan = off', f);
    END LOOP;
END
$$;
