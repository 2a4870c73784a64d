//! Builds the HTTP server from settings: only assembly here, routes configure themselves.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::{middleware, web, App, HttpServer};
use anyhow::Context;
use sqlx::PgPool;

use crate::auth::TenantCache;
use crate::config::Settings;
use crate::db::{self, Conn};
use crate::error::ApiError;
use crate::idempotency::Windows;
use crate::metrics::Metrics;
use crate::{purge, routes, telemetry};

/// What every handler shares.
pub struct AppState {
    pub pool: PgPool,
    pub settings: Settings,
    pub tenants: TenantCache,
    pub metrics: Metrics,
}

impl AppState {
    /// A pooled connection, counted in `oncepay_db_pool_waiting` while it is awaited.
    pub async fn conn(&self) -> Result<Conn, ApiError> {
        self.metrics.pool_waiting.inc();
        let conn = db::acquire(&self.pool).await;
        self.metrics.pool_waiting.dec();
        conn
    }

    pub fn windows(&self) -> Windows {
        Windows {
            replay: self.settings.replay_window,
            fingerprint: self.settings.fingerprint_window,
        }
    }
}

/// A bound, not yet running, server.
pub struct Application {
    port: u16,
    server: Server,
    state: web::Data<AppState>,
}

impl Application {
    /// Connects, checks the schema and binds `settings.bind` (port 0 picks a free port).
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let pool = db::pool(&settings)?;
        db::check_schema(&pool).await?;
        let listener = TcpListener::bind(&settings.bind).with_context(|| format!("cannot bind {}", settings.bind))?;
        let tls = match (&settings.tls_cert, &settings.tls_key) {
            (Some(cert), Some(key)) => Some(crate::tls::server_config(cert, key)?),
            _ => None,
        };
        let port = listener.local_addr()?.port();
        let workers = settings.workers;
        let state = web::Data::new(AppState {
            pool,
            settings,
            tenants: TenantCache::new(),
            metrics: Metrics::new(),
        });
        let app_state = state.clone();
        let server = HttpServer::new(move || {
            App::new()
                .app_data(app_state.clone())
                .wrap(middleware::from_fn(telemetry::request_log))
                .configure(routes::configure)
        })
        .workers(workers)
        // Slow clients (slowloris) are dropped: headers within 5 s, idle keep-alive 30 s.
        .client_request_timeout(Duration::from_secs(5))
        .client_disconnect_timeout(Duration::from_secs(1))
        .keep_alive(Duration::from_secs(30))
        .shutdown_timeout(10);
        let server = match tls {
            Some(tls) => server.listen_rustls_0_23(listener, tls)?,
            None => server.listen(listener)?,
        }
        .run();
        Ok(Self { port, server, state })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Runs until the server stops (SIGINT/SIGTERM: graceful shutdown).
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let purger = self
            .state
            .settings
            .purge_interval
            .map(|every| tokio::spawn(purge::schedule(self.state.clone().into_inner(), every)));
        let result = self.server.await;
        if let Some(purger) = purger {
            purger.abort();
        }
        self.state.pool.close().await;
        result
    }

    /// The running server's state, for tests that need the pool or the metrics.
    pub fn state(&self) -> Arc<AppState> {
        self.state.clone().into_inner()
    }
}
