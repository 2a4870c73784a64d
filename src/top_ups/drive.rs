//! The drive of a top-up: create the PaymentIntent and commit its id, confirm it, record how
//! it ended. What a look at the PaymentIntent decides, by its status:
//!
//! | status | oncepay |
//! | --- | --- |
//! | `succeeded` | credits the account (`succeed`) |
//! | `requires_confirmation` | confirms it (with the next key after a saved 5xx; a refusal of the confirmation is then the failure) |
//! | `requires_payment_method` | a decline (`last_payment_error`) |
//! | `requires_action`, `requires_capture` | waits, looked at again; past `ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS` from the top-up's creation, cancels it and stores `authentication_required` / `capture_required` |
//! | `processing` | waits, looked at again at a growing interval |
//! | `canceled` | a failure (`canceled`, or the action timeout's) |

use std::time::Instant;

use chrono::Utc;

use super::failure::{self, Failure};
use super::processor::{CallError, ErrorObject, Intent, KeyedCall};
use super::{Driver, Lease, TopUpError, TopUps, MAX_STEPS};
use crate::domain::TopUpId;
use crate::ledger::top_ups;
use crate::ledger::TopUpRow;

/// How far back from the top-up's creation a search for its PaymentIntents starts: the
/// database's clock and the processor's may differ by this much.
const CLOCK_SLACK_SECS: i64 = 300;

/// The number of a key series past which only the completer moves it on: each number is a
/// saved 5xx met and resolved, so more is a processor failing every call, and a client
/// retrying each second would spend a key a second. Past it the series moves at the
/// completer's pace (its growing interval, at most 10 minutes), never stops: a stop at the
/// last key left the top-up looking at that key's saved 5xx until Stripe pruned it, a day
/// or more after Stripe answered again (found from outside: 24 retries in 24 s did it).
pub(super) const MAX_KEY_SERIES: i32 = 20;

/// Whether `driver` may move a key series on from `from` (see [`MAX_KEY_SERIES`]).
pub(super) fn may_move_series(driver: Driver, from: i32) -> bool {
    from < MAX_KEY_SERIES || driver == Driver::Completer
}

/// Why a drive stops before the top-up is final.
pub(super) enum Stop {
    /// The outcome of a call, or of a phase, is unknown: the lease is given back.
    Unknown(String),
    /// The PaymentIntent (or refund) waits at the processor; recorded (the drive's row is the
    /// row as recorded), the lease given back.
    Waiting,
    /// Another driver took the lease: this one writes nothing more.
    Lost,
}

/// What the next step of a drive must do about the committed PaymentIntent.
#[derive(Clone, Debug)]
enum Next {
    /// Confirm it (the driver that committed it, or a look that found it unconfirmed).
    Confirm,
    /// Look at it first.
    Look,
    /// Look: the confirmation was refused with this error; if it is still unconfirmed, the
    /// refusal is the top-up's failure.
    LookAfterRefusal(u16, ErrorObject),
    /// Look: the confirmation's key answered a saved 5xx; if it is still unconfirmed, confirm
    /// it with the next key.
    LookAfterSavedConfirm,
    /// Look: the cancellation's key answered a saved 5xx.
    LookAfterSavedCancel,
}

/// One drive of one top-up by the holder of its lease.
struct Drive<'a> {
    top_ups: &'a TopUps,
    row: TopUpRow,
    lease: Lease,
    next: Next,
    driver: Driver,
}

impl TopUps {
    /// Drives a top-up whose lease `lease` holds to a final state, or until it waits at the
    /// processor, or gives the lease back and answers `ProcessorUnknown`. A resuming `driver`
    /// looks at the committed PaymentIntent before anything else.
    pub async fn drive_top_up(&self, row: TopUpRow, lease: Lease, driver: Driver) -> Result<TopUpRow, TopUpError> {
        let mut drive = Drive {
            top_ups: self,
            row,
            lease,
            next: if driver.resumes() { Next::Look } else { Next::Confirm },
            driver,
        };
        for _ in 0..MAX_STEPS {
            if *drive.row.status != "processing" {
                return Ok(drive.row);
            }
            match drive.step().await {
                Ok(()) => {}
                Err(Stop::Unknown(why)) => return Err(self.give_back(&drive.row, lease.owner, why, driver).await),
                Err(Stop::Waiting) => {
                    return Err(TopUpError::Waiting {
                        top_up: TopUpId::from_uuid(drive.row.top_up_id),
                        processor_status: drive.row.processor_status.unwrap_or_else(|| "waiting".to_owned()),
                    })
                }
                Err(Stop::Lost) => {
                    return Err(TopUpError::ProcessorUnknown {
                        top_up: TopUpId::from_uuid(drive.row.top_up_id),
                        why: "another driver took the top-up's lease".to_owned(),
                    })
                }
            }
        }
        if *drive.row.status != "processing" {
            return Ok(drive.row);
        }
        Err(self
            .give_back(
                &drive.row,
                lease.owner,
                "the PaymentIntent did not settle".to_owned(),
                driver,
            )
            .await)
    }
}

impl Drive<'_> {
    async fn step(&mut self) -> Result<(), Stop> {
        let Some(intent) = self.row.processor_payment_id.clone() else {
            return self.create().await;
        };
        match std::mem::replace(&mut self.next, Next::Look) {
            Next::Confirm => self.confirm(&intent).await,
            next => {
                self.ensure_lease().await?;
                let seen = self.top_ups.processor.retrieve_intent(&intent).await;
                // A look decides nothing it cannot read: a refusal of a GET (a 404 at a
                // processor that is not this top-up's) is as unknown as a timeout.
                let seen = seen.map_err(|e| Stop::Unknown(e.to_string()))?;
                self.decide(seen, next).await
            }
        }
    }

    /// Phase 2: create the PaymentIntent and commit its id.
    async fn create(&mut self) -> Result<(), Stop> {
        self.ensure_lease().await?;
        let id = self.row.top_up_id.to_string();
        let series = self.row.create_key_series;
        let created = self
            .top_ups
            .processor
            .create_intent(
                &id,
                *self.row.amount,
                &self.row.currency,
                &self.row.payment_method,
                series,
            )
            .await;
        match created {
            Ok(intent) => self.commit(&intent.id, false).await,
            Err(CallError::Refused { status, error }) => self.fail(failure::of_refusal(status, &error), None).await,
            Err(CallError::Replayed { .. }) => self.find_or_create_anew(&id, series).await,
            Err(CallError::Unknown(why)) => Err(Stop::Unknown(why)),
        }
    }

    /// The creation's key answered a saved 5xx: the PaymentIntent it may have made is found by
    /// its metadata and adopted, or, if there is none, the next key of the series creates one.
    async fn find_or_create_anew(&mut self, id: &str, series: i32) -> Result<(), Stop> {
        let since = self.row.created_at.timestamp() - CLOCK_SLACK_SECS;
        self.ensure_lease().await?;
        let found = self
            .top_ups
            .processor
            .intents_of(id, since)
            .await
            .map_err(|e| Stop::Unknown(e.to_string()))?;
        // The newest that can still be confirmed; with more PaymentIntents created since the
        // top-up than a search reads, none: another is safe, since only the one whose id is
        // committed is ever confirmed.
        let adopt = found
            .unwrap_or_default()
            .into_iter()
            .filter(|i| i.status != "canceled")
            .max_by_key(|i| i.created);
        match adopt {
            Some(intent) => self.commit(&intent.id, true).await,
            None => self.next_key(KeyedCall::Create, series).await,
        }
    }

    /// Commits the PaymentIntent's id (only the first committed is ever confirmed). `adopted`:
    /// found by a search rather than just created, so its state is not known.
    async fn commit(&mut self, intent: &str, adopted: bool) -> Result<(), Stop> {
        let owner = self.lease.owner;
        let row = &self.row;
        let next = self
            .top_ups
            .db
            .run(async |c| top_ups::intent_created(c, row, owner, intent).await)
            .await
            .map_err(|e| Stop::Unknown(e.to_string()))?;
        if next.lease_owner != Some(owner) && *next.status == "processing" {
            return Err(Stop::Lost);
        }
        // Another driver's PaymentIntent won, or this one was adopted: look before anything.
        let ours = next.processor_payment_id.as_deref() == Some(intent);
        self.next = if ours && !adopted { Next::Confirm } else { Next::Look };
        self.row = next;
        Ok(())
    }

    /// Phase 3: confirm the committed PaymentIntent.
    async fn confirm(&mut self, intent: &str) -> Result<(), Stop> {
        self.ensure_lease().await?;
        let id = self.row.top_up_id.to_string();
        let series = self.row.confirm_key_series;
        match self.top_ups.processor.confirm_intent(&id, intent, series).await {
            Ok(confirmed) => self.decide(confirmed, Next::Look).await,
            Err(CallError::Refused { status: 402, error }) => {
                // The PaymentIntent's status after the decline, where the processor says it.
                let seen = error.payment_intent.as_ref().and_then(|i| i.status.clone());
                self.fail(failure::of_refusal(402, &error), seen.as_deref()).await
            }
            // It may have been confirmed already (a lost answer, another driver): look, then
            // decide; a PaymentIntent still unconfirmed makes the refusal the failure.
            Err(CallError::Refused { status, error }) => {
                self.next = Next::LookAfterRefusal(status, error);
                Ok(())
            }
            Err(CallError::Replayed { .. }) => {
                self.next = Next::LookAfterSavedConfirm;
                Ok(())
            }
            Err(CallError::Unknown(why)) => Err(Stop::Unknown(why)),
        }
    }

    /// What the PaymentIntent's status means (the table of this module's doc).
    async fn decide(&mut self, intent: Intent, why: Next) -> Result<(), Stop> {
        match intent.status.as_str() {
            "succeeded" => self.succeed(&intent.id).await,
            "requires_confirmation" => match why {
                Next::LookAfterRefusal(status, error) => {
                    self.fail(failure::of_refusal(status, &error), Some("requires_confirmation"))
                        .await
                }
                Next::LookAfterSavedConfirm => self.next_key(KeyedCall::Confirm, self.row.confirm_key_series).await,
                _ => {
                    self.next = Next::Confirm;
                    Ok(())
                }
            },
            "requires_payment_method" => {
                self.fail(failure::declined(&intent), Some("requires_payment_method"))
                    .await
            }
            "canceled" => {
                // What it waited for names the failure only once oncepay's action timeout has
                // passed (oncepay cancels then, and a look after a lost answer to its cancel
                // finds it so); before, someone else canceled it (found from outside: the
                // Dashboard's cancel was told as the cardholder's missing authentication).
                let waited = self
                    .row
                    .processor_status
                    .clone()
                    .filter(|_| Utc::now() >= self.action_deadline());
                self.fail(failure::canceled(&intent, waited.as_deref()), Some("canceled"))
                    .await
            }
            status @ ("requires_action" | "requires_capture") => {
                let left = (self.action_deadline() - Utc::now()).num_seconds();
                if left > 0 {
                    let secs = self.top_ups.next_check_secs(self.row.checks).min(left_secs(left));
                    return self.wait(status, secs).await;
                }
                if matches!(why, Next::LookAfterSavedCancel) {
                    self.next_key(KeyedCall::Cancel, self.row.cancel_key_series).await?;
                }
                self.cancel(&intent.id, status).await
            }
            "processing" => {
                let secs = self.top_ups.next_check_secs(self.row.checks);
                self.wait("processing", secs).await
            }
            other => Err(Stop::Unknown(format!("PaymentIntent {} is {other}", intent.id))),
        }
    }

    /// When oncepay cancels a PaymentIntent still waiting for the cardholder or a capture.
    fn action_deadline(&self) -> chrono::DateTime<Utc> {
        self.row.created_at
            + chrono::Duration::from_std(self.top_ups.clocks.action_timeout).unwrap_or(chrono::Duration::MAX)
    }

    /// The action timeout has passed: cancel the PaymentIntent, then record the failure.
    async fn cancel(&mut self, intent: &str, waited: &str) -> Result<(), Stop> {
        self.ensure_lease().await?;
        // What it waited for names the failure, even if a later look finds it canceled.
        self.row.processor_status = Some(waited.to_owned());
        let id = self.row.top_up_id.to_string();
        let series = self.row.cancel_key_series;
        tracing::info!(top_up = %id, intent, waited, "canceling a PaymentIntent past ONCEPAY_TOPUP_ACTION_TIMEOUT_SECS");
        match self.top_ups.processor.cancel_intent(&id, intent, series).await {
            Ok(canceled) if canceled.status == "canceled" => {
                self.fail(failure::canceled(&canceled, Some(waited)), Some("canceled"))
                    .await
            }
            // It left the waiting status meanwhile (it may have succeeded): look again.
            Ok(_) | Err(CallError::Refused { .. }) => {
                self.next = Next::Look;
                Ok(())
            }
            Err(CallError::Replayed { .. }) => {
                self.next = Next::LookAfterSavedCancel;
                Ok(())
            }
            Err(CallError::Unknown(why)) => Err(Stop::Unknown(why)),
        }
    }

    async fn succeed(&mut self, intent: &str) -> Result<(), Stop> {
        let owner = self.lease.owner;
        let row = &self.row;
        let next = self
            .top_ups
            .db
            .run(async |c| top_ups::succeed(c, row, owner, intent).await)
            .await
            .map_err(|e| Stop::Unknown(e.to_string()))?;
        self.settled(next)
    }

    async fn fail(&mut self, failure: Failure, processor_status: Option<&str>) -> Result<(), Stop> {
        let owner = self.lease.owner;
        let row = &self.row;
        let stored = top_ups::Failure {
            failure: failure.failure,
            decline: failure.decline,
            decline_code: failure.decline_code.as_deref(),
            processor_status,
        };
        let next = self
            .top_ups
            .db
            .run(async |c| top_ups::fail(c, row, owner, &stored).await)
            .await
            .map_err(|e| Stop::Unknown(e.to_string()))?;
        self.settled(next)
    }

    /// The row after a final phase: final, or still processing because the lease is another's.
    fn settled(&mut self, next: TopUpRow) -> Result<(), Stop> {
        let lost = *next.status == "processing";
        self.row = next;
        if lost {
            return Err(Stop::Lost);
        }
        Ok(())
    }

    async fn wait(&mut self, status: &str, secs: i32) -> Result<(), Stop> {
        let owner = self.lease.owner;
        let row = &self.row;
        let next = self
            .top_ups
            .db
            .run(async |c| top_ups::wait(c, row, owner, Some(status), secs, self.driver.counts_looks()).await)
            .await
            .map_err(|e| Stop::Unknown(e.to_string()))?;
        if next.lease_owner != Some(owner) {
            return Err(Stop::Lost);
        }
        tracing::info!(top_up = %next.top_up_id, status, next_look_secs = secs, "top-up waits for its PaymentIntent");
        self.row = next;
        Err(Stop::Waiting)
    }

    async fn next_key(&mut self, call: KeyedCall, from: i32) -> Result<(), Stop> {
        if !may_move_series(self.driver, from) {
            return Err(Stop::Unknown(format!(
                "{} saved 5xx answers for the {} call: the completer moves on to the next key at its next look",
                from + 1,
                call.series_name()
            )));
        }
        let owner = self.lease.owner;
        let lease_secs = self.top_ups.lease_secs();
        let row = &self.row;
        let sent = Instant::now();
        let next = self
            .top_ups
            .db
            .run(async |c| top_ups::next_key(c, row, owner, call.series_name(), from, lease_secs).await)
            .await
            .map_err(|e| Stop::Unknown(e.to_string()))?;
        if next.lease_owner != Some(owner) {
            return Err(Stop::Lost);
        }
        tracing::info!(top_up = %next.top_up_id, call = call.series_name(), from, "a saved 5xx: the call's next key");
        self.lease = self.top_ups.lease_from(owner, sent);
        if call == KeyedCall::Confirm {
            self.next = Next::Confirm;
        }
        self.row = next;
        Ok(())
    }

    /// Renews the lease when what is left of it would not cover one more call.
    async fn ensure_lease(&mut self) -> Result<(), Stop> {
        self.lease = self.top_ups.ensure_lease(&self.row, self.lease).await?;
        Ok(())
    }
}

impl TopUps {
    /// The lease, renewed first if what is left of it would not cover one more call and a
    /// phase after it; `Stop::Lost` if another driver has taken it.
    pub(super) async fn ensure_lease(&self, row: &TopUpRow, lease: Lease) -> Result<Lease, Stop> {
        let needed = self.clocks.timeout + std::time::Duration::from_secs(1);
        if lease.until.saturating_duration_since(Instant::now()) > needed {
            return Ok(lease);
        }
        let lease_secs = self.lease_secs();
        let sent = Instant::now();
        let now = self
            .db
            .run(async |c| top_ups::renew(c, row, lease.owner, lease_secs).await)
            .await
            .map_err(|e| Stop::Unknown(e.to_string()))?;
        if now.lease_owner != Some(lease.owner) {
            return Err(Stop::Lost);
        }
        Ok(self.lease_from(lease.owner, sent))
    }
}

fn left_secs(left: i64) -> i32 {
    i32::try_from(left.max(1)).unwrap_or(i32::MAX)
}
