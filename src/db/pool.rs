//! The pool: deadpool over sqlx connections, checked only when they sat idle.

use std::sync::Arc;
use std::time::Duration;

use deadpool::managed::{Manager, Metrics, Object, PoolError, RecycleResult, TimeoutType, Timeouts};
use prometheus::{IntCounterVec, Opts};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

use super::DbError;
use crate::throttle::Throttle;

/// A connection that sat unused this long is pinged before it is handed out: it may have
/// been cut while idle (a failover, a pooler restart). One used more recently answered its
/// last call, so it is handed out as it is.
const IDLE_BEFORE_PING: Duration = Duration::from_secs(1);

/// Opens and hands out the pool's connections (deadpool's [`Manager`]).
///
/// Why not sqlx's own pool: it sends a `Sync` and waits for the answer every time a
/// connection goes back to the pool (`ping` on release, sqlx-core 0.8 and 0.9), so each
/// request cost PostgreSQL a second wake-up and the server a second round trip: measured
/// with `make bench-ab`, new payments ran 1.23x faster without it (docs/bench/analysis.md).
/// Here a connection is checked only when it leaves the pool after [`IDLE_BEFORE_PING`];
/// one whose call failed at the connection level, or that was dropped in the middle of a
/// call or a transaction, is closed instead of returned ([`super::Conn`]).
#[derive(Clone)]
pub(super) struct Connector {
    options: PgConnectOptions,
    pub(super) closed: IntCounterVec,
    /// Whether each new session sets [`CHECK_CLIENT`] (direct connections to PostgreSQL 14
    /// or later; a transaction-mode pooler keeps no session setting).
    check_client: bool,
}

/// Found from outside: a process killed (SIGKILL, the OOM killer) while its payment waited on
/// an account's row lock left the statement waiting, and it committed seconds later when the
/// lock was freed, unanswered and unlogged. PostgreSQL looks at the client's socket while a
/// statement runs only if told to (14+): with this, it ends the killed process's statements
/// within a second. Not a start-up option: an older server refuses the whole connection for
/// a parameter it does not know.
const CHECK_CLIENT: &str = "SET client_connection_check_interval = '1s'";

/// The first server version with `client_connection_check_interval`.
const CHECK_CLIENT_SINCE: u32 = 140_000;

/// Without the connect options: they hold the database password.
impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector").finish_non_exhaustive()
    }
}

impl Manager for Connector {
    type Type = PgConnection;
    type Error = sqlx::Error;

    async fn create(&self) -> Result<PgConnection, sqlx::Error> {
        let mut conn = PgConnection::connect_with(&self.options).await?;
        if self.check_client && conn.server_version_num().is_some_and(|v| v >= CHECK_CLIENT_SINCE) {
            sqlx::Executor::execute(&mut conn, CHECK_CLIENT).await?;
        }
        Ok(conn)
    }

    async fn recycle(&self, conn: &mut PgConnection, metrics: &Metrics) -> RecycleResult<sqlx::Error> {
        if metrics.last_used() >= IDLE_BEFORE_PING {
            if let Err(err) = conn.ping().await {
                self.closed.with_label_values(&["dead_idle"]).inc();
                return Err(err.into());
            }
        }
        Ok(())
    }
}

pub(super) type Pool = deadpool::managed::Pool<Connector>;

/// A pool of at most `size` connections, opened when first needed; a caller waits at most
/// `acquire_timeout` for one (also for opening it). `closed` counts the connections it closes
/// instead of reusing ([`closed_counter`]; pools of one process share one). `direct`: its
/// sessions are PostgreSQL's own, not a transaction-mode pooler's ([`CHECK_CLIENT`]).
pub(super) fn pool(
    options: PgConnectOptions,
    size: usize,
    acquire_timeout: Duration,
    closed: IntCounterVec,
    direct: bool,
) -> Pool {
    let timeout = Some(acquire_timeout);
    build(
        Connector {
            options,
            closed,
            check_client: direct,
        },
        size,
        Timeouts {
            wait: timeout,
            create: timeout,
            recycle: timeout,
        },
    )
}

/// A pool like `of` (its connect options, timeouts and count of closed connections) of its
/// own `size` connections.
pub(super) fn sibling(of: &Pool, size: usize) -> Pool {
    build(of.manager().clone(), size, of.timeouts())
}

fn build(connector: Connector, size: usize, timeouts: Timeouts) -> Pool {
    Pool::builder(connector)
        .max_size(size)
        .timeouts(timeouts)
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .expect("a runtime is set, so the timeouts are valid")
}

/// `oncepay_db_connections_closed_total{reason}`.
pub(super) fn closed_counter() -> IntCounterVec {
    IntCounterVec::new(
        Opts::new(
            "oncepay_db_connections_closed_total",
            "Pooled connections closed instead of reused: broken (a connection-level failure or a \
             read-only node), abandoned (a call or transaction cancelled midway), dead_idle (failed \
             the ping after sitting idle)",
        ),
        &["reason"],
    )
    .expect("valid metric")
}

/// What the pool holds now: connections open, of which idle, and the most it may open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStatus {
    pub size: usize,
    pub idle: usize,
    pub max: usize,
}

/// Pools counted as one (the list pools of every worker).
impl std::iter::Sum for PoolStatus {
    fn sum<I: Iterator<Item = Self>>(pools: I) -> Self {
        pools.fold(
            Self {
                size: 0,
                idle: 0,
                max: 0,
            },
            |sum, s| Self {
                size: sum.size + s.size,
                idle: sum.idle + s.idle,
                max: sum.max + s.max,
            },
        )
    }
}

/// The warning that no connection could be opened: once every [`NO_CONNECTION_EVERY`] with
/// the count since, not once a request (a database away for 20 s at a few requests a second
/// wrote 179 such lines).
static NO_CONNECTION: Throttle = Throttle::new(NO_CONNECTION_EVERY);
const NO_CONNECTION_EVERY: Duration = Duration::from_secs(10);

/// Takes a connection from the pool: [`DbError::Saturated`] when every connection stayed
/// busy, [`DbError::Transient`] when none can be opened (database down), logged.
pub(super) async fn acquire(pool: &Pool) -> Result<Object<Connector>, DbError> {
    acquire_unlogged(pool).await.inspect_err(|err| {
        if let DbError::Transient(err) = err {
            match NO_CONNECTION.admit(std::time::Instant::now()) {
                Some(held_back) => {
                    tracing::warn!(error = %err, failures_since_last_line = held_back, "no database connection")
                }
                None => tracing::debug!(error = %err, "no database connection"),
            }
        }
    })
}

/// [`acquire`] without its warning, for a caller that reports the failure itself.
pub(super) async fn acquire_unlogged(pool: &Pool) -> Result<Object<Connector>, DbError> {
    let err = match pool.get().await {
        Ok(conn) => return Ok(conn),
        // Waiting for a permit: every connection is checked out.
        Err(PoolError::Timeout(TimeoutType::Wait)) => return Err(DbError::Saturated),
        Err(PoolError::Backend(err)) => err,
        Err(PoolError::Closed) => sqlx::Error::PoolClosed,
        Err(PoolError::Timeout(_)) => sqlx::Error::PoolTimedOut,
        Err(PoolError::NoRuntimeSpecified | PoolError::PostCreateHook(_)) => {
            unreachable!("the pool has a runtime and no hooks")
        }
    };
    Err(DbError::Transient(Arc::new(err)))
}
