-- A payment's lookups by key never turn into a scan of the whole table.
--
-- Every row a payment, a transfer, a refund or a top-up reads or locks is found by its key
-- (`(tenant_id, key)` of idempotency_keys, `(tenant_id, account_id)` of accounts, ...). PL/pgSQL
-- plans each statement of a function once per connection and keeps the plan until the table's
-- statistics change (an ANALYZE). A table that was vacuumed or analysed while empty has
-- statistics saying "no rows": a plan made then reads it by a sequential scan, cheaper than the
-- index for no rows, and every connection keeps that plan while the table grows, until
-- autovacuum's next ANALYZE (up to a minute on a default cluster). Each payment then reads
-- every key row.
--
-- Measured (make bench's lists step, reproduced on 1,000,000 payments): a database made afresh
-- and vacuumed before its first payment, then new payments at c=32: 2,165-2,973 per second at
-- 0.36-1.6 ms of PostgreSQL CPU per payment for the first 10-40 s (idempotency_keys: 18,706
-- sequential scans reading 367 million rows), against 7,400-7,700 at 0.12 ms once analysed.
-- A production database meets it after a restore (`vacuumdb --analyze` on an empty table), or
-- when a quiet week's purge empties idempotency_keys and autovacuum vacuums it.
--
-- So the functions of the payment paths plan with sequential scans disabled: every table they
-- touch has the index they look up by, and the planner then takes it whatever the statistics
-- say. Measured cost of the setting: 0.4 microseconds a call (a million calls of a trivial
-- function, with and without it). Sequential scans stay possible where no index serves (the
-- setting only prices them out). A later `CREATE OR REPLACE FUNCTION` of one of these keeps
-- the setting only if it repeats `SET enable_seqscan = off` (tests/api/key_lookups.rs fails without it).
-- Every overload of each (some top-up functions keep the signature of their previous version
-- for replicas that still call it).
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
              WHERE p.pronamespace = current_schema()::regnamespace
                AND p.proname = ANY (ARRAY[
                    'oncepay_claim', 'oncepay_decline', 'oncepay_pay', 'oncepay_pay_batch',
                    'oncepay_pay_in_batch', 'oncepay_pay_many', 'oncepay_refund', 'oncepay_transfer',
                    'oncepay_deposit', 'oncepay_open_account', 'oncepay_event_data', 'oncepay_emit_event',
                    'oncepay_top_up_begin', 'oncepay_top_up_fail', 'oncepay_top_up_intent_created', 'oncepay_top_up_next_key',
                    'oncepay_top_up_refund_begin', 'oncepay_top_up_refund_failed', 'oncepay_top_up_refund_wait', 'oncepay_top_up_refunded',
                    'oncepay_top_up_renew', 'oncepay_top_up_succeed', 'oncepay_top_up_wait'])
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET enable_seqscan = off', f);
    END LOOP;
END
$$;
