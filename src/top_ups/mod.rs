//! Card top-ups: the phases of migrations/V8 and V23 driven across the processor calls between
//! them (Brandur Leach's atomic phases; docs/top-ups.md; docs/top-ups.md).
//!
//! ```text
//!  begin (tx) ──create PaymentIntent──▶ intent_created (tx) ──confirm──▶ succeed | fail (tx)
//!                                                           └─ waits ──▶ wait (tx) … look again
//!  refund_begin (tx: debit) ──create refund──▶ refunded | refund_failed (tx: credit back)
//!                                          └─ pending ──▶ refund_wait (tx) … look again
//! ```
//!
//! - No database connection is held while a processor call is out: each phase takes a pooled
//!   connection for its one statement and gives it back.
//! - Whoever holds the top-up's lease drives it: the request that created it, a retry with the
//!   same key once the lease is free, or the completer of any replica once the top-up is due.
//!   The lease lasts twice the processor timeout plus 2 s; before each call the driver renews
//!   it if what is left would not cover the call ([`Lease`]), and every phase's write checks
//!   that the driver still owns it: a driver that stalled past its lease, while another took
//!   it, writes nothing.
//! - The PaymentIntent's id is committed before it is confirmed. A driver that resumes (any
//!   driver but the one that just committed the id) first GETs it, and decides by its status
//!   (`drive`). So a top-up never has two PaymentIntents that were confirmed, whatever the
//!   processor does with `Idempotency-Key`. A PaymentIntent created whose id was never
//!   committed (the answer lost, the process killed) stays unconfirmed: it charges nothing
//!   (`oncepay audit` lists it).
//! - A 5xx the processor answers again under its key (Stripe saves it for a day) is resolved by
//!   reading the processor's state, then, if the call did not take effect, by the next key of
//!   the call's series (the series is in the row, so every driver continues it).
//! - When a call's outcome is unknown the driver gives the lease back and the request answers
//!   503: the client's retry with the same key resumes at once. A PaymentIntent (or refund)
//!   that waits at the processor is recorded with the time of the next look, and the lease
//!   given back.

pub mod completer;
mod drive;
mod failure;
pub mod processor;
mod refund;

use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::db::{Db, DbError};
use crate::domain::{TenantId, TopUpId};
use crate::ledger::top_ups::{self, Begun, NewTopUp};
use crate::ledger::{ClaimArgs, TopUpRow};
use crate::operation::{ClaimOutcome, Decline};
use processor::ProcessorClient;

/// Steps of a drive before it gives up for now: each is one processor call or one phase;
/// a top-up needs three at most when nothing goes wrong, a saved 5xx adds three.
const MAX_STEPS: usize = 12;

/// How a top-up (or refund) request ends, for the edge to answer.
#[derive(Debug)]
pub enum Answer {
    /// The top-up succeeded (or the refund was made). `replayed`: it was final before this
    /// request came.
    Done {
        row: TopUpRow,
        replayed: bool,
    },
    /// The refund's debit is made and the processor's refund is pending: the top-up is
    /// `refund_pending` until it ends (202).
    RefundPending {
        row: TopUpRow,
    },
    /// A stored decline; the row when the decline belongs to a top-up (the processor's
    /// `decline_code`).
    Declined {
        decline: Decline,
        row: Option<TopUpRow>,
        replayed: bool,
    },
    KeyReused,
    KeyExpired,
}

#[derive(Debug, thiserror::Error)]
pub enum TopUpError {
    #[error(transparent)]
    Db(#[from] DbError),
    /// The processor's outcome is unknown: the key stays with the operation, which a retry
    /// with the same key (or the completer) resumes.
    #[error("the processor's outcome for top-up {top_up} is unknown: {why}")]
    ProcessorUnknown { top_up: TopUpId, why: String },
    /// The PaymentIntent waits at the processor (`requires_action`, `requires_capture` before
    /// the action timeout, `processing`): recorded, looked at again later.
    #[error("the PaymentIntent of top-up {top_up} is {processor_status} at the processor")]
    Waiting { top_up: TopUpId, processor_status: String },
    /// Another request or replica drives this top-up, still after the in-flight wait.
    #[error("another request is driving this top-up")]
    InProgress,
}

/// Counters of the completer (registered by `crate::metrics`).
#[derive(Clone)]
pub struct CompleterCounters {
    /// `oncepay_completer_runs_total{outcome}`: `ok` or `error`.
    pub runs: prometheus::IntCounterVec,
    /// `oncepay_completer_operations_total{result}`: operations it drove, by how they ended
    /// (`finished`, `waiting`, `unknown`).
    pub operations: prometheus::IntCounterVec,
    /// `oncepay_top_ups_unfinished`: top-ups and refunds waiting for the processor (all
    /// tenants), as of the last completer run.
    pub unfinished: prometheus::IntGauge,
    /// `oncepay_top_up_oldest_unfinished_seconds`: how long the oldest of them has waited.
    pub oldest_unfinished: prometheus::IntGauge,
}

/// The clocks of the top-ups (from the settings).
#[derive(Clone, Copy, Debug)]
pub struct Clocks {
    /// `ONCEPAY_PROCESSOR_TIMEOUT_MS`: the longest one call takes.
    pub timeout: Duration,
    /// `ONCEPAY_INFLIGHT_WAIT_MS`.
    pub inflight_wait: Duration,
    /// `ONCEPAY_COMPLETER_AFTER_SECS`: also the first interval between looks at a status
    /// that waits.
    pub completer_after: Duration,
    /// `ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS`.
    pub action_timeout: Duration,
}

/// Connections of the top-ups' own pool (the drives' and the completer's phases): each
/// holds one for a statement, never across a call to the processor.
///
/// Their own, not the server's pool, and driven on the main runtime ([`TopUps::runtime`]):
/// a socket is served by the reactor of the Tokio runtime that opened it, and the server's
/// pool, like the processor client's, held connections that the HTTP workers opened, each on
/// its own runtime. At a graceful stop an idle worker's runtime ends at once, while another
/// worker still drives a top-up: its call to the processor, on a connection the first worker
/// had opened, was cut ("dispatch task is gone: runtime dropped the dispatch task"), and the
/// client got 503 "outcome unknown" for a call the processor ran (found from outside: 7
/// calls in 5 of 11 graceful stops).
pub const TOP_UP_CONNECTIONS: usize = 4;

/// The top-ups of one process: its database, its processor client and its clocks.
#[derive(Clone)]
pub struct TopUps {
    /// [`TOP_UP_CONNECTIONS`] of its own.
    db: Db,
    /// The runtime the server was built on (the process's main one, which runs until it
    /// ends), where every drive runs, so that the connections a drive opens, to the database
    /// and to the processor, live as long as the process.
    runtime: tokio::runtime::Handle,
    processor: ProcessorClient,
    currency: String,
    /// `ONCEPAY_PROCESSOR_NAME`, recorded with each top-up; and the names the completer
    /// finishes (that one, and the URL, which rows written before migrations/V23 carry).
    name: String,
    finishes: Vec<String>,
    lease: Duration,
    clocks: Clocks,
}

/// The lease a driver holds: its owner and the instant (of this process's clock) until which
/// it surely holds it, counted from before the statement that took or renewed it.
#[derive(Clone, Copy, Debug)]
pub struct Lease {
    pub owner: Uuid,
    until: Instant,
}

impl TopUps {
    pub fn new(db: Db, processor: ProcessorClient, currency: String, name: String, clocks: Clocks) -> Self {
        let finishes = vec![name.clone(), processor.base().to_owned()];
        Self {
            db,
            runtime: tokio::runtime::Handle::current(),
            processor,
            currency,
            name,
            finishes,
            lease: clocks.timeout * 2 + Duration::from_secs(2),
            clocks,
        }
    }

    /// Runs `drive` (a request's top-up or refund, given these top-ups) on
    /// [`Self::runtime`], to its end even if the client hangs up: a drive cut between two
    /// phases would leave its lease to keep a retry waiting until it expires.
    pub async fn drive<T, F>(&self, drive: impl FnOnce(TopUps) -> F) -> Result<T, tokio::task::JoinError>
    where
        T: Send + 'static,
        F: std::future::Future<Output = T> + Send + 'static,
    {
        self.runtime.spawn(drive(self.clone())).await
    }

    pub fn currency(&self) -> &str {
        &self.currency
    }

    /// The processor's name, recorded with each top-up.
    pub fn processor(&self) -> &str {
        &self.name
    }

    fn lease_secs(&self) -> i32 {
        i32::try_from(self.lease.as_secs()).unwrap_or(i32::MAX)
    }

    /// A lease taken by a statement sent at `sent`.
    fn lease_from(&self, owner: Uuid, sent: Instant) -> Lease {
        Lease {
            owner,
            until: sent + self.lease,
        }
    }

    /// `POST /accounts/{id}/top-ups`.
    pub async fn create(
        &self,
        tenant: TenantId,
        claim: &ClaimArgs,
        top_up: &NewTopUp<'_>,
    ) -> Result<Answer, TopUpError> {
        self.within_inflight_wait(move |owner| async move {
            let lease = self.lease_secs();
            let sent = Instant::now();
            let begun = self
                .db
                .run(async |c| top_ups::begin(c, tenant, claim, top_up, owner, lease).await)
                .await?;
            let created = begun.outcome == ClaimOutcome::Created;
            Ok(match settle(begun)? {
                Settled::Final(answer) => Some(answer),
                // The request that created it has just created the row: nothing to look up.
                // A resumed one looks at the processor first.
                Settled::Owned(row) => {
                    let lease = self.lease_from(owner, sent);
                    Some(top_up_answer(
                        self.drive_top_up(row, lease, Driver::of(created)).await?,
                        false,
                    ))
                }
                Settled::Busy => None,
            })
        })
        .await
    }

    /// `POST /top-ups/{id}/refund`.
    pub async fn refund(&self, tenant: TenantId, claim: &ClaimArgs, top_up: TopUpId) -> Result<Answer, TopUpError> {
        self.within_inflight_wait(move |owner| async move {
            let lease = self.lease_secs();
            let sent = Instant::now();
            let begun = self
                .db
                .run(async |c| top_ups::refund_begin(c, tenant, claim, top_up, owner, lease).await)
                .await?;
            let created = begun.outcome == ClaimOutcome::Created;
            Ok(match settle_refund(begun)? {
                Settled::Final(answer) => Some(answer),
                Settled::Owned(row) => {
                    let lease = self.lease_from(owner, sent);
                    Some(self.drive_refund(row, lease, Driver::of(created)).await?.answer())
                }
                Settled::Busy => None,
            })
        })
        .await
    }

    /// Runs `step` with a new lease owner each time until it answers (`Some`: final, or driven
    /// by this request), waiting out another driver's lease for at most
    /// `ONCEPAY_INFLIGHT_WAIT_MS`, then `InProgress` (409).
    async fn within_inflight_wait<F>(&self, mut step: impl FnMut(Uuid) -> F) -> Result<Answer, TopUpError>
    where
        F: std::future::Future<Output = Result<Option<Answer>, TopUpError>>,
    {
        let deadline = tokio::time::Instant::now() + self.clocks.inflight_wait;
        let mut pause = Duration::from_millis(20);
        loop {
            if let Some(answer) = step(Uuid::new_v4()).await? {
                return Ok(answer);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(TopUpError::InProgress);
            }
            tokio::time::sleep(pause.min(deadline - tokio::time::Instant::now())).await;
            pause = (pause * 2).min(Duration::from_millis(250));
        }
    }

    /// Gives the lease back after an unknown outcome (best effort: if this fails too, the
    /// lease expires on its own) and makes the error. A request's driver gives it back for a
    /// retry to resume at once; the completer puts its next look off ([`Self::look_later`]).
    async fn give_back(&self, row: &TopUpRow, owner: Uuid, why: String, driver: Driver) -> TopUpError {
        tracing::warn!(top_up = %row.top_up_id, why, "top-up left unfinished: its outcome at the processor is unknown");
        if driver == Driver::Completer {
            self.look_later(row, owner).await;
        } else if let Err(err) = self.db.run(async |c| top_ups::release(c, row, owner).await).await {
            tracing::warn!(top_up = %row.top_up_id, error = %err, "could not give the lease back; it expires on its own");
        }
        TopUpError::ProcessorUnknown {
            top_up: TopUpId::from_uuid(row.top_up_id),
            why,
        }
    }

    /// Gives the lease back after the completer's look left a top-up's or its refund's outcome
    /// unknown, its next look at the growing interval of a status that waits, not in the next
    /// round. A processor that stays down, or one that answers 404 for the PaymentIntent (an
    /// emulator restarted empty), was otherwise called, and two WARN lines written, every round
    /// for as long as it lasted. A client's retry with the key still looks at once. `row` is
    /// the drive's last: what the drive recorded (a refund's id) is written again as it is.
    async fn look_later(&self, row: &TopUpRow, owner: Uuid) {
        let cap = i32::try_from(MAX_UNKNOWN_CHECK_INTERVAL.as_secs()).unwrap_or(i32::MAX);
        let secs = self.next_check_secs(row.checks).min(cap);
        let scheduled = if row.refund_debited() {
            let (refund, status) = (row.processor_refund_id.as_deref(), row.refund_status.as_deref());
            self.db
                .run(async |c| top_ups::refund_wait(c, row, owner, refund, status, secs, true).await)
                .await
        } else {
            let status = row.processor_status.as_deref();
            self.db
                .run(async |c| top_ups::wait(c, row, owner, status, secs, true).await)
                .await
        };
        match scheduled {
            Ok(next) if next.lease_owner == Some(owner) => {
                tracing::info!(top_up = %row.top_up_id, next_look_secs = secs, "top-up's outcome unknown: looked at again later");
            }
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(top_up = %row.top_up_id, error = %err, "could not schedule the next look at a top-up")
            }
        }
    }

    /// Seconds to the next look at a status that waits, after `checks` looks: the completer's
    /// window, doubled with each look, at most an hour.
    fn next_check_secs(&self, checks: i32) -> i32 {
        let doublings = u32::try_from(checks.clamp(0, 12)).unwrap_or(0);
        let secs = self
            .clocks
            .completer_after
            .as_secs()
            .max(1)
            .saturating_mul(1 << doublings);
        i32::try_from(secs.min(MAX_CHECK_INTERVAL.as_secs())).unwrap_or(i32::MAX)
    }
}

/// Who drives a top-up or its refund.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Driver {
    /// The request that created it: it goes on from where it stands.
    First,
    /// A client's retry with the key: it looks at the processor first.
    Retry,
    /// The completer: it looks first, and puts its next look off when the outcome stays
    /// unknown.
    Completer,
}

impl Driver {
    /// The driver of a request whose claim `created` the operation, or resumed it.
    fn of(created: bool) -> Self {
        if created {
            Self::First
        } else {
            Self::Retry
        }
    }

    /// Looks at the processor before anything else.
    fn resumes(self) -> bool {
        self != Self::First
    }

    /// Its looks at a status that waits count toward the completer's growing interval: a
    /// client's retry looks at once but puts the next look off by nothing (migrations/V38).
    fn counts_looks(self) -> bool {
        self != Self::Retry
    }
}

/// The longest interval between two looks at a status that waits.
const MAX_CHECK_INTERVAL: Duration = Duration::from_secs(3_600);
/// The longest interval between two looks at a top-up whose outcome stayed unknown: shorter,
/// so that the end of a processor's outage finishes its top-ups within minutes.
const MAX_UNKNOWN_CHECK_INTERVAL: Duration = Duration::from_secs(600);

enum Settled {
    Final(Answer),
    /// This request holds the lease of an unfinished top-up (or refund).
    Owned(TopUpRow),
    /// Another driver holds it.
    Busy,
}

/// The answer of a replica without a card processor to a retry whose key stored one
/// ([`top_ups::stored`]; found from outside: a finished top-up's replay through such a replica
/// answered 501 "not configured", which a client takes for final, though the card was
/// charged): a final answer as any replica gives it; a refund still pending its 202; a top-up
/// still processing an unknown outcome (503 naming it: the replicas with a processor, and
/// their completer, end it).
pub fn stored_answer(begun: Begun, refund: bool) -> Result<Answer, TopUpError> {
    if let (ClaimOutcome::Replayed, None, Some(row)) = (begun.outcome, begun.decline, begun.row.as_ref()) {
        if refund && row.refund_debited() {
            return Ok(Answer::RefundPending { row: row.clone() });
        }
        if !refund && *row.status == "processing" {
            return Err(TopUpError::ProcessorUnknown {
                top_up: TopUpId::from_uuid(row.top_up_id),
                why: "this replica has no card processor (ONCEPAY_PROCESSOR_URL) to drive it".to_owned(),
            });
        }
    }
    match if refund { settle_refund(begun)? } else { settle(begun)? } {
        Settled::Final(answer) => Ok(answer),
        Settled::Owned(_) | Settled::Busy => Err(impossible("a stored answer owned or busy".to_owned())),
    }
}

fn settle(begun: Begun) -> Result<Settled, TopUpError> {
    Ok(match (begun.outcome, begun.decline, begun.row, begun.owned) {
        (ClaimOutcome::KeyReused, ..) => Settled::Final(Answer::KeyReused),
        (ClaimOutcome::Expired, ..) => Settled::Final(Answer::KeyExpired),
        (ClaimOutcome::Declined, Some(decline), row, _) => Settled::Final(Answer::Declined {
            decline,
            row,
            replayed: false,
        }),
        (ClaimOutcome::Replayed, Some(decline), row, _) => Settled::Final(Answer::Declined {
            decline,
            row,
            replayed: true,
        }),
        (_, None, Some(row), true) => Settled::Owned(row),
        (ClaimOutcome::Replayed, None, Some(row), false) if *row.status == "processing" => Settled::Busy,
        (ClaimOutcome::Replayed, None, Some(row), false) => Settled::Final(top_up_answer(row, true)),
        (outcome, decline, row, owned) => {
            return Err(impossible(format!(
                "top-up begin answered {outcome:?}, {decline:?}, row present: {}, owned: {owned}",
                row.is_some()
            )))
        }
    })
}

fn settle_refund(begun: Begun) -> Result<Settled, TopUpError> {
    Ok(match (begun.outcome, begun.decline, begun.row, begun.owned) {
        (_, None, Some(row), true) => Settled::Owned(row),
        (ClaimOutcome::Replayed, None, Some(row), false) if row.refund_debited() => Settled::Busy,
        (ClaimOutcome::Replayed, None, Some(row), false) => Settled::Final(Answer::Done { row, replayed: true }),
        (outcome, decline, row, owned) if decline.is_some() || row.is_none() => match settle(Begun {
            outcome,
            decline,
            expires_at: begun.expires_at,
            row,
            owned,
        })? {
            // A refund's declines carry no top-up row: the row may describe a later refund.
            Settled::Final(Answer::Declined { decline, replayed, .. }) => Settled::Final(Answer::Declined {
                decline,
                row: None,
                replayed,
            }),
            other => other,
        },
        (outcome, decline, row, owned) => {
            return Err(impossible(format!(
                "refund begin answered {outcome:?}, {decline:?}, row present: {}, owned: {owned}",
                row.is_some()
            )))
        }
    })
}

/// A settled top-up as its creation's answer: a success, or its stored failure (the same
/// decline its key row stores: `failure::decline_of`).
fn top_up_answer(row: TopUpRow, replayed: bool) -> Answer {
    match row.failure_code.as_deref().map(failure::decline_of) {
        Some(decline) => Answer::Declined {
            decline,
            row: Some(row),
            replayed,
        },
        None => Answer::Done { row, replayed },
    }
}

fn impossible(what: String) -> TopUpError {
    TopUpError::Db(DbError::Unknown(std::sync::Arc::new(sqlx::Error::Decode(what.into()))))
}
