//! Webhooks (docs/webhooks.md): endpoints, the events' outbox, and their delivery.
//!
//! The outbox is written by the operations' own SQL functions, in the effect's transaction
//! (`oncepay_emit_event`, migrations/V9): a change commits with its event or not at all, and
//! a replay writes none. This module holds what Rust adds around it:
//! - [`secrets`]: the endpoints' signing secrets, made here and stored encrypted with the
//!   process's key (`ONCEPAY_WEBHOOK_SECRET_KEY`), so a database dump alone cannot sign;
//! - [`signing`]: Standard Webhooks v1 signatures (HMAC-SHA256 over `id.timestamp.body`);
//! - [`target`]: which URLs may receive (no loopback, private or link-local address unless
//!   `ONCEPAY_WEBHOOK_ALLOW_PRIVATE=1`), checked at registration and again at every
//!   connection (the resolver the deliveries use refuses them: DNS rebinding);
//! - [`endpoints`]: the idempotent `POST /webhook-endpoints` effect and the reads;
//! - [`recovery`]: the event log and the attempts listed, resend and recover;
//! - [`delivery`]: the workers every replica runs, sharing the work through PostgreSQL only.
//!
//! Layer 4 (effects): SQL over the pool, an HTTP client; no type of the HTTP server.

pub mod delivery;
pub mod endpoints;
pub mod recovery;
pub mod secrets;
pub mod signing;
pub mod target;

pub use delivery::{Counters, Deliverer, DELIVERER_CONNECTIONS, HEAD_READ};
pub use endpoints::{CreateEndpoint, EnableEndpoint, EndpointRow, EventRow, RotateSecret};
pub use secrets::SecretBox;
