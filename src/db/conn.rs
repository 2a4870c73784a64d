//! [`Conn`]: a pooled connection whose every call is correct for the pooler in front of
//! PostgreSQL, and is closed rather than reused when it may carry a broken state.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use deadpool::managed::Object;
use sqlx::{Executor, PgConnection, Postgres, Row};

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
                let deadline = self.session.deadline;
                let result = answered(deadline, f(self.raw())).await;
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
        let deadline = session.deadline;
        self.unsettled = true;
        let conn = self.raw();
        // Each round trip waits for its answer at most `deadline`.
        let mut result = match answered(deadline, conn.execute(session.begin.as_str())).await {
            Ok(_) => answered(deadline, f(&mut *conn)).await,
            Err(err) => Err(err),
        };
        let mut ended = false;
        if result.is_ok() {
            match answered(deadline, conn.execute(session.commit)).await {
                Ok(_) => ended = true,
                Err(err) => result = Err(err),
            }
        }
        if let Err(err) = &result {
            // Also after a refused commit: the ROLLBACK is then a no-op that still
            // deallocates. A connection whose transaction did not end is closed (`Drop`).
            ended = !is_connection_broken(err) && answered(deadline, conn.execute(session.rollback)).await.is_ok();
        }
        self.unsettled = !ended;
        self.discard_if_broken(result)
    }

    /// Runs `statement`, whose one parameter `$1` is text, with `argument` rendered in its
    /// place as a literal, in one simple-protocol `Query` message: **one round trip in either
    /// pooler mode**, where [`Conn::run`] makes four through a transaction-mode pooler
    /// (docs/scaling.md). With a pooler the message starts with the settings that the
    /// start-up packet carries in mode `none` (`SET LOCAL`: a multi-statement message is one
    /// implicit transaction, and the statement timeout is armed for each of its
    /// statements); nothing is prepared, so nothing is left on the server connection.
    ///
    /// `statement` is meant to be a compile-time checked one (`sqlx::query!`'s `sql()`),
    /// so that what runs here is the checked text with only `$1` replaced. The argument
    /// reaches PostgreSQL as hexadecimal digits (`convert_from(decode('…', 'hex'),
    /// 'UTF8')`): no character of it can end the literal, whatever the server's settings
    /// and the client encoding. Its one column of its one row is decoded as `O`, from
    /// PostgreSQL's text form (the simple protocol has no binary results).
    pub async fn fetch_rendered<O>(&mut self, statement: &str, argument: &str) -> Result<O, DbError>
    where
        O: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
    {
        let message = match render(statement, argument) {
            Ok(rendered) if self.session.settings.is_empty() => rendered,
            Ok(rendered) => format!("{}; {rendered}", self.session.settings),
            Err(err) => return Err(DbError::from(err)),
        };
        self.unsettled = true;
        let deadline = self.session.deadline;
        // A `&str` without arguments is sent as a simple-protocol `Query` message.
        let result = match answered(deadline, self.raw().fetch_all(message.as_str())).await {
            Ok(rows) => match rows.as_slice() {
                [row] => row.try_get::<O, _>(0),
                rows => Err(sqlx::Error::Decode(
                    format!("a rendered statement answered {} rows, not one", rows.len()).into(),
                )),
            },
            Err(err) => Err(err),
        };
        self.unsettled = false;
        self.discard_if_broken(result)
    }

    /// The pooler mode its calls are made for.
    pub fn pooler(&self) -> Pooler {
        self.session.pooler
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

/// `call`'s result if PostgreSQL answered within `deadline` (`None`: however long it takes);
/// else an I/O error, which makes the connection broken (closed, never reused: its protocol
/// state is unknown) and the call's outcome unknown ([`DbError::Unknown`]): a statement sent
/// before the silence may still commit.
async fn answered<T>(
    deadline: Option<Duration>,
    call: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    let Some(deadline) = deadline else {
        return call.await;
    };
    tokio::time::timeout(deadline, call).await.unwrap_or_else(|_| {
        Err(sqlx::Error::Io(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "PostgreSQL did not answer within {} s (the statement timeout and a margin): the \
                 connection is closed, and the call may have committed",
                deadline.as_secs_f64()
            ),
        )))
    })
}

/// `statement` with its one parameter, `$1`, replaced by a text literal of `argument` made of
/// hexadecimal digits only. A statement with any other parameter, or with `$1` more than
/// once, is refused before anything is sent (a bug of the caller: nothing ran).
fn render(statement: &str, argument: &str) -> Result<String, sqlx::Error> {
    let parameters: Vec<(usize, &str)> = statement
        .match_indices('$')
        .map(|(at, _)| {
            let digits = statement[at + 1..]
                .find(|c: char| !c.is_ascii_digit())
                .map_or(&statement[at + 1..], |end| &statement[at + 1..at + 1 + end]);
            (at, digits)
        })
        .filter(|(_, digits)| !digits.is_empty())
        .collect();
    let [(at, "1")] = parameters.as_slice() else {
        return Err(sqlx::Error::InvalidArgument(format!(
            "a rendered statement takes one parameter, $1, once; this one has {parameters:?}"
        )));
    };
    Ok(format!(
        "{}(convert_from(decode('{}', 'hex'), 'UTF8')){}",
        &statement[..*at],
        hex::encode(argument),
        &statement[at + 2..]
    ))
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

#[cfg(test)]
mod tests {
    use super::render;

    #[test]
    fn the_argument_is_rendered_as_hexadecimal_digits_only() {
        let argument = "'); DROP TABLE payments; --\\ $1";
        let rendered = render("SELECT f($1::text::jsonb) AS x", argument).unwrap();
        assert_eq!(
            rendered,
            format!(
                "SELECT f((convert_from(decode('{}', 'hex'), 'UTF8'))::text::jsonb) AS x",
                hex::encode(argument)
            )
        );
        let literal = rendered.split('\'').nth(1).unwrap();
        assert!(literal.chars().all(|c| c.is_ascii_hexdigit()), "{literal}");
        assert_eq!(hex::decode(literal).unwrap(), argument.as_bytes());
    }

    #[test]
    fn a_statement_with_another_parameter_or_none_is_refused() {
        for statement in ["SELECT 1", "SELECT $2", "SELECT $1, $2", "SELECT $10", "SELECT $1, $1"] {
            assert!(render(statement, "x").is_err(), "{statement}");
        }
        assert!(
            render("SELECT $1 AS \"price in $\"", "x").is_ok(),
            "a $ without digits is no parameter"
        );
    }
}
