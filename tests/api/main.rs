//! The API tests: a real server, a real PostgreSQL, real HTTP.

mod concurrency;
mod errors;
mod fuzz;
mod hardening;
mod helpers;
mod limits;
mod openapi;
mod operations;
mod payments;
mod policy;
mod security;
mod tenancy;
