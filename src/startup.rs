//! Builds the HTTP server from settings: only assembly here, routes configure themselves.

use std::net::TcpListener;
use std::sync::Arc;

use actix_web::dev::Server;
use actix_web::{middleware, web, App, HttpServer};
use anyhow::Context;

use crate::auth::TenantCache;
use crate::batch::{Batcher, Limits};
use crate::config::Settings;
use crate::db;
use crate::idempotency::cache::ReplayCache;
use crate::metrics::Metrics;
use crate::state::AppState;
use crate::topup::processor::ProcessorClient;
use crate::topup::{completer, TopUps};
use crate::webhooks::{Deliverer, SecretBox};
use crate::{http1, purge, routes, telemetry};

/// A bound, not yet running, server: the API and the operations listener.
pub struct Application {
    port: u16,
    server: Server,
    operations_port: u16,
    operations: Server,
    state: web::Data<AppState>,
}

impl Application {
    /// Connects, checks the schema and binds `settings.bind` and `settings.metrics_bind`
    /// (port 0 picks a free port).
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let db = db::Db::new(&settings)?;
        db::check_schema(&db).await?;
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
        };
        let replays = ReplayCache::new(settings.replay_cache_entries);
        let metrics = Metrics::new();
        metrics.register_db(&db);
        let payments = (settings.db_batch_max > 1).then(|| {
            let limits = Limits {
                max_items: settings.db_batch_max,
                in_flight: settings.db_batches_in_flight,
                // As many as could wait for a pooled connection without batching.
                queue: settings.db_batch_max * settings.db_batches_in_flight * 4,
                queue_wait: settings.db_acquire_timeout,
                tenant_share: settings.db_tenant_share,
            };
            Batcher::start(db.clone(), limits, metrics.batch.clone())
        });
        let top_ups = match &settings.processor {
            None => None,
            Some(processor) => {
                let client = ProcessorClient::new(processor, metrics.processor.clone())?;
                Some(TopUps::new(
                    db.clone(),
                    client,
                    settings.currency.clone(),
                    processor.timeout,
                    settings.inflight_wait,
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
        let state = web::Data::new(AppState {
            top_ups,
            db,
            settings,
            tenants: TenantCache::new(),
            metrics,
            replays,
            payments,
            webhook_secrets,
        });
        let app_state = state.clone();
        let counters = state.metrics.connections.clone();
        let server = http1::serve(listener, limits, counters, tls, move || {
            App::new()
                .app_data(app_state.clone())
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
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The operations listener's port (`/metrics`, `/healthz`, `/readyz`).
    pub fn operations_port(&self) -> u16 {
        self.operations_port
    }

    /// Runs until the server stops (SIGINT/SIGTERM: graceful shutdown).
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let purger = self.state.settings.purge_interval.map(|every| {
            let state = self.state.clone();
            let schedule = purge::Schedule {
                db: state.db.clone(),
                retention: state.settings.retention,
                batch: state.settings.purge_batch_size,
                every,
            };
            tokio::spawn(async move { purge::schedule(schedule, |deleted| state.metrics.record_purge(deleted)).await })
        });
        let completer = self.state.top_ups.clone().map(|top_ups| {
            let after = self.state.settings.completer_after;
            let counters = self.state.metrics.completer.clone();
            tokio::spawn(completer::run(top_ups, after, counters))
        });
        // Every replica delivers webhooks, unless its concurrency is 0.
        let deliverer = match self.state.settings.webhooks.concurrency {
            1.. => {
                let deliverer = Deliverer::new(
                    self.state.db.clone(),
                    self.state.webhook_secrets.clone(),
                    self.state.settings.webhooks.clone(),
                    self.state.metrics.webhooks.clone(),
                )
                .map_err(std::io::Error::other)?;
                Some(tokio::spawn(Arc::new(deliverer).run()))
            }
            _ => None,
        };
        // The operations listener lives as long as the API: it stops when the API stops.
        let operations = self.operations.handle();
        let operations_task = tokio::spawn(self.operations);
        let result = self.server.await;
        operations.stop(true).await;
        let _ = operations_task.await;
        if let Some(purger) = purger {
            purger.abort();
        }
        if let Some(completer) = completer {
            completer.abort();
        }
        if let Some(deliverer) = deliverer {
            deliverer.abort();
        }
        self.state.db.close().await;
        result
    }

    /// The running server's state, for tests that need the database or the metrics.
    pub fn state(&self) -> Arc<AppState> {
        self.state.clone().into_inner()
    }
}
