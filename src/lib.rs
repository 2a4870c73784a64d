//! oncepay: a payment API whose retried requests never charge twice.
//!
//! Layers, from the edge in: `routes` (HTTP) -> `idempotency` (the protocol) and `ledger`
//! (money movements) -> PostgreSQL (`db`, `migrations/`). Only `routes`, `auth`, `error`,
//! `telemetry` and `http1` (the server's HTTP/1.1 edge) know HTTP.
//! `client` is the other side: a Rust client (and the CLI's client commands) that retries safely.

pub mod audit;
pub mod auth;
#[cfg(feature = "bench")]
pub mod bench;
pub mod client;
pub mod config;
pub mod db;
pub mod domain;
pub mod error;
pub mod http1;
pub mod idempotency;
pub mod json;
pub mod ledger;
pub mod metrics;
pub mod purge;
pub mod routes;
pub mod startup;
pub mod telemetry;
pub mod tenants;
