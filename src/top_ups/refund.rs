//! The drive of a refund whose debit is made (`refund_state = 'debited'`), by its status at
//! the processor:
//!
//! | the refund | oncepay |
//! | --- | --- |
//! | `succeeded` | the top-up is `refunded` (`refunded`) |
//! | `pending`, `requires_action` | the top-up stays `refund_pending`; recorded, looked at again at a growing interval (202 to the request) |
//! | `failed`, `canceled` | the amount is credited back in the transaction that records it (`refund_failed`: the top-up `succeeded` again, `refund_failure_code`, event `top_up.refund_failed`) |
//! | a refusal (4xx) of the creation | the same, with the processor's code; `charge_already_refunded` is looked up instead |
//!
//! A resumed driver lists the PaymentIntent's refunds first: one `succeeded` or `pending` is
//! this refund's (a refund that failed or was canceled was recorded, and credited back, when
//! it did; it never comes back).

use super::drive::{may_move_series, Stop};
use super::processor::{CallError, KeyedCall, RefundObject};
use super::{Answer, Driver, Lease, TopUpError, TopUps, MAX_STEPS};
use crate::domain::TopUpId;
use crate::ledger::top_ups;
use crate::ledger::TopUpRow;
use crate::operation::Decline;

/// How a refund's drive ended, for the request.
#[derive(Debug)]
pub enum RefundEnd {
    Done(TopUpRow),
    Pending(TopUpRow),
    /// Failed, canceled or refused: credited back; the key stores `refund_failed`.
    Failed,
}

impl RefundEnd {
    pub fn answer(self) -> Answer {
        match self {
            Self::Done(row) => Answer::Done { row, replayed: false },
            Self::Pending(row) => Answer::RefundPending { row },
            Self::Failed => Answer::Declined {
                decline: Decline::RefundFailed,
                row: None,
                replayed: false,
            },
        }
    }
}

/// What the next step must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    Create,
    /// List the PaymentIntent's refunds (a resumed driver; after a refusal that says it is
    /// refunded already).
    Look,
    /// List them: the creation's key answered a saved 5xx; if there is none, create one with
    /// the next key.
    LookAfterSaved,
}

struct RefundDrive<'a> {
    top_ups: &'a TopUps,
    row: TopUpRow,
    lease: Lease,
    next: Next,
    /// The refunds the last look found: none succeeded or pending.
    looked_in_vain: usize,
    driver: Driver,
}

impl TopUps {
    /// Drives a refund whose lease `lease` holds (the balance already debited) until the
    /// processor's refund ends or waits, or gives the lease back.
    pub async fn drive_refund(&self, row: TopUpRow, lease: Lease, driver: Driver) -> Result<RefundEnd, TopUpError> {
        let mut drive = RefundDrive {
            top_ups: self,
            row,
            lease,
            next: if driver.resumes() { Next::Look } else { Next::Create },
            looked_in_vain: 0,
            driver,
        };
        for _ in 0..MAX_STEPS {
            if let Some(end) = drive.ended() {
                return Ok(end);
            }
            match drive.step().await {
                Ok(()) => {}
                Err(Stop::Unknown(why)) => return Err(self.give_back(&drive.row, lease.owner, why, driver).await),
                Err(Stop::Waiting) => return Ok(RefundEnd::Pending(drive.row)),
                Err(Stop::Lost) => {
                    return Err(TopUpError::ProcessorUnknown {
                        top_up: TopUpId::from_uuid(drive.row.top_up_id),
                        why: "another driver took the refund's lease".to_owned(),
                    })
                }
            }
        }
        if let Some(end) = drive.ended() {
            return Ok(end);
        }
        Err(self
            .give_back(&drive.row, lease.owner, "the refund did not settle".to_owned(), driver)
            .await)
    }
}

impl RefundDrive<'_> {
    fn ended(&self) -> Option<RefundEnd> {
        if self.row.refund_debited() {
            return None;
        }
        Some(match self.row.refund_state.as_deref().map(String::as_str) {
            Some("refunded") => RefundEnd::Done(self.row.clone()),
            _ => RefundEnd::Failed,
        })
    }

    async fn step(&mut self) -> Result<(), Stop> {
        let Some(intent) = self.row.processor_payment_id.clone() else {
            return Err(Stop::Unknown("a succeeded top-up without its PaymentIntent".to_owned()));
        };
        self.lease = self.top_ups.ensure_lease(&self.row, self.lease).await?;
        // A refund recorded pending: look at it.
        if let Some(refund) = self.row.processor_refund_id.clone() {
            let seen = self
                .top_ups
                .processor
                .retrieve_refund(&refund)
                .await
                .map_err(|e| Stop::Unknown(e.to_string()))?;
            return self.decide(seen).await;
        }
        match self.next {
            Next::Look | Next::LookAfterSaved => {
                let refunds = self
                    .top_ups
                    .processor
                    .list_refunds(&intent)
                    .await
                    .map_err(|e| Stop::Unknown(e.to_string()))?;
                let live = refunds
                    .into_iter()
                    .find(|r| matches!(r.status.as_str(), "succeeded" | "pending" | "requires_action"));
                if let Some(refund) = live {
                    return self.decide(refund).await;
                }
                // A creation's saved 5xx made no refund: the next key creates it. This comes
                // before the check below, which is for a processor that said "already
                // refunded": found from outside, a drive that had looked once met its saved
                // 500, looked again and stopped there, on the same key every time, for as
                // long as the processor keeps it.
                if self.next == Next::LookAfterSaved {
                    self.next_key().await?;
                    self.next = Next::Create;
                    return Ok(());
                }
                self.looked_in_vain += 1;
                if self.looked_in_vain > 1 {
                    // The processor said it was refunded already, yet lists no refund.
                    return Err(Stop::Unknown("the processor lists no refund of this top-up".to_owned()));
                }
                self.next = Next::Create;
                Ok(())
            }
            Next::Create => self.create(&intent).await,
        }
    }

    async fn create(&mut self, intent: &str) -> Result<(), Stop> {
        let id = self.row.top_up_id.to_string();
        let series = self.row.refund_key_series;
        match self.top_ups.processor.create_refund(&id, intent, series).await {
            Ok(refund) => self.decide(refund).await,
            Err(CallError::Refused { error, .. }) if error.code.as_deref() == Some("charge_already_refunded") => {
                self.next = Next::Look;
                Ok(())
            }
            Err(CallError::Refused { status, error }) => {
                let code = error
                    .code
                    .or(error.decline_code)
                    .unwrap_or_else(|| format!("http_{status}"));
                self.failed(None, "refused", &code).await
            }
            Err(CallError::Replayed { .. }) => {
                self.next = Next::LookAfterSaved;
                Ok(())
            }
            Err(CallError::Unknown(why)) => Err(Stop::Unknown(why)),
        }
    }

    async fn decide(&mut self, refund: RefundObject) -> Result<(), Stop> {
        match refund.status.as_str() {
            "succeeded" => {
                let (owner, row) = (self.lease.owner, &self.row);
                let next = self
                    .top_ups
                    .db
                    .run(async |c| top_ups::refunded(c, row, owner, &refund.id).await)
                    .await
                    .map_err(|e| Stop::Unknown(e.to_string()))?;
                self.settled(next)
            }
            status @ ("pending" | "requires_action") => {
                let (owner, row) = (self.lease.owner, &self.row);
                let secs = self.top_ups.next_check_secs(row.checks);
                let next = self
                    .top_ups
                    .db
                    .run(async |c| {
                        top_ups::refund_wait(
                            c,
                            row,
                            owner,
                            Some(&refund.id),
                            Some(status),
                            secs,
                            self.driver.counts_looks(),
                        )
                        .await
                    })
                    .await
                    .map_err(|e| Stop::Unknown(e.to_string()))?;
                if next.lease_owner != Some(owner) {
                    return Err(Stop::Lost);
                }
                tracing::info!(top_up = %next.top_up_id, refund = refund.id, status, next_look_secs = secs, "refund waits at the processor");
                self.row = next;
                Err(Stop::Waiting)
            }
            status @ ("failed" | "canceled") => {
                let reason = refund.failure_reason.clone().unwrap_or_else(|| status.to_owned());
                self.failed(Some(&refund.id), status, &reason).await
            }
            other => Err(Stop::Unknown(format!("refund {} is {other}", refund.id))),
        }
    }

    /// Credits the amount back (the refund failed, was canceled or refused).
    async fn failed(&mut self, refund: Option<&str>, status: &str, code: &str) -> Result<(), Stop> {
        let (owner, row) = (self.lease.owner, &self.row);
        tracing::warn!(top_up = %row.top_up_id, refund, status, code, "refund failed at the processor: the amount is credited back");
        let next = self
            .top_ups
            .db
            .run(async |c| top_ups::refund_failed(c, row, owner, refund, status, code).await)
            .await
            .map_err(|e| Stop::Unknown(e.to_string()))?;
        self.settled(next)
    }

    fn settled(&mut self, next: TopUpRow) -> Result<(), Stop> {
        let lost = next.refund_debited();
        self.row = next;
        if lost {
            return Err(Stop::Lost);
        }
        Ok(())
    }

    async fn next_key(&mut self) -> Result<(), Stop> {
        let from = self.row.refund_key_series;
        if !may_move_series(self.driver, from) {
            return Err(Stop::Unknown(format!(
                "{} saved 5xx answers for the refund: the completer moves on to the next key at its next look",
                from + 1
            )));
        }
        let (owner, row, lease_secs) = (self.lease.owner, &self.row, self.top_ups.lease_secs());
        let sent = std::time::Instant::now();
        let next = self
            .top_ups
            .db
            .run(async |c| top_ups::next_key(c, row, owner, KeyedCall::Refund.series_name(), from, lease_secs).await)
            .await
            .map_err(|e| Stop::Unknown(e.to_string()))?;
        if next.lease_owner != Some(owner) {
            return Err(Stop::Lost);
        }
        self.lease = self.top_ups.lease_from(owner, sent);
        self.row = next;
        Ok(())
    }
}
