-- API keys of their own: a tenant may hold several, each revocable (issue 22). The first key
-- of every tenant is copied from tenants.api_key_hash, which stays (expand, then contract):
-- replicas of the previous version keep looking keys up there during a rollout; this version
-- reads api_keys only, so a key revoked here is refused by it. Drop the column once no
-- replica of the previous version runs.
CREATE TABLE api_keys (
    tenant_id    uuid        NOT NULL REFERENCES tenants (tenant_id),
    key_id       uuid        NOT NULL,
    key_hash     bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    last_used_at timestamptz,
    revoked_at   timestamptz,
    CONSTRAINT api_keys_pkey PRIMARY KEY (tenant_id, key_id),
    CONSTRAINT api_keys_key_hash_key UNIQUE (key_hash),
    CONSTRAINT api_keys_key_hash_check CHECK (octet_length(key_hash) = 32)
);

INSERT INTO api_keys (tenant_id, key_id, key_hash, created_at)
SELECT tenant_id, gen_random_uuid(), api_key_hash, created_at FROM tenants;
