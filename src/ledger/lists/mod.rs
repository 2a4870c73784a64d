//! The lists of payments, transfers, top-ups and accounts (docs/api.md, Lists), each read
//! through one index in its order (migrations/V24): `(tenant, created_at, id)`, or
//! `(tenant, account, created_at, id)` for an account's payments and transfers.
//!
//! Each query reads at most one row more than its page (`PageRequest::fetch`), older than its
//! cursor from the newest down, or newer than it from the oldest up. The cursor's
//! `(created_at, id)` is looked up within the tenant in the same statement (an uncorrelated
//! subquery, run once before the scan); an unknown cursor compares as NULL and reads nothing,
//! and only then does a second statement tell an unknown cursor from the end of the list.
//! A time window moves the scan's start, not only its filter: newest first, the start is the
//! cursor or the window's end (`created[lt]`), whichever is older; oldest first, the cursor or
//! the window's start, whichever is newer. (Found from outside: as a filter alone, the first
//! page of a window 29 days back read every newer index entry of 2.5 million payments, 149
//! ms against 2.9; PostgreSQL positions a scan by the row comparison only.)
//! Conditions that are not columns of the index (a payment's status) are checked on the rows
//! the index gives. Every query states its tenant first.
//!
//! Each list reads named columns and builds its rows here (a domain's column arrives as its
//! base type), not whole-row composites: a composite cost PostgreSQL half as much again to
//! send, and the server to decode (docs/bench/README.md: a first page of payments 1.28x as
//! fast side by side). A page of payments, the largest list and the one `make bench`
//! measures, goes further: it arrives as one row of columns ([`columns`]), 1.05-1.07x the
//! pages a second of a row an item (docs/bench/README.md, 2026-12-05 23:39); the other lists
//! read a row an item, which their sizes have not called into question.

mod accounts;
mod columns;
mod payments;
mod top_ups;
mod transfers;

pub use accounts::accounts;
pub use payments::{payments, PaymentStatus};
pub use top_ups::top_ups;
pub use transfers::transfers;
