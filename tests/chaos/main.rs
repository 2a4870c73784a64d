//! Fault tests with real processes and a real PostgreSQL: servers killed with SIGKILL,
//! PostgreSQL stopped and restarted, backends terminated, the pool exhausted, slow clients.
//! Each ends with every operation charged exactly once, no key wedged and `oncepay audit`
//! clean. They stop PostgreSQL, so they are ignored by `make test` and run by `make chaos`
//! on a cluster of their own, one at a time. `--no-capture` shows their figures.

// A failed unwrap is a failed test, and tests may print what they measured: the
// lints against both are for the service's code.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

mod harness;
mod kill;
mod ledger;
mod overload;
mod postgres;
mod processor;
#[allow(dead_code)]
#[path = "../api/support/webhook_receiver.rs"]
mod webhook_receiver;
mod webhooks;
// The API tests' localstripe, shared (some of its helpers serve only those tests).
#[allow(dead_code)]
#[path = "../api/support/stripe.rs"]
mod stripe;
