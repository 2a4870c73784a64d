//! oncepay: a payment API whose retried requests never charge twice.
//!
//! Layers, from the edge in: `routes` (HTTP) -> `idempotency` (the protocol) and `ledger`
//! (money movements) -> PostgreSQL (`db`, `migrations/`). Only `routes`, `auth`, `error`
//! and `telemetry` know HTTP.
//! The other side, a Rust client (and the CLI's client commands) that retries safely, is the
//! crate `oncepay-client` (`client/`); the rules both sides share live in its `protocol`.

pub mod audit;
pub mod auth;
#[cfg(feature = "bench")]
pub mod bench;
pub mod config;
pub mod db;
pub mod domain;
pub mod error;
pub mod idempotency;
pub mod json;
pub mod ledger;
pub mod metrics;
pub mod purge;
pub mod routes;
pub mod startup;
pub mod telemetry;
pub mod tenants;
pub mod tls;
