-- A page of a tenant's refunded payments reads refunded payments only (found from outside,
-- 2026-12-07).
--
-- `GET /payments?status=refunded` read the tenant's list index newest first and checked each
-- row on the heap: under 15,695 newer unrefunded payments its first page took 12.7 ms against
-- 2.9 for any other page, and a tenant that refunds rarely would have it read its whole list
-- (a statement timeout's 503 on millions of payments). This partial index holds refunded
-- payments only, in the list's order; the list's query for that status names its predicate
-- (`refunded_at IS NOT NULL`), so generic and custom plans alike read a page of it. A refund
-- that sets `refunded_at` adds the payment's entry; as the predicate names that column, a
-- refund is no longer a HOT update: it adds an entry to each of the table's four indexes, as
-- it did before only when the payment's page had no room for the new version (a refund
-- soon after its payment usually found room: 347 of 446 updates of payments were HOT in the
-- test suite's database).
--
-- The build reads the whole of `payments` under a SHARE lock, so writes to it (payments)
-- wait until the migration commits: on a large table that takes writes, build it first with
-- `CREATE INDEX CONCURRENTLY` under the same name (docs/operations.md, V41); this then finds
-- it. It locks no other table, so it cannot deadlock with the payments as V24 did.

DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                WHERE NOT i.indisvalid AND c.relname = 'payments_refunded_list_idx') THEN
        RAISE EXCEPTION 'invalid index payments_refunded_list_idx (a CREATE INDEX CONCURRENTLY that failed): DROP INDEX it, then migrate again';
    END IF;
END
$$;

CREATE INDEX IF NOT EXISTS payments_refunded_list_idx ON payments (tenant_id, created_at, payment_id)
    WHERE refunded_at IS NOT NULL;
