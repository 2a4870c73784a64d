//! The API tests: a real server, a real PostgreSQL, real HTTP.

// A failed unwrap is a failed test, and tests may print what they measured: the
// lints against both are for the service's code.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

mod admin_tenants;
mod api_keys;
mod audit;
mod batch;
mod batch_faults;
mod bench_sql;
mod brownout;
mod cli;
mod cli_outcomes;
mod client;
mod client_limits;
mod client_transfers;
mod commands;
mod concurrency;
mod connections;
mod dashboards;
mod errors;
mod failover;
mod framing;
mod fuzz;
mod hardening;
mod key_lookups;
mod limits;
mod list_plans;
mod list_pool;
mod lists;
mod lock_order;
mod openapi;
mod operations;
mod payments;
mod pg_tls;
mod policy;
mod pool;
mod pooler;
mod purge;
mod recovery;
mod replay_cache;
mod schema_change;
mod security;
mod sql_functions;
mod startup;
mod stripe_rules;
mod support;
mod tenancy;
mod tls;
mod top_up_audit;
mod top_ups;
mod top_ups_stripe;
mod transfers;
mod webhooks;
mod workspace;
