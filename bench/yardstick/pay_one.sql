-- pgbench: one new payment per transaction, the whole of it one pay_once call (one round trip,
-- autocommit), under a key no other transaction uses, on a random account of 1 .. :accounts.
\set account random(1, :accounts)
\set nonce random(1, 9000000000000000000)
SELECT * FROM pay_once(1, 'new-' || :client_id::text || '-' || :nonce::text, sha256(('new-' || :nonce::text)::bytea), 'u' || :account::text, 1);
