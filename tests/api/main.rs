//! The API tests: a real server, a real PostgreSQL, real HTTP.

mod audit;
mod bench_sql;
mod brownout;
mod cli;
mod client;
mod client_limits;
mod commands;
mod concurrency;
mod errors;
mod failover;
mod fault_proxy;
mod fuzz;
mod hardening;
mod helpers;
mod limits;
mod openapi;
mod operations;
mod payments;
mod policy;
mod purge;
mod security;
mod tenancy;
