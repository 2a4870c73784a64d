//! [`Conn`]: a pooled connection whose every call is correct for the pooler in front of
//! PostgreSQL, and is closed rather than reused when it may carry a broken state.

use std::sync::Arc;

use deadpool::managed::Object;
use sqlx::{Executor, PgConnection};

use super::error::is_connection_broken;
use super::pool::Connector;
use super::{DbError, Session};
use crate::config::Pooler;

/// A pooled connection, used only through [`Conn::run`] and [`Conn::transaction`], so that
/// each call is correct for the pooler in front of PostgreSQL. It is closed instead of
/// returned when it failed at the connection level (the next request must not inherit a
/// dead socket), or when it was dropped in the middle of a call or a transaction (a
/// cancelled request: its protocol state or an open transaction must not reach the next).
pub struct Conn {
    /// `None` only once dropped.
    conn: Option<Object<Connector>>,
    session: Arc<Session>,
    /// A call or an explicit transaction started on it and has not ended cleanly.
    unsettled: bool,
    /// It must be closed, not returned.
    broken: bool,
}

impl Conn {
    pub(super) fn new(conn: Object<Connector>, session: Arc<Session>) -> Self {
        Self {
            conn: Some(conn),
            session,
            unsettled: false,
            broken: false,
        }
    }

    /// Runs `f`, which makes one database call (one statement: the SQL functions apply a
    /// whole operation in one), so that it is correct in either pooler mode:
    ///
    /// - `none`: `f` runs as is, autocommit: one round trip with a cached statement.
    /// - `transaction`: `f` runs inside [`Conn::transaction`]. sqlx sends Parse/Describe
    ///   and Bind/Execute with a Sync between them (sqlx issue #67); only an open
    ///   transaction keeps the pooler from giving the second half to another server
    ///   connection, and its `BEGIN` carries the statement timeout (`SET LOCAL`) that the
    ///   start-up packet cannot.
    pub async fn run<T>(
        &mut self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, DbError> {
        match self.session.pooler {
            Pooler::None => {
                self.unsettled = true;
                let result = f(self.raw()).await;
                self.unsettled = false;
                self.discard_if_broken(result)
            }
            Pooler::Transaction => self.transaction(f).await,
        }
    }

    /// Runs `f` in one explicit transaction, committed when `f` succeeds and rolled back
    /// when it fails; `f` must not begin one itself.
    pub async fn transaction<T>(
        &mut self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, DbError> {
        let session = Arc::clone(&self.session);
        self.unsettled = true;
        let conn = self.raw();
        let mut result = match conn.execute(session.begin.as_str()).await {
            Ok(_) => f(&mut *conn).await,
            Err(err) => Err(err),
        };
        let mut ended = false;
        if result.is_ok() {
            match conn.execute(session.commit).await {
                Ok(_) => ended = true,
                Err(err) => result = Err(err),
            }
        }
        if let Err(err) = &result {
            // Also after a refused commit: the ROLLBACK is then a no-op that still
            // deallocates. A connection whose transaction did not end is closed (`Drop`).
            ended = !is_connection_broken(err) && conn.execute(session.rollback).await.is_ok();
        }
        self.unsettled = !ended;
        self.discard_if_broken(result)
    }

    /// Closes the connection instead of returning it to the pool (it reached a node that
    /// cannot take writes: behind a proxy, a new connection reaches the current primary).
    pub fn discard(&mut self) {
        self.broken = true;
    }

    /// Whether it failed at the connection level (it will be closed, not returned).
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    fn raw(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("a Conn holds its connection until dropped")
    }

    fn discard_if_broken<T>(&mut self, result: Result<T, sqlx::Error>) -> Result<T, DbError> {
        if let Err(err) = &result {
            if is_connection_broken(err) {
                self.broken = true;
            }
        }
        result.map_err(DbError::from)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.unsettled || self.broken {
            if let Some(conn) = self.conn.take() {
                let reason = if self.broken { "broken" } else { "abandoned" };
                if let Some(pool) = Object::pool(&conn) {
                    pool.manager().closed.with_label_values(&[reason]).inc();
                }
                // Out of the pool; dropping it closes the socket, and PostgreSQL rolls back
                // whatever was open.
                drop(Object::take(conn));
            }
        }
    }
}
