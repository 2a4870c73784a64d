//! What `oncepay audit` found, as data (serialised by `--json`) and as a readable report.

use std::fmt::{self, Write as _};

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::domain::time;

/// The whole report. `clean` is false when any invariant is broken; suspected duplicates
/// are warnings and never make a report unclean.
#[derive(Debug, Serialize)]
pub struct Report {
    pub clean: bool,
    /// The database's clock at the snapshot every check read.
    #[serde(serialize_with = "time::rfc3339")]
    pub snapshot_at: DateTime<Utc>,
    pub elapsed_ms: u64,
    pub scope: Scope,
    pub checked: Checked,
    pub invariants: Invariants,
    pub warnings: Warnings,
}

/// What the audit was asked to look at, and the windows it used.
#[derive(Debug, Serialize)]
pub struct Scope {
    /// `None`: every tenant.
    pub tenant_id: Option<Uuid>,
    pub retention_secs: u64,
    pub fingerprint_window_secs: u64,
    pub duplicate_window_secs: u64,
}

#[derive(Debug, Default, Serialize)]
pub struct Checked {
    pub tenants: i64,
    pub accounts: i64,
    pub payments: i64,
    pub deposits: i64,
    pub transfers: i64,
    pub key_rows: i64,
    pub top_ups: i64,
    /// PaymentIntents read from the processor (`None`: no processor configured).
    pub processor_intents: Option<i64>,
}

#[derive(Debug, Serialize)]
pub struct Invariants {
    /// Accounts whose balance is not opening + deposits - payments + refunds + transfers in - transfers out.
    pub balances: Findings<BalanceMismatch>,
    /// Stored successes (200/201 key rows) that name no existing resource.
    pub dangling_keys: Findings<DanglingKey>,
    /// Keyed payments, deposits and transfers younger than the retention without the key row naming them.
    pub missing_keys: Findings<MissingKey>,
    /// Two effects under one key closer together than that key could legitimately allow.
    pub double_charges: Findings<DoubleCharge>,
    /// Top-ups against the processor's PaymentIntents, and top-ups left unfinished past the
    /// completer's window (docs/audit.md says what to do with each).
    pub top_ups: Findings<TopUpFinding>,
}

#[derive(Debug, Serialize)]
pub struct Warnings {
    /// Keyless payments of the same tenant, account and amount within the duplicate window.
    pub suspected_keyless_duplicates: Findings<SuspectedDuplicate>,
    /// The same among top-ups without a client's key that were not failed: two card charges
    /// (found from outside: a keyless top-up sent again after a 503 charged twice).
    pub suspected_keyless_top_up_duplicates: Findings<SuspectedTopUpDuplicate>,
    /// PaymentIntents of oncepay's never confirmed and not their top-up's (a create whose
    /// answer was lost): they charge nothing.
    pub unconfirmed_intents: Findings<TopUpFinding>,
    /// Top-ups (and refunds) unfinished past the completer's window, oldest first.
    pub unfinished_top_ups: Findings<UnfinishedTopUp>,
}

/// How many rows broke a check (all of them) and the first few, for a human to look at.
#[derive(Debug, Serialize)]
pub struct Findings<T> {
    pub count: i64,
    pub samples: Vec<T>,
}

impl<T> Findings<T> {
    /// `total` is the count every sample row carries (`count(*) OVER ()`).
    pub fn from_rows(rows: Vec<T>, total: impl Fn(&T) -> i64) -> Self {
        let count = rows.first().map_or(0, &total);
        Self { count, samples: rows }
    }
}

#[derive(Debug, Serialize)]
pub struct BalanceMismatch {
    pub tenant_id: Uuid,
    pub account_id: String,
    pub opening_balance: i64,
    pub deposited: i64,
    pub paid: i64,
    pub refunded: i64,
    /// Succeeded top-ups minus the refunds of top-ups debited.
    pub topped_up_net: i64,
    /// Transfers into the account minus transfers out of it.
    pub transferred_net: i64,
    pub expected: i64,
    pub balance: i64,
    #[serde(skip)]
    pub total: i64,
}

#[derive(Debug, Serialize)]
pub struct DanglingKey {
    pub tenant_id: Uuid,
    pub key: String,
    pub path: String,
    pub status: i16,
    pub resource_id: Option<String>,
    pub problem: String,
    #[serde(skip)]
    pub total: i64,
}

#[derive(Debug, Serialize)]
pub struct MissingKey {
    pub kind: String,
    pub tenant_id: Uuid,
    pub id: Uuid,
    pub key: String,
    #[serde(serialize_with = "time::rfc3339")]
    pub created_at: DateTime<Utc>,
    /// What the key row names instead, when there is one.
    pub key_row_resource: Option<String>,
    #[serde(skip)]
    pub total: i64,
}

#[derive(Debug, Serialize)]
pub struct DoubleCharge {
    pub kind: String,
    pub tenant_id: Uuid,
    pub key: String,
    pub id: Uuid,
    pub earlier_id: Uuid,
    pub seconds_apart: f64,
    #[serde(skip)]
    pub total: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopUpFinding {
    pub tenant_id: Option<Uuid>,
    pub top_up_id: Option<Uuid>,
    pub processor_payment_id: Option<String>,
    pub problem: String,
}

/// A top-up, or its refund, that waits for the processor.
#[derive(Debug, Clone, Serialize)]
pub struct UnfinishedTopUp {
    pub tenant_id: Uuid,
    pub top_up_id: Uuid,
    /// `processing` (the top-up) or `refund_pending` (its refund, the balance debited).
    pub state: String,
    /// Since the top-up's creation, or the refund's debit.
    pub age_secs: i64,
    pub processor_payment_id: Option<String>,
    /// The PaymentIntent's status at the processor as the audit read it (`None`: no
    /// processor configured, no PaymentIntent yet, or not among those read).
    pub at_processor: Option<String>,
    /// What oncepay last saw (the PaymentIntent's status, or the refund's).
    pub last_seen_status: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct SuspectedDuplicate {
    pub tenant_id: Uuid,
    pub account_id: String,
    pub amount: i64,
    pub payment_id: Uuid,
    pub earlier_payment_id: Uuid,
    pub seconds_apart: f64,
    #[serde(skip)]
    pub total: i64,
}

/// Two top-ups without a client's key, of one tenant, account and amount, close together.
#[derive(Debug, Serialize)]
pub struct SuspectedTopUpDuplicate {
    pub tenant_id: Uuid,
    pub account_id: String,
    pub amount: i64,
    pub top_up_id: Uuid,
    pub earlier_top_up_id: Uuid,
    pub seconds_apart: f64,
    #[serde(skip)]
    pub total: i64,
}

impl Invariants {
    pub fn broken(&self) -> i64 {
        self.balances.count
            + self.dangling_keys.count
            + self.missing_keys.count
            + self.double_charges.count
            + self.top_ups.count
    }
}

fn status_line<T>(out: &mut String, findings: &Findings<T>, what: &str, severity: &str) -> fmt::Result {
    let label = if findings.count == 0 { "ok" } else { severity };
    writeln!(out, "  {label:<8}{what}: {}", findings.count)
}

fn samples<T>(out: &mut String, findings: &Findings<T>, line: impl Fn(&T) -> String) -> fmt::Result {
    for sample in &findings.samples {
        writeln!(out, "            {}", line(sample))?;
    }
    if findings.count > findings.samples.len() as i64 {
        writeln!(
            out,
            "            ... and {} more",
            findings.count - findings.samples.len() as i64
        )?;
    }
    Ok(())
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::new();
        let c = &self.checked;
        let s = &self.scope;
        let tenant = s
            .tenant_id
            .map_or_else(|| "every tenant".to_owned(), |t| format!("tenant {t}"));
        writeln!(
            out,
            "oncepay audit of {tenant} at {} ({} ms): {} tenants, {} accounts, {} payments, {} deposits, {} transfers, {} top-ups, {} key rows",
            self.snapshot_at.format("%Y-%m-%d %H:%M:%S%.3f UTC"),
            self.elapsed_ms,
            c.tenants,
            c.accounts,
            c.payments,
            c.deposits,
            c.transfers,
            c.top_ups,
            c.key_rows
        )?;
        let inv = &self.invariants;
        status_line(
            &mut out,
            &inv.balances,
            "accounts where opening + deposits - payments + refunds + transfers + top-ups != balance",
            "BROKEN",
        )?;
        samples(&mut out, &inv.balances, |b| {
            format!(
                "tenant {} account {}: {} + {} - {} + {} + {} + {} = {}, balance {}",
                b.tenant_id,
                b.account_id,
                b.opening_balance,
                b.deposited,
                b.paid,
                b.refunded,
                b.transferred_net,
                b.topped_up_net,
                b.expected,
                b.balance
            )
        })?;
        status_line(
            &mut out,
            &inv.dangling_keys,
            "stored 200/201 key rows naming no existing resource",
            "BROKEN",
        )?;
        samples(&mut out, &inv.dangling_keys, |k| {
            format!(
                "tenant {} key {:?} {} {} -> {}: {}",
                k.tenant_id,
                k.key,
                k.status,
                k.path,
                k.resource_id.as_deref().unwrap_or("(none)"),
                k.problem
            )
        })?;
        status_line(
            &mut out,
            &inv.missing_keys,
            &format!(
                "keyed payments/deposits/transfers of the last {} s (the key retention) without their key row",
                s.retention_secs
            ),
            "BROKEN",
        )?;
        samples(&mut out, &inv.missing_keys, |m| {
            format!(
                "tenant {} {} {} key {:?} at {}: key row names {}",
                m.tenant_id,
                m.kind,
                m.id,
                m.key,
                m.created_at,
                m.key_row_resource.as_deref().unwrap_or("(no key row)")
            )
        })?;
        status_line(
            &mut out,
            &inv.double_charges,
            &format!(
                "effects charged twice under one key (within the retention, {} s; derived fp: keys within {} s)",
                s.retention_secs, s.fingerprint_window_secs
            ),
            "BROKEN",
        )?;
        samples(&mut out, &inv.double_charges, |d| {
            format!(
                "tenant {} key {:?}: {} {} and {} ({:.3} s apart)",
                d.tenant_id, d.key, d.kind, d.earlier_id, d.id, d.seconds_apart
            )
        })?;
        let top_up_line = |t: &TopUpFinding| {
            format!(
                "top-up {} PaymentIntent {} (tenant {}): {}",
                t.top_up_id.map_or_else(|| "(none)".to_owned(), |id| id.to_string()),
                t.processor_payment_id.as_deref().unwrap_or("(none)"),
                t.tenant_id.map_or_else(|| "unknown".to_owned(), |id| id.to_string()),
                t.problem
            )
        };
        let against = match c.processor_intents {
            Some(n) => format!("against the processor's {n} PaymentIntents"),
            None => "(no processor configured: its PaymentIntents not read)".to_owned(),
        };
        status_line(&mut out, &inv.top_ups, &format!("top-ups {against}"), "BROKEN")?;
        samples(&mut out, &inv.top_ups, top_up_line)?;
        status_line(
            &mut out,
            &self.warnings.unconfirmed_intents,
            "PaymentIntents of oncepay's never confirmed and not their top-up's (nothing charged)",
            "warning",
        )?;
        samples(&mut out, &self.warnings.unconfirmed_intents, top_up_line)?;
        status_line(
            &mut out,
            &self.warnings.unfinished_top_ups,
            "top-ups and refunds unfinished past the completer's window (waiting at the processor, or stuck)",
            "warning",
        )?;
        samples(&mut out, &self.warnings.unfinished_top_ups, |u| {
            // A pending refund's unfinished part is the refund: its PaymentIntent has
            // succeeded, and "last seen" is the refund's status, named as such.
            let last_seen = if u.state == "refund_pending" {
                "its refund last seen"
            } else {
                "last seen"
            };
            format!(
                "top-up {} (tenant {}) {} for {} s: PaymentIntent {} is {} at the processor ({last_seen} {})",
                u.top_up_id,
                u.tenant_id,
                u.state,
                u.age_secs,
                u.processor_payment_id.as_deref().unwrap_or("(none yet)"),
                u.at_processor.as_deref().unwrap_or("unknown"),
                u.last_seen_status.as_deref().unwrap_or("nothing")
            )
        })?;
        let dups = &self.warnings.suspected_keyless_duplicates;
        status_line(
            &mut out,
            dups,
            &format!(
                "suspected duplicates among payments without a client's key (same tenant, account, amount within {} s)",
                s.duplicate_window_secs
            ),
            "warning",
        )?;
        samples(&mut out, dups, |d| {
            format!(
                "tenant {} account {} amount {}: {} then {} ({:.3} s apart)",
                d.tenant_id, d.account_id, d.amount, d.earlier_payment_id, d.payment_id, d.seconds_apart
            )
        })?;
        let top_up_dups = &self.warnings.suspected_keyless_top_up_duplicates;
        status_line(
            &mut out,
            top_up_dups,
            &format!(
                "suspected duplicates among top-ups without a client's key, not failed (same tenant, account, amount within {} s, or while the earlier was unfinished)",
                s.duplicate_window_secs
            ),
            "warning",
        )?;
        samples(&mut out, top_up_dups, |d| {
            format!(
                "tenant {} account {} amount {}: top-up {} then {} ({:.3} s apart)",
                d.tenant_id, d.account_id, d.amount, d.earlier_top_up_id, d.top_up_id, d.seconds_apart
            )
        })?;
        if self.clean {
            write!(out, "result: clean")?;
            if dups.count + top_up_dups.count > 0 {
                write!(
                    out,
                    " (keyless duplicates are suspicions: without a key nothing proves a retry)"
                )?;
            }
        } else {
            write!(out, "result: BROKEN, {} finding(s) break an invariant", inv.broken())?;
        }
        f.write_str(&out)
    }
}
