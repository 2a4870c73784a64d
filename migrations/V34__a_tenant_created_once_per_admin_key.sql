-- POST /admin/tenants with an Idempotency-Key (docs/api.md, admin): a retried creation makes
-- no second tenant (nor a second `main_balance`). The tenant's id is derived from the key
-- (src/tenants.rs, `creation_id`), so the tenants' own primary key is the claim: a
-- concurrent duplicate's insert waits on it for the first transaction, and a transaction
-- that fails leaves nothing behind. What the replay needs is kept on the tenant's row: the
-- request's fingerprint and the end of its replay window (NULL for a tenant made without a
-- key: by the CLI, or by an admin call without one). The row is never purged; a key past its
-- window is refused as expired for as long as the tenant exists.
ALTER TABLE tenants
    ADD COLUMN creation_fingerprint bytea,
    ADD COLUMN creation_expires_at timestamptz,
    ADD CONSTRAINT tenants_creation_key_check
        CHECK ((creation_fingerprint IS NULL) = (creation_expires_at IS NULL));
