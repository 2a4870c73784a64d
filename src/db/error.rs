//! [`DbError`]: what a failed database call means for the request that made it, decided from
//! what PostgreSQL said (its SQLSTATE) or from the fact that it said nothing.
//!
//! The line that matters most is between a call that PostgreSQL *answered with an error*
//! (it rolled the statement back: nothing committed) and one whose answer never arrived or
//! could not be read (it may have committed). Only the first may be run again by the server;
//! the second is [`DbError::Unknown`], and only the client's retry with the same key, which
//! replays a commit, may resolve it.

use std::borrow::Cow;
use std::sync::Arc;

/// A database failure, classified for the layers above.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// SQLSTATE 55P03: a duplicate waited `ONCEPAY_INFLIGHT_WAIT_MS` for the key's original
    /// transaction, which is still running.
    #[error("the key's original request is still in flight")]
    InProgress,
    /// SQLSTATE 55P03 raised by a resend (migrations/V30): an attempt of the event to the
    /// endpoint is out; the resend runs once it is settled.
    #[error("an attempt of the event to the endpoint is out")]
    AttemptOut,
    /// Every pooled connection (or batch slot) is busy: the process is at capacity.
    #[error("every database connection is busy")]
    Saturated,
    /// A payment waited its turn behind an earlier one of the same account, still running
    /// (its row in use), and was refused unrun: the account is busy, not the process.
    #[error("an earlier payment of this account is still running")]
    AccountBusy,
    /// PostgreSQL refused or rolled back the call, or the call never reached it: nothing was
    /// committed, and the same request may succeed later (a deadlock, a serialization
    /// failure, a statement timeout, a node that cannot write, no connection to be had).
    #[error("transient database failure, nothing committed: {0}")]
    Transient(#[source] Arc<sqlx::Error>),
    /// The call may have committed: its connection broke while it was out, or PostgreSQL's
    /// answer could not be read after the statement ran. Never run again by the server; a
    /// retry with the request's key replays the commit if there was one.
    #[error("database outcome unknown, the call may have committed: {0}")]
    Unknown(#[source] Arc<sqlx::Error>),
    /// Anything else that PostgreSQL reported: a bug or a broken invariant (rolled back).
    #[error(transparent)]
    Other(Arc<sqlx::Error>),
}

impl DbError {
    /// Whether PostgreSQL answered the call with an error, which proves that the statement
    /// (and, with autocommit, its transaction) was rolled back, *and* the error belongs to
    /// one of a batch's items rather than to the database's state: a duplicate that waited
    /// too long, a deadlock or serialization failure, a data error. Then the batch's items
    /// may run again one by one. Not after a statement timeout or an out-of-resources error
    /// (running 32 statements instead of one would only feed an overload), nor after
    /// anything whose outcome is unknown.
    pub fn is_one_items(&self) -> bool {
        match self {
            Self::InProgress | Self::AttemptOut => true,
            Self::Transient(err) => matches!(sqlstate(err).as_deref(), Some("40001" | "40P01")),
            Self::Other(err) => matches!(**err, sqlx::Error::Database(_)),
            Self::Saturated | Self::AccountBusy | Self::Unknown(_) => false,
        }
    }

    /// The same failure again, for each item of a batch that shares it: the same error, with
    /// its SQLSTATE and its words (found from outside: copies made as new errors of sqlx's
    /// kinds logged a terminated connection, a statement timeout and a full disk as
    /// "encountered unexpected or invalid data", the words of a row that does not decode).
    pub fn copy(&self) -> Self {
        match self {
            Self::InProgress => Self::InProgress,
            Self::AttemptOut => Self::AttemptOut,
            Self::Saturated => Self::Saturated,
            Self::AccountBusy => Self::AccountBusy,
            Self::Transient(e) => Self::Transient(Arc::clone(e)),
            Self::Unknown(e) => Self::Unknown(Arc::clone(e)),
            Self::Other(e) => Self::Other(Arc::clone(e)),
        }
    }
}

impl From<sqlx::Error> for DbError {
    fn from(err: sqlx::Error) -> Self {
        if is_in_progress(&err) {
            if message(&err).starts_with(ATTEMPT_OUT) {
                Self::AttemptOut
            } else {
                Self::InProgress
            }
        } else if is_pooler_refusal(&err) {
            Self::Transient(Arc::new(err))
        } else if is_outcome_unknown(&err) {
            Self::Unknown(Arc::new(err))
        } else if is_transient(&err) {
            Self::Transient(Arc::new(err))
        } else {
            Self::Other(Arc::new(err))
        }
    }
}

/// The SQLSTATE of an error PostgreSQL reported.
pub(super) fn sqlstate(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(Cow::into_owned),
        _ => None,
    }
}

fn message(err: &sqlx::Error) -> Cow<'_, str> {
    match err {
        sqlx::Error::Database(db) => Cow::Borrowed(db.message()),
        _ => Cow::Borrowed(""),
    }
}

/// The start of the message migrations/V30's resend raises with 55P03.
const ATTEMPT_OUT: &str = "an attempt of this event to this endpoint is out";

/// SQLSTATE 55P03: the key's original transaction outlived `lock_timeout`.
fn is_in_progress(err: &sqlx::Error) -> bool {
    sqlstate(err).as_deref() == Some("55P03")
}

/// The node cannot take this call: it is a standby, in recovery, or shutting down (a
/// failover, seen through a proxy that still points at the old primary). Every way
/// PostgreSQL 15 says so, as seen in failovers:
/// - 25006 read_only_sql_transaction: a write on a standby;
/// - XX000 "cannot assign TransactionIds during recovery": a transaction that needs an id
///   (a replay's commit marker, `pg_logical_emit_message`) on a node in recovery;
/// - 55000 "recovery is in progress": a WAL function on a standby;
/// - 57P01..57P04: the server is shutting down, crashed, starting up or dropped the database;
/// - class 08: the connection itself failed.
///
/// Only a new connection (which a proxy sends to the new primary) can succeed.
pub(super) fn is_node_failure(err: &sqlx::Error) -> bool {
    let Some(code) = sqlstate(err) else {
        return false;
    };
    code == "25006"
        || code.starts_with("08")
        || code.starts_with("57P")
        || (matches!(code.as_str(), "XX000" | "55000") && message(err).contains("recovery"))
}

/// The TLS handshake with the database failed (rustls refused it: a certificate that does not
/// verify, no common protocol) or could not start (`sslmode` asks for TLS the server does not
/// offer, an `sslrootcert` that cannot be read). A connection cut during the handshake is not
/// one: it is a plain I/O error.
pub(super) fn is_tls_refusal(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Tls(_) => true,
        // sqlx reports rustls' refusal as the I/O error that carries it.
        sqlx::Error::Io(io) => io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()),
        _ => false,
    }
}

/// Connection-level failures, after which the connection is closed rather than reused.
pub(super) fn is_connection_broken(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_)) || is_node_failure(err)
}

/// PgBouncer's words when it refuses a call it never passed to PostgreSQL: in transaction
/// mode a server connection is taken only when a call arrives, and these say none could be
/// (logins to PostgreSQL failing, none made, or none free within `query_wait_timeout`).
const POOLER_REFUSALS: [&str; 3] = [
    "server login has been failing",
    "pgbouncer cannot connect to server",
    "query_wait_timeout",
];

/// PgBouncer refused the call before any of it reached PostgreSQL (SQLSTATE 08P01, the code
/// it gives its own errors, with one of [`POOLER_REFUSALS`]): nothing ran. Found from outside:
/// a restart of PostgreSQL behind PgBouncer logged 171 of these as "outcome unknown: the call
/// may have committed".
fn is_pooler_refusal(err: &sqlx::Error) -> bool {
    sqlstate(err).as_deref() == Some("08P01") && POOLER_REFUSALS.iter().any(|m| message(err).starts_with(m))
}

/// The call was out when its connection failed, or its rows arrived and could not be read:
/// PostgreSQL may have committed it. A server that shuts down or crashes (57P01, 57P02)
/// while a commit waits for its standbys may have committed it locally, so they count too.
fn is_outcome_unknown(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_) => true,
        sqlx::Error::Decode(_) | sqlx::Error::ColumnDecode { .. } => true,
        sqlx::Error::Database(_) => {
            sqlstate(err).is_some_and(|c| c.starts_with("08") || matches!(c.as_str(), "57P01" | "57P02"))
        }
        _ => false,
    }
}

/// PostgreSQL rolled the call back, or it never ran; the same request may succeed later.
fn is_transient(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(_) => {
            is_node_failure(err)
                || sqlstate(err).is_some_and(|c| {
                    // serialization, deadlock, statement timeout, lock not available,
                    // object in use, and class 53: insufficient resources
                    matches!(c.as_str(), "40001" | "40P01" | "57014" | "55P03" | "55006") || c.starts_with("53")
                })
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error as PostgreSQL (or PgBouncer, which speaks its protocol) reports it.
    #[derive(Debug)]
    struct Reported {
        code: &'static str,
        message: &'static str,
    }

    impl std::fmt::Display for Reported {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.message)
        }
    }

    impl std::error::Error for Reported {}

    impl sqlx::error::DatabaseError for Reported {
        fn message(&self) -> &str {
            self.message
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.code))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn reported(code: &'static str, message: &'static str) -> DbError {
        DbError::from(sqlx::Error::Database(Box::new(Reported { code, message })))
    }

    #[test]
    fn pgbouncers_refusals_before_postgresql_are_transient_and_its_other_errors_unknown() {
        for message in [
            "server login has been failing, try again later (server_login_retry)",
            "pgbouncer cannot connect to server",
            "query_wait_timeout",
        ] {
            let err = reported("08P01", message);
            assert!(matches!(err, DbError::Transient(_)), "{message}: {err:?}");
        }
        // The server connection died while the call was out: it may have committed.
        assert!(matches!(reported("08P01", "server conn crashed?"), DbError::Unknown(_)));
        assert!(matches!(
            reported("08006", "server login has been failing"),
            DbError::Unknown(_)
        ));
    }

    #[test]
    fn a_batchs_copy_of_a_failure_is_the_same_error_with_its_sqlstate_and_words() {
        // Found from outside: a terminated connection, a statement timeout and a full disk,
        // copied to a batch's items, were logged as "encountered unexpected or invalid data".
        for (code, message) in [
            ("57P01", "terminating connection due to administrator command"),
            ("57014", "canceling statement due to statement timeout"),
            (
                "53100",
                "could not extend file \"base/16385/16584\": No space left on device",
            ),
            ("23514", "new row violates check constraint"),
        ] {
            let err = reported(code, message);
            let copy = err.copy();
            assert_eq!(copy.to_string(), err.to_string());
            assert!(copy.to_string().contains(message), "{copy}");
            let inner = match &copy {
                DbError::Transient(e) | DbError::Unknown(e) | DbError::Other(e) => e,
                other => panic!("{other:?}"),
            };
            assert_eq!(sqlstate(inner).as_deref(), Some(code), "{copy}");
        }
    }
}
