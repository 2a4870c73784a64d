//! The API tests: a real server, a real PostgreSQL, real HTTP.

mod bench_sql;
mod concurrency;
mod errors;
mod helpers;
mod operations;
mod payments;
mod policy;
mod tenancy;
