//! oncepay: a payment API whose retried requests never charge twice.
//!
//! Layers, from the bottom up (each module depends only on those below it; ARCHITECTURE.md
//! has the map):
//! 1. values: `domain`, `json`, `config`, `operation` (the operation table);
//! 2. the protocol: `idempotency`;
//! 3. the database: `db` (pool, migrations, its own error type);
//! 4. effects on it: `ledger`, `batch` (payments several to a statement), `tenants`, `purge`,
//!    `audit`, `webhooks` (the endpoints, and the workers that deliver the outbox's events);
//! 5. the edge, the only layer that knows HTTP: `metrics`, `error`, `auth`, `telemetry`,
//!    `state`, `routes`, `http1` (the HTTP/1.1 server and its framing errors), `startup`
//!    (which only composes).
//!
//! The other side, a Rust client (and the CLI's client commands) that retries safely, is the
//! crate `oncepay-client` (`client/`); the rules both sides share (key syntax, header names,
//! problem codes) are the crate `oncepay-protocol` (`protocol/`), which both depend on.

pub mod audit;
pub mod auth;
pub mod batch;
pub mod config;
pub mod db;
pub mod domain;
pub mod error;
pub mod http1;
pub mod idempotency;
pub mod json;
pub mod ledger;
pub mod metrics;
pub mod operation;
pub mod purge;
pub mod routes;
pub mod startup;
pub mod state;
pub mod telemetry;
pub mod tenants;
pub mod throttle;
pub mod tls;
pub mod top_ups;
pub mod webhooks;

/// The commit this build was made from (build.rs: `ONCEPAY_BUILD_COMMIT`, git's `HEAD`, or
/// `unknown`): every build's package version is the same, and during a rollout replicas of
/// two builds serve together.
pub const BUILD_COMMIT: &str = env!("ONCEPAY_BUILD_COMMIT");

/// What `oncepay --version` prints after the name: `0.1.0 (commit 0123456789ab)`.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("ONCEPAY_BUILD_COMMIT"),
    ")"
);
