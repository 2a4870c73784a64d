-- pgbench: the limit of a page of GET /payments?limit=100 (make bench, the list steps): the same
-- 100 rows read by a bare SELECT through the list's index (payments_list_idx, migrations/V24),
-- the cursor's (created_at, id) given: 'infinity' and the largest uuid for the first page.
-- oncepay's statement (src/ledger/lists/payments.rs) also looks the cursor's time up from its
-- id, in the same statement, reads one row more to tell has_more, and sends the page as one
-- row of columns (src/ledger/lists/columns.rs); then it renders JSON over HTTP.
-- -D variables: tenant, cursor_at, cursor_id.
SELECT * FROM payments
 WHERE tenant_id = :tenant AND (created_at, payment_id) < (:cursor_at, :cursor_id)
 ORDER BY created_at DESC, payment_id DESC
 LIMIT 100;
