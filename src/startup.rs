//! Builds the HTTP server from settings: only assembly here, routes configure themselves.
//!
//! `serve` binds and answers before it has reached the database: the database is reached and
//! its schema checked in the background, retried with backoff for as long as it takes
//! (`db::wait_for_schema`). Until then the probes answer (`/healthz` 200, `/readyz` 503) and
//! every other call is 503 (`AppState::check_ready`), and the workers that need the database
//! have not started. A database or a pooler still away at start therefore never ends the
//! process (an exit would become a crash loop under Kubernetes or systemd during every
//! failover); a schema behind the binary does, with its one line naming `oncepay migrate`.

use std::net::TcpListener;
use std::sync::Arc;

use actix_web::dev::Server;
use actix_web::{middleware, web, App, HttpServer};
use anyhow::Context;
use tokio::task::{AbortHandle, JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;

use crate::auth::{self, TenantCache};
use crate::batch::{Batcher, Limits};
use crate::config::Settings;
use crate::db;
use crate::idempotency::cache::ReplayCache;
use crate::metrics::Metrics;
use crate::state::{AppState, Readiness, WorkerLists};
use crate::top_ups::processor::ProcessorClient;
use crate::top_ups::{completer, Clocks, TopUps};
use crate::webhooks::{Deliverer, SecretBox};
use crate::{http1, purge, routes, telemetry};

/// A bound, not yet running, server: the API and the operations listener.
pub struct Application {
    port: u16,
    server: Server,
    operations_port: u16,
    operations: Server,
    state: web::Data<AppState>,
    /// The webhook deliverer, started once the database is ready (`None`: concurrency 0).
    deliverer: Option<Arc<Deliverer>>,
}

impl Application {
    /// Binds `settings.bind` and `settings.metrics_bind` (port 0 picks a free port), without
    /// a connection to the database yet: [`Application::run_until_stopped`] makes it. Called
    /// inside a Tokio runtime (the payments' batcher starts its task here).
    pub fn build(settings: Settings) -> anyhow::Result<Self> {
        let db = db::Db::new(&settings)?;
        let lists = db::PerWorker::new(db::Db::for_lists(&settings, &db)?, settings.workers);
        let listener = TcpListener::bind(&settings.bind).with_context(|| format!("cannot bind {}", settings.bind))?;
        let operations_listener = TcpListener::bind(&settings.metrics_bind)
            .with_context(|| format!("cannot bind {} (ONCEPAY_METRICS_BIND)", settings.metrics_bind))?;
        let operations_port = operations_listener.local_addr()?.port();
        let tls = match (&settings.tls_cert, &settings.tls_key) {
            (Some(cert), Some(key)) => Some(crate::tls::server_config(cert, key)?),
            _ => None,
        };
        let port = listener.local_addr()?.port();
        let limits = http1::Limits {
            workers: settings.workers,
            max_connections: settings.max_connections,
            max_connections_per_peer: settings.max_connections_per_peer,
            drain: settings.drain(),
        };
        let replays = ReplayCache::new(settings.replay_cache_entries);
        let metrics = Metrics::new();
        metrics.register_db(&db);
        let payments = (settings.db_batch_max > 1).then(|| {
            // The limit starts at one statement per core (what the fixed default was) and moves
            // between two and the pool's size.
            let initial = settings.db_batches_initial;
            let limits = Limits {
                max_items: settings.db_batch_max,
                in_flight: settings.db_batches_in_flight,
                initial,
                ceiling: settings.db_pool_size as usize,
                // As many as could wait for a pooled connection without batching.
                queue: settings.db_batch_max * settings.db_batches_in_flight.unwrap_or(initial) * 4,
                queue_wait: settings.db_acquire_timeout,
                tenant_share: settings.db_tenant_share,
            };
            Batcher::start(db.clone(), limits, metrics.batch.clone())
        });
        let top_ups = match &settings.processor {
            None => None,
            Some(processor) => {
                let client = ProcessorClient::new(processor, metrics.processor.clone())?;
                tracing::info!(
                    processor = processor.name,
                    "top-ups are recorded with this processor name; set ONCEPAY_PROCESSOR_NAME to it to keep it \
                     when the processor's URL or key changes (docs/top-ups.md)"
                );
                Some(TopUps::new(
                    db.sibling(crate::top_ups::TOP_UP_CONNECTIONS),
                    client,
                    settings.currency.clone(),
                    processor.name.clone(),
                    Clocks {
                        timeout: processor.timeout,
                        inflight_wait: settings.inflight_wait,
                        completer_after: settings.completer_after,
                        action_timeout: settings.topup_action_timeout,
                    },
                ))
            }
        };
        let webhook_secrets = Arc::new(SecretBox::new(settings.webhooks.secret_key.as_ref()));
        if !webhook_secrets.encrypts() {
            tracing::warn!(
                "ONCEPAY_WEBHOOK_SECRET_KEY is unset: webhook signing secrets are stored in the database \
                 unencrypted, so a dump of it could sign messages (docs/security.md)"
            );
        }
        // Every replica delivers webhooks, unless its concurrency is 0.
        let deliverer = match settings.webhooks.concurrency {
            1.. => Some(Arc::new(Deliverer::new(
                db.sibling(crate::webhooks::DELIVERER_CONNECTIONS),
                webhook_secrets.clone(),
                settings.webhooks.clone(),
                metrics.webhooks.clone(),
            )?)),
            _ => None,
        };
        let state = web::Data::new(AppState {
            top_ups,
            db,
            lists,
            settings,
            tenants: TenantCache::new(metrics.unknown_key_lookups.clone()),
            metrics,
            replays,
            payments,
            webhook_secrets,
            ready: Readiness::default(),
        });
        let app_state = state.clone();
        let counters = state.metrics.connections.clone();
        let lists = state.lists.clone();
        let server = http1::serve(listener, limits, counters, tls, move || {
            App::new()
                .app_data(app_state.clone())
                .app_data(web::Data::new(WorkerLists(lists.for_worker())))
                .wrap(middleware::from_fn(telemetry::request_log))
                .configure(routes::configure)
        })?;
        // Plain HTTP on its own (loopback by default) address, one worker: scrapes and probes
        // only, never a tenant's request.
        let ops_state = state.clone();
        let operations = HttpServer::new(move || {
            App::new()
                .app_data(ops_state.clone())
                .configure(routes::configure_operations)
        })
        .workers(1)
        .disable_signals()
        .listen(operations_listener)?
        .run();
        Ok(Self {
            port,
            server,
            operations_port,
            operations,
            state,
            deliverer,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The operations listener's port (`/metrics`, `/healthz`, `/readyz`).
    pub fn operations_port(&self) -> u16 {
        self.operations_port
    }

    /// Runs until the server stops (SIGINT/SIGTERM: graceful shutdown), or until the
    /// database it reached turns out to be behind the binary (`Err`, after a graceful stop).
    /// The listeners answer from the start; the database is reached meanwhile, retried for
    /// as long as it takes, and the workers that need it start once its schema passed.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        // The operations listener lives as long as the API: it stops when the API stops.
        let operations = self.operations.handle();
        let operations_task = tokio::spawn(self.operations);
        let api = self.server.handle();
        let mut api_task = tokio::spawn(self.server);
        // actix-server stops the API listener on the signal; this tells the rest.
        let stopping = CancellationToken::new();
        let watcher = tokio::spawn(on_signal(stopping.clone(), self.state.clone().into_inner()));
        let mut workers = Workers::default();
        let outcome = tokio::select! {
            // Stopped (a signal) before the database was reached: nothing else started.
            joined = &mut api_task => served(joined),
            checked = db::wait_for_schema(&self.state.db) => match checked {
                Ok(()) => {
                    workers = start_workers(&self.state, self.deliverer, &stopping);
                    self.state.metrics.record_database_reached();
                    self.state.ready.set();
                    served((&mut api_task).await)
                }
                // What no wait mends (a schema behind the binary): stop, and say why.
                Err(refused) => {
                    api.stop(true).await;
                    let _ = api_task.await;
                    Err(refused.into())
                }
            },
        };
        watcher.abort();
        workers.stop(self.state.ready.stopped_at()).await;
        self.state.db.close().await;
        self.state.lists.close().await;
        // Last: `/readyz` answers 503 until the process is gone (found from outside: stopped
        // with the API, the listener refused connections while the deliverer still recorded
        // its attempts, and a stopping replica looked dead).
        operations.stop(true).await;
        let _ = operations_task.await;
        outcome
    }

    /// The running server's state, for tests that need the database or the metrics.
    pub fn state(&self) -> Arc<AppState> {
        self.state.clone().into_inner()
    }
}

/// What the API server's task ended with: the server's own result, or the task's panic.
fn served(joined: Result<std::io::Result<()>, JoinError>) -> anyhow::Result<()> {
    Ok(joined.context("the API server's task failed")??)
}

/// The background work that needs the database, to stop with the server.
#[derive(Default)]
struct Workers {
    /// Stopped where they stand: a purge batch or a completer's drive cut short is a
    /// transaction rolled back or a lease that runs out, taken up again by the next.
    aborted: Vec<AbortHandle>,
    /// The deliverer, told to stop (at the signal, while the requests drain, or at the end)
    /// and given the time to record its attempts in flight.
    deliverer: Option<(CancellationToken, JoinHandle<()>, Arc<Deliverer>)>,
    /// The longest a graceful stop waits for the deliverer: its attempts' bound (the
    /// attempt timeout and the head's read) and [`DELIVERER_RECORD_GRACE`] to record them.
    deliverer_drain: std::time::Duration,
}

impl Workers {
    /// `signalled`: when SIGTERM or SIGINT came, if one did.
    async fn stop(self, signalled: Option<tokio::time::Instant>) {
        for worker in self.aborted {
            worker.abort();
        }
        if let Some((stop, mut deliverer, closing)) = self.deliverer {
            stop.cancel();
            // The attempts end by their own bound; the recording may meet a database that
            // does not answer (each try waits up to the statement timeout and a margin): past
            // the grace the attempts are left to their leases, and sent again once those run
            // out, with the same webhook-id, rather than holding the process. The grace
            // counts from the signal, when the deliverer was told to stop.
            let since = signalled.unwrap_or_else(tokio::time::Instant::now);
            if tokio::time::timeout_at(since + self.deliverer_drain, &mut deliverer)
                .await
                .is_err()
            {
                tracing::warn!(
                    seconds = self.deliverer_drain.as_secs_f64(),
                    "webhook deliverer still recording at the end of the graceful stop; its attempts in flight are left to their leases"
                );
                deliverer.abort();
            }
            closing.close().await;
        }
    }
}

/// How long a graceful stop gives the deliverer to record its attempts once they ended.
const DELIVERER_RECORD_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Starts the background work that needs the database: the purge schedule, the top-up
/// completer, the webhook deliverer.
fn start_workers(
    state: &web::Data<AppState>,
    deliverer: Option<Arc<Deliverer>>,
    stopping: &CancellationToken,
) -> Workers {
    let mut workers = Vec::new();
    workers.push(tokio::spawn(auth::keep_known_keys(state.db.clone(), state.tenants.clone())).abort_handle());
    // The keys this server makes are kept its retention, whoever purges them.
    let declared = tokio::spawn(purge::declaring(state.db.clone(), state.settings.retention));
    workers.push(declared.abort_handle());
    if let Some(every) = state.settings.purge_interval {
        let state = state.clone();
        let schedule = purge::Schedule {
            db: state.db.clone(),
            retention: purge::Retention::of(&state.settings),
            batch: state.settings.purge_batch_size,
            every,
        };
        let purger =
            tokio::spawn(async move { purge::schedule(schedule, |deleted| state.metrics.record_purge(deleted)).await });
        workers.push(purger.abort_handle());
    }
    if let Some(top_ups) = state.top_ups.clone() {
        let after = state.settings.completer_after;
        let counters = state.metrics.completer.clone();
        workers.push(tokio::spawn(completer::run(top_ups, after, counters)).abort_handle());
    }
    let deliverer = deliverer.map(|deliverer| {
        let stop = stopping.child_token();
        (stop.clone(), tokio::spawn(deliverer.clone().run(stop)), deliverer)
    });
    Workers {
        aborted: workers,
        deliverer,
        deliverer_drain: state.settings.webhooks.timeout + crate::webhooks::HEAD_READ + DELIVERER_RECORD_GRACE,
    }
}

/// Waits for SIGTERM or SIGINT, then marks the process stopping and cancels `stopping`.
/// actix-server stops the API listener and drains its requests by itself; from that moment
/// `/readyz` is 503 on the operations listener too (a balancer probing there stopped sending
/// before, found from outside: it saw 200 for the whole drain), and the webhook deliverer
/// (its token a child of `stopping`) claims nothing more and finishes its attempts while the
/// requests drain, not after.
async fn on_signal(stopping: CancellationToken, state: Arc<AppState>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::warn!("cannot watch SIGTERM and SIGINT: /readyz stays 200 while the requests drain");
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    state.ready.stop();
    stopping.cancel();
    tracing::info!("oncepay stopping: finishing the requests in flight, /readyz 503");
}
