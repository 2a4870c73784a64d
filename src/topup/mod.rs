//! Card top-ups: the phases of migrations/V8 driven across the processor calls between them
//! (Brandur Leach's atomic phases; contract section 4b).
//!
//! ```text
//!  begin (tx) ──create PaymentIntent──▶ intent_created (tx) ──confirm──▶ succeed | fail (tx)
//!  refund_begin (tx: debit) ──create refund──▶ refunded (tx)
//! ```
//!
//! - No database connection is held while a processor call is out: each phase takes a pooled
//!   connection for its one statement and gives it back.
//! - Whoever holds the top-up's lease drives it: the request that created it, a retry with the
//!   same key once the lease is free, or the completer of any replica once the top-up has been
//!   left alone for `ONCEPAY_COMPLETER_AFTER_SECS`. The lease outlasts the longest call
//!   (twice the processor timeout, plus a margin), so two drivers never call at once unless a
//!   process stalls longer than that.
//! - The PaymentIntent's id is committed before it is confirmed. A driver that resumes (any
//!   driver but the one that just committed the id) first GETs it: `succeeded` is recorded,
//!   `requires_confirmation` is confirmed, a decline is recorded. So a top-up never has two
//!   PaymentIntents that were confirmed, whatever the processor does with `Idempotency-Key`.
//!   A PaymentIntent created whose id was never committed (the answer lost, the process
//!   killed) stays unconfirmed: it charges nothing (`oncepay audit` lists it).
//! - When a call's outcome is unknown the driver gives the lease back and the request answers
//!   503: the client's retry with the same key resumes at once.

pub mod completer;
pub mod processor;

use std::time::Duration;

use uuid::Uuid;

use crate::db::{Db, DbError};
use crate::domain::{TenantId, TopUpId};
use crate::ledger::top_ups::{self, Begun, NewTopUp};
use crate::ledger::{ClaimArgs, TopUpRow};
use crate::operation::{ClaimOutcome, Decline};
use processor::{CallError, ProcessorClient};

/// Rounds of a drive before it gives up for now (each round is one processor call or one
/// look at the PaymentIntent; a top-up needs three at most).
const MAX_ROUNDS: usize = 6;

/// How a top-up (or refund) request ends, for the edge to answer.
#[derive(Debug)]
pub enum Answer {
    /// The top-up succeeded (or the refund was made). `replayed`: it was final before this
    /// request came.
    Done {
        row: TopUpRow,
        replayed: bool,
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
    #[error("the processor's outcome is unknown: {0}")]
    ProcessorUnknown(String),
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
    /// (`finished`, `unknown`).
    pub operations: prometheus::IntCounterVec,
    /// `oncepay_top_ups_unfinished`: top-ups and refunds waiting for the processor (all
    /// tenants), as of the last completer run.
    pub unfinished: prometheus::IntGauge,
}

/// The top-ups of one process: its database, its processor client and its clocks.
#[derive(Clone)]
pub struct TopUps {
    db: Db,
    processor: ProcessorClient,
    currency: String,
    lease: Duration,
    inflight_wait: Duration,
}

impl TopUps {
    pub fn new(
        db: Db,
        processor: ProcessorClient,
        currency: String,
        timeout: Duration,
        inflight_wait: Duration,
    ) -> Self {
        Self {
            db,
            processor,
            currency,
            lease: timeout * 2 + Duration::from_secs(2),
            inflight_wait,
        }
    }

    pub fn currency(&self) -> &str {
        &self.currency
    }

    /// The processor's base URL, recorded with each top-up.
    pub fn processor(&self) -> &str {
        self.processor.base()
    }

    fn lease_secs(&self) -> i32 {
        i32::try_from(self.lease.as_secs()).unwrap_or(i32::MAX)
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
            let begun = self
                .db
                .run(async |c| top_ups::begin(c, tenant, claim, top_up, owner, lease).await)
                .await?;
            let created = begun.outcome == ClaimOutcome::Created;
            Ok(match settle(begun)? {
                Settled::Final(answer) => Some(answer),
                // The request that created it has just created the row: nothing to look up.
                // A resumed one looks at the processor first.
                Settled::Owned(row) => Some(top_up_answer(self.drive_top_up(row, owner, !created).await?, false)),
                Settled::Busy => None,
            })
        })
        .await
    }

    /// `POST /top-ups/{id}/refund`.
    pub async fn refund(&self, tenant: TenantId, claim: &ClaimArgs, top_up: TopUpId) -> Result<Answer, TopUpError> {
        self.within_inflight_wait(move |owner| async move {
            let lease = self.lease_secs();
            let begun = self
                .db
                .run(async |c| top_ups::refund_begin(c, tenant, claim, top_up, owner, lease).await)
                .await?;
            let created = begun.outcome == ClaimOutcome::Created;
            Ok(match settle_refund(begun)? {
                Settled::Final(answer) => Some(answer),
                Settled::Owned(row) => Some(Answer::Done {
                    row: self.drive_refund(row, owner, !created).await?,
                    replayed: false,
                }),
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
        let deadline = tokio::time::Instant::now() + self.inflight_wait;
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

    /// Drives a top-up whose lease `owner` holds to a final state, or gives the lease back
    /// and answers `ProcessorUnknown`.
    pub async fn drive_top_up(
        &self,
        mut row: TopUpRow,
        owner: Uuid,
        mut resumed: bool,
    ) -> Result<TopUpRow, TopUpError> {
        for _ in 0..MAX_ROUNDS {
            if *row.status != "processing" {
                return Ok(row);
            }
            let id = row.top_up_id.to_string();
            let step = match row.processor_payment_id.clone() {
                None => self.create_intent(&row, &id, owner).await,
                Some(intent) => self.settle_intent(&row, &id, &intent, resumed).await,
            };
            match step {
                Ok(next) => {
                    resumed = next.1;
                    row = next.0;
                }
                Err(unknown) => return Err(self.give_back(&row, owner, unknown).await),
            }
        }
        if *row.status != "processing" {
            return Ok(row);
        }
        Err(self
            .give_back(&row, owner, "the PaymentIntent did not settle".to_owned())
            .await)
    }

    /// Phase 2: create the PaymentIntent and commit its id. Gives the row after the step and
    /// whether the next step must look before it confirms.
    async fn create_intent(&self, row: &TopUpRow, id: &str, owner: Uuid) -> Result<(TopUpRow, bool), String> {
        let created = self
            .processor
            .create_intent(id, *row.amount, &row.currency, &row.payment_method)
            .await;
        match created {
            Ok(intent) => {
                let next = self
                    .db
                    .run(async |c| top_ups::intent_created(c, row, owner, &intent.id).await)
                    .await
                    .map_err(|e| e.to_string())?;
                // Another driver's PaymentIntent won: look at it before anything else.
                let ours = next.processor_payment_id.as_deref() == Some(intent.id.as_str());
                Ok((next, !ours))
            }
            Err(CallError::Refused { status: 402, error }) => self.fail(row, Decline::CardDeclined, &error).await,
            Err(CallError::Refused {
                status: 400 | 404,
                error,
            }) => self.fail(row, Decline::InvalidPaymentMethod, &error).await,
            Err(err) => Err(err.to_string()),
        }
    }

    /// Phase 3: confirm the committed PaymentIntent (after a look, when resuming) and record
    /// the final state.
    async fn settle_intent(
        &self,
        row: &TopUpRow,
        id: &str,
        intent: &str,
        resumed: bool,
    ) -> Result<(TopUpRow, bool), String> {
        if resumed {
            let seen = self
                .processor
                .retrieve_intent(intent)
                .await
                .map_err(|e| e.to_string())?;
            match seen.status.as_str() {
                "succeeded" => return self.succeed(row, intent).await,
                "requires_confirmation" => {}
                "requires_payment_method" | "canceled" => {
                    let error = seen.last_payment_error.unwrap_or_default();
                    return self.fail(row, Decline::CardDeclined, &error).await;
                }
                other => return Err(format!("PaymentIntent {intent} is {other}")),
            }
        }
        match self.processor.confirm_intent(id, intent).await {
            Ok(confirmed) if confirmed.status == "succeeded" => self.succeed(row, intent).await,
            Ok(confirmed) => Err(format!(
                "PaymentIntent {intent} is {} after its confirmation",
                confirmed.status
            )),
            Err(CallError::Refused { status: 402, error }) => self.fail(row, Decline::CardDeclined, &error).await,
            // It may have been confirmed already (a lost answer): look, then decide.
            Err(CallError::Refused { .. }) => Ok((row.clone(), true)),
            Err(err) => Err(err.to_string()),
        }
    }

    async fn succeed(&self, row: &TopUpRow, intent: &str) -> Result<(TopUpRow, bool), String> {
        let next = self
            .db
            .run(async |c| top_ups::succeed(c, row, intent).await)
            .await
            .map_err(|e| e.to_string())?;
        Ok((next, false))
    }

    async fn fail(
        &self,
        row: &TopUpRow,
        decline: Decline,
        error: &processor::ErrorObject,
    ) -> Result<(TopUpRow, bool), String> {
        let code = error.decline_code.as_deref().or(error.code.as_deref());
        let next = self
            .db
            .run(async |c| top_ups::fail(c, row, decline, code).await)
            .await
            .map_err(|e| e.to_string())?;
        Ok((next, false))
    }

    /// Drives a refund whose lease `owner` holds (the balance already debited) until the
    /// processor refunded, or gives the lease back.
    pub async fn drive_refund(
        &self,
        mut row: TopUpRow,
        owner: Uuid,
        mut resumed: bool,
    ) -> Result<TopUpRow, TopUpError> {
        for _ in 0..MAX_ROUNDS {
            if row.refund_state.as_deref().map(String::as_str) != Some("debited") {
                return Ok(row);
            }
            let Some(intent) = row.processor_payment_id.clone() else {
                return Err(TopUpError::Db(DbError::Other(sqlx::Error::Protocol(
                    "a succeeded top-up without its PaymentIntent".to_owned(),
                ))));
            };
            match self.refund_step(&row, &intent, resumed).await {
                Ok(next) => {
                    resumed = true;
                    row = next;
                }
                Err(unknown) => return Err(self.give_back(&row, owner, unknown).await),
            }
        }
        if row.refund_state.as_deref().map(String::as_str) != Some("debited") {
            return Ok(row);
        }
        Err(self
            .give_back(&row, owner, "the refund did not settle".to_owned())
            .await)
    }

    async fn refund_step(&self, row: &TopUpRow, intent: &str, resumed: bool) -> Result<TopUpRow, String> {
        let id = row.top_up_id.to_string();
        if resumed {
            let refunds = self.processor.list_refunds(intent).await.map_err(|e| e.to_string())?;
            if let Some(done) = refunds
                .iter()
                .find(|r| r.status == "succeeded" || r.status == "pending")
            {
                return self.record_refund(row, &done.id).await;
            }
        }
        match self.processor.create_refund(&id, intent).await {
            Ok(refund) => self.record_refund(row, &refund.id).await,
            // Already refunded (a lost answer) or refused: look again on the next round.
            Err(CallError::Refused { .. }) => Ok(row.clone()),
            Err(err) => Err(err.to_string()),
        }
    }

    async fn record_refund(&self, row: &TopUpRow, refund: &str) -> Result<TopUpRow, String> {
        self.db
            .run(async |c| top_ups::refunded(c, row, refund).await)
            .await
            .map_err(|e| e.to_string())
    }

    /// Gives the lease back after an unknown outcome (best effort: if this fails too, the
    /// lease expires on its own) and makes the error.
    async fn give_back(&self, row: &TopUpRow, owner: Uuid, why: String) -> TopUpError {
        tracing::warn!(top_up = %row.top_up_id, why, "top-up left unfinished: its outcome at the processor is unknown");
        if let Err(err) = self.db.run(async |c| top_ups::release(c, row, owner).await).await {
            tracing::warn!(top_up = %row.top_up_id, error = %err, "could not give the lease back; it expires on its own");
        }
        TopUpError::ProcessorUnknown(why)
    }
}

enum Settled {
    Final(Answer),
    /// This request holds the lease of an unfinished top-up (or refund).
    Owned(TopUpRow),
    /// Another driver holds it.
    Busy,
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
        (ClaimOutcome::Replayed, None, Some(row), false)
            if row.refund_state.as_deref().map(String::as_str) == Some("debited") =>
        {
            Settled::Busy
        }
        (ClaimOutcome::Replayed, None, Some(row), false) => Settled::Final(Answer::Done { row, replayed: true }),
        (outcome, decline, row, owned) if decline.is_some() || row.is_none() => match settle(Begun {
            outcome,
            decline,
            expires_at: begun.expires_at,
            row,
            owned,
        })? {
            // A refund's declines carry no top-up row.
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

/// A settled top-up as its creation's answer: a success, or its stored decline.
fn top_up_answer(row: TopUpRow, replayed: bool) -> Answer {
    match row.failure_code.as_deref() {
        Some("card_declined") => Answer::Declined {
            decline: Decline::CardDeclined,
            row: Some(row),
            replayed,
        },
        Some(_) => Answer::Declined {
            decline: Decline::InvalidPaymentMethod,
            row: Some(row),
            replayed,
        },
        None => Answer::Done { row, replayed },
    }
}

fn impossible(what: String) -> TopUpError {
    TopUpError::Db(DbError::Unknown(sqlx::Error::Decode(what.into())))
}
