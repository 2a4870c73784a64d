-- The key retention each server keeps its keys for, so that no purger deletes them sooner.
--
-- Until now the purge deleted a key row once it was older than the purger's own
-- ONCEPAY_RETENTION_SECS and past its replay window. A purge started with a shorter retention
-- than the servers' (another environment, a typo: ONCEPAY_RETENTION_SECS=60 beside servers
-- keeping keys 7 days) deleted keys past their window that the servers still refused with 422
-- idempotency_key_expired; a retry of one then ran again and charged twice (found from
-- outside, docs/operations.md "The purge").
--
-- Each server now writes here the retention it keeps keys for, valid until `declared_until`
-- (renewed while it runs: src/purge.rs), and every purge keeps keys for the longest retention
-- still in force: one whose server may have made a key that is not that old yet
-- (`declared_until` + the retention is still ahead). A retention changed on purpose takes
-- effect for the keys made after it, once the last server of the old one stopped declaring
-- it that long ago. Replicas of the previous version write nothing here, and their purge
-- reads nothing: run the purge from new replicas during the rollout.
CREATE TABLE oncepay_key_retention (
    retention_secs bigint PRIMARY KEY CHECK (retention_secs > 0),
    declared_until timestamptz NOT NULL
);
