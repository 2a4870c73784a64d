//! What every handler shares: the pool, the settings, the tenant cache and the metrics, and
//! whether the database was reached at start-up (until then every call but the probes is 503).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use actix_web::http::StatusCode;
use actix_web::web::Bytes;
use actix_web::HttpRequest;
use prometheus::IntGauge;

use crate::auth::{self, TenantCache};
use crate::batch::Batcher;
use crate::config::Settings;
use crate::db::{Conn, Db, DbError, PerWorker};
use crate::domain::TenantId;
use crate::error::ApiError;
use crate::idempotency::cache::ReplayCache;
use crate::idempotency::Windows;
use crate::ledger::{ClaimArgs, Effect, Outcome, Pay, PaymentRow};
use crate::metrics::Metrics;
use crate::operation::Decline;
use crate::tenants::Tenant;
use crate::webhooks::SecretBox;

/// The longest a list page waits while payments keep the database busy
/// ([`AppState::list_conn`]): under a sustained payment load a client paging through a list
/// reads about 90 pages a second, the order of the read rates APIs such as Stripe's allow.
pub const LIST_YIELD: std::time::Duration = std::time::Duration::from_millis(10);
/// How often a waiting page looks at the batcher again.
const LIST_YIELD_POLL: std::time::Duration = std::time::Duration::from_millis(1);

pub struct AppState {
    /// Every query goes through it (`ONCEPAY_DB_POOLER`), but list pages.
    pub db: Db,
    /// List pages are read through them, a pool per HTTP worker ([`PerWorker`]) made from
    /// [`Db::for_lists`] (planned once, never a table scan).
    pub lists: PerWorker,
    pub settings: Settings,
    pub tenants: TenantCache,
    pub metrics: Metrics,
    /// Finished results this process answers replays from (`ONCEPAY_REPLAY_CACHE_ENTRIES`).
    pub replays: ReplayCache<CachedAnswer>,
    /// New payments, several to a statement under load (`None`: `ONCEPAY_DB_BATCH_MAX=1`).
    pub payments: Option<Batcher<Pay>>,
    /// Card top-ups (`None`: no `ONCEPAY_PROCESSOR_URL`, top-ups answer 501).
    pub top_ups: Option<crate::top_ups::TopUps>,
    /// How the webhook secrets are stored (encrypted under `ONCEPAY_WEBHOOK_SECRET_KEY`, or
    /// as they are without it).
    pub webhook_secrets: Arc<SecretBox>,
    /// Set once `serve` has reached the database and found its schema current.
    pub ready: Readiness,
}

/// The list pool of one HTTP worker ([`PerWorker`]): app data of each worker's `App`, which
/// the list handlers take as an argument.
pub struct WorkerLists(pub Db);

/// Whether `serve` has reached its database and checked the schema (`db::wait_for_schema`),
/// and whether it is stopping. Each starts false and is set once; neither goes back (a
/// database lost later is the calls' 503s and `/readyz`'s business, as before).
#[derive(Debug, Default)]
pub struct Readiness {
    reached: AtomicBool,
    /// When SIGTERM or SIGINT came.
    stopped_at: std::sync::OnceLock<tokio::time::Instant>,
}

impl Readiness {
    pub fn is_set(&self) -> bool {
        self.reached.load(Ordering::Acquire)
    }

    pub fn set(&self) {
        self.reached.store(true, Ordering::Release);
    }

    /// SIGTERM or SIGINT came: the process drains its requests (the API listener takes no new
    /// connection) and `/readyz` is 503 where it still answers, on the operations listener.
    pub fn stop(&self) {
        let _ = self.stopped_at.set(tokio::time::Instant::now());
    }

    pub fn is_stopping(&self) -> bool {
        self.stopped_at.get().is_some()
    }

    /// When the process was told to stop, if it was.
    pub fn stopped_at(&self) -> Option<tokio::time::Instant> {
        self.stopped_at.get().copied()
    }
}

/// A finished result as the replay cache keeps it: the answer, as the database's replay
/// would rebuild it.
#[derive(Debug)]
pub enum CachedAnswer {
    Success {
        status: StatusCode,
        body: Bytes,
        location: Option<String>,
    },
    Declined(Decline),
}

impl AppState {
    /// Whether the start-up check of the database passed.
    pub fn is_ready(&self) -> bool {
        self.ready.is_set()
    }

    /// 503 until the start-up check of the database passed: a call before it could not
    /// check its key, nor run on a schema not known to be current.
    pub fn check_ready(&self) -> Result<(), ApiError> {
        if self.is_ready() {
            Ok(())
        } else {
            Err(ApiError::Starting)
        }
    }

    /// The request's tenant ([`auth::tenant`]), once the database is ready. Every tenant
    /// call starts here.
    pub async fn tenant(&self, req: &HttpRequest) -> Result<Tenant, ApiError> {
        self.check_ready()?;
        auth::tenant(req, &self.db, &self.tenants).await
    }

    /// The admin token ([`auth::admin`]), once the database is ready. Every admin call
    /// starts here.
    pub fn admin(&self, req: &HttpRequest) -> Result<(), ApiError> {
        self.check_ready()?;
        auth::admin(req, self.settings.admin_token.as_deref())
    }

    /// A pooled connection, counted in `oncepay_db_pool_waiting` while it is awaited (also
    /// when the waiting handler is cancelled: the count is held by a guard).
    pub async fn conn(&self) -> Result<Conn, DbError> {
        let _waiting = Waiting::new(&self.metrics.pool_waiting);
        self.db.conn().await
    }

    /// A pooled connection for a page of a list, which yields to payments: while payments
    /// are the database's work (every batch slot out, or payments queued), the page waits, up to
    /// [`LIST_YIELD`], before it takes a connection. Payments are what clients retry and wait
    /// on; a page costs the database as much as a batch of payments, and a client paging
    /// through every list as fast as it can took 15 % of the payments of a two-core host
    /// (docs/bench/README.md). Under no load a page waits for nothing. The connection is the
    /// list pool of the HTTP worker serving the page ([`WorkerLists`]); while it is awaited it
    /// counts in `oncepay_db_pool_waiting` as a request waiting for any other connection does.
    pub async fn list_conn(&self, lists: &WorkerLists) -> Result<Conn, DbError> {
        if let Some(payments) = &self.payments {
            if payments.busy() {
                self.metrics.list_yields.inc();
                let until = tokio::time::Instant::now() + LIST_YIELD;
                while payments.busy() && tokio::time::Instant::now() < until {
                    tokio::time::sleep(LIST_YIELD_POLL).await;
                }
            }
        }
        let _waiting = Waiting::new(&self.metrics.pool_waiting);
        lists.0.conn().await
    }

    /// Runs `effect` in a statement of its own.
    pub async fn run_alone<E: Effect>(
        &self,
        tenant: TenantId,
        claim: &ClaimArgs,
        effect: &E,
    ) -> Result<Outcome<E::Row>, DbError> {
        let mut conn = self.conn().await?;
        conn.run(async |c| effect.run(c, tenant, claim).await).await
    }

    /// Runs a payment: batched with others waiting, or alone when batching is off.
    pub async fn pay(&self, tenant: TenantId, claim: ClaimArgs, pay: Pay) -> Result<Outcome<PaymentRow>, DbError> {
        match &self.payments {
            Some(batcher) => batcher.run(tenant, claim, pay).await,
            None => self.run_alone(tenant, &claim, &pay).await,
        }
    }

    pub fn windows(&self) -> Windows {
        Windows {
            replay: self.settings.replay_window,
            fingerprint: self.settings.fingerprint_window,
        }
    }
}

/// Counts one waiter in a gauge for as long as it lives.
struct Waiting<'a>(&'a IntGauge);

impl<'a> Waiting<'a> {
    fn new(gauge: &'a IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_waiter_is_uncounted() {
        let gauge = IntGauge::new("waiting", "test").unwrap();
        let waiter = Waiting::new(&gauge);
        assert_eq!(gauge.get(), 1);
        drop(waiter);
        assert_eq!(gauge.get(), 0);
    }
}
