//! Pools of one kind, one for each HTTP worker: the list pages' ([`super::Db::for_lists`]).
//!
//! A connection's socket is served by the reactor of the Tokio runtime that opened it, and an
//! HTTP worker is a single-threaded runtime that polls its reactor only between its own tasks.
//! With one pool for all workers, a page read on a connection that another worker had opened
//! learned that its rows had come only once that worker finished what it was doing (writing a
//! page of its own, about 0.1 ms), while its own thread sat idle: side by side (`make
//! bench-ab`, c=8, three runs of three rounds), pages per second 1.07-1.20x (first page) and
//! 1.07-1.18x (deep) with a pool per worker, p99 0.83-0.94x. Each worker's pool is opened by
//! that worker's first pages, so its connections are served by its own reactor.
//!
//! The payments' batcher needs none of this while payments are all a process serves: its
//! dispatcher and the connections it opens share the main runtime, and a pool per worker
//! measured no change there (docs/bench/README.md). Its pool is the one the handlers' own
//! reads (`GET /payments/{id}`, key lookups, ...) use too, first in first out, so under mixed
//! traffic a batch may run on a connection an HTTP worker opened: measured on 2026-12-07
//! (two servers of one build, new payments alternated, one first given 320 GETs, which opened only
//! 4 connections): 0.97x new payments at c=32, p99 1.13x, within the noise. A larger mix may
//! show more. The webhook deliverer has connections of its own for this reason
//! (`webhooks::DELIVERER_CONNECTIONS`: at a stop the workers' runtimes end first).

use std::sync::{Arc, Mutex, PoisonError};

use super::{Db, PoolStatus};

/// The pools of every HTTP worker, made alike from one template.
#[derive(Clone)]
pub struct PerWorker {
    /// Never connects: the connect options, session and timeouts each worker's pool copies.
    template: Db,
    /// Connections of each worker's pool.
    size: usize,
    /// Every pool handed out, for the metrics and for closing them.
    pools: Arc<Mutex<Vec<Db>>>,
}

impl PerWorker {
    /// `template`'s connections shared among `workers` pools: each gets its share, rounded
    /// up, at least one.
    pub fn new(template: Db, workers: usize) -> Self {
        let size = template.status().max.div_ceil(workers.max(1)).max(1);
        Self {
            template,
            size,
            pools: Arc::default(),
        }
    }

    /// A new pool, for the worker that calls this (from its `App` factory, which runs on
    /// the worker's thread; the connections open later, on its first pages). A worker that
    /// actix starts again after a panic gets a new one; the dead worker's stays counted in
    /// the metrics until the process ends.
    pub fn for_worker(&self) -> Db {
        let db = self.template.sibling(self.size);
        self.pools().push(db.clone());
        db
    }

    /// The pools' connections, added up.
    pub fn status(&self) -> PoolStatus {
        self.pools().iter().map(Db::status).sum()
    }

    /// Closes every pool ([`Db::close`]).
    pub async fn close(&self) {
        let pools = self.pools().clone();
        futures_util::future::join_all(pools.iter().map(Db::close)).await;
    }

    fn pools(&self) -> std::sync::MutexGuard<'_, Vec<Db>> {
        // A panic while the list was held left it whole: a push or a clone.
        self.pools.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use sqlx::postgres::PgConnectOptions;

    use super::*;
    use crate::db::DbError;

    fn template(size: usize) -> Db {
        // Nothing listens on port 1; no test here opens a connection but the last, refused.
        Db::direct(PgConnectOptions::new().host("127.0.0.1").port(1), size)
    }

    #[test]
    fn each_worker_gets_its_share_of_the_connections_rounded_up_and_the_metrics_add_them() {
        for (total, workers, each) in [(8, 2, 4), (5, 2, 3), (1, 2, 1), (2, 4, 1), (3, 0, 3)] {
            let lists = PerWorker::new(template(total), workers);
            assert_eq!(lists.status().max, 0, "no worker yet");
            let pools: Vec<Db> = (0..workers.max(1)).map(|_| lists.for_worker()).collect();
            assert!(pools.iter().all(|db| db.status().max == each), "{total} over {workers}");
            let status = lists.status();
            assert_eq!((status.max, status.size, status.idle), (each * workers.max(1), 0, 0));
        }
    }

    #[tokio::test]
    async fn closing_closes_every_workers_pool() {
        let lists = PerWorker::new(template(4), 2);
        let (a, b) = (lists.for_worker(), lists.for_worker());
        lists.close().await;
        for db in [a, b] {
            match db.conn().await {
                Err(DbError::Transient(err)) if matches!(*err, sqlx::Error::PoolClosed) => {}
                Err(other) => panic!("a closed pool failed otherwise: {other:?}"),
                Ok(_) => panic!("a closed pool handed out a connection"),
            }
        }
    }
}
