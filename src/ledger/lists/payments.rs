//! `GET /payments`: by `(tenant, created_at, payment_id)`, or `(tenant, account, created_at,
//! payment_id)` for one account's.

use sqlx::PgConnection;

use super::columns;

use crate::domain::page::{Page, PageRequest};
use crate::domain::{AccountId, PaymentId, TenantId};
use crate::ledger::rows::{PaymentState, SqlAmount};

/// A payment's status as lists filter it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PaymentStatus {
    Succeeded,
    Refunded,
}

impl PaymentStatus {
    pub fn parse(raw: &str) -> Option<Self> {
        match raw {
            "succeeded" => Some(Self::Succeeded),
            "refunded" => Some(Self::Refunded),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Refunded => "refunded",
        }
    }
}

/// A page of payments as one row of columns ([`super::columns`]): `$rows` is the page's
/// query, reading `r.payment_id, r.account_id, r.amount, r.created_at, r.refunded_at`, in
/// parts that are joined.
macro_rules! payment_columns {
    ([$($rows:literal),+], $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            PaymentColumns,
            r#"SELECT string_agg(uuid_send(r.payment_id), ''::bytea) AS ids,
                      string_agg(int4send(length(r.account_id)), ''::bytea) AS account_lengths,
                      string_agg(r.account_id, '') AS accounts,
                      string_agg(int8send(r.amount), ''::bytea) AS amounts,
                      string_agg(timestamptz_send(r.created_at), ''::bytea) AS created,
                      string_agg(CASE WHEN r.refunded_at IS NULL THEN '\x00'::bytea
                                      ELSE '\x01'::bytea || timestamptz_send(r.refunded_at) END, ''::bytea) AS refunded
                 FROM ("# $(+ $rows)+ + ") r",
            $($arg),+
        )
    };
}

/// The columns of a page of payments (all NULL for no row).
struct PaymentColumns {
    ids: Option<Vec<u8>>,
    account_lengths: Option<Vec<u8>>,
    accounts: Option<String>,
    amounts: Option<Vec<u8>>,
    created: Option<Vec<u8>>,
    refunded: Option<Vec<u8>>,
}

impl PaymentColumns {
    /// The page's payments, in reading order: newest first, or oldest first if `newer`.
    fn rows(self, newer: bool) -> Result<Vec<PaymentState>, sqlx::Error> {
        let ids = self.ids.unwrap_or_default();
        let n = columns::rows(&ids, 16)?;
        let accounts = self.accounts.unwrap_or_default();
        let accounts = columns::texts(&self.account_lengths.unwrap_or_default(), &accounts, n)?;
        let amounts = self.amounts.unwrap_or_default();
        let created = columns::times(&self.created.unwrap_or_default(), n)?;
        let refunded = columns::optional_times(&self.refunded.unwrap_or_default(), n)?;
        let mut rows: Vec<PaymentState> = columns::uuids(&ids, n)?
            .zip(accounts)
            .zip(columns::int8s(&amounts, n)?)
            .zip(created)
            .zip(refunded)
            .map(
                |((((payment_id, account_id), amount), created_at), refunded_at)| PaymentState {
                    payment_id,
                    account_id: account_id.to_owned(),
                    amount: SqlAmount(amount),
                    created_at,
                    refunded_at,
                },
            )
            .collect();
        let order = |p: &PaymentState| (p.created_at, p.payment_id);
        if newer {
            rows.sort_unstable_by_key(order);
        } else {
            rows.sort_unstable_by_key(|p| std::cmp::Reverse(order(p)));
        }
        Ok(rows)
    }
}

/// A page of the tenant's payments, newest first (`OLDER`: before the cursor or the window's
/// end) or oldest first (`NEWER`), `$status` the clause that filters by status (`$5`).
macro_rules! tenant_page {
    (OLDER $status:literal, $($arg:tt)+) => {
        tenant_page!(@run [r#"SELECT r.payment_id, r.account_id, r.amount, r.created_at, r.refunded_at
                    FROM payments r
                    WHERE r.tenant_id = $1
                      AND (r.created_at, r.payment_id) <
                          (CASE WHEN $2::uuid IS NULL THEN coalesce($4::timestamptz, 'infinity')
                                WHEN $4::timestamptz <= (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) THEN $4::timestamptz
                                ELSE (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) END,
                           CASE WHEN $2::uuid IS NULL OR $4::timestamptz <= (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid
                                ELSE $2 END)
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                      "#, $status, r#"
                    ORDER BY r.created_at DESC, r.payment_id DESC
                    LIMIT $6"#], $($arg)+)
    };
    (NEWER $status:literal, $($arg:tt)+) => {
        tenant_page!(@run [r#"SELECT r.payment_id, r.account_id, r.amount, r.created_at, r.refunded_at
                    FROM payments r
                    WHERE r.tenant_id = $1
                      AND (r.created_at, r.payment_id) >
                          (CASE WHEN $3::timestamptz > (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) THEN $3::timestamptz ELSE (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) END,
                           CASE WHEN $3::timestamptz > (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE $2 END)
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                      "#, $status, r#"
                    ORDER BY r.created_at, r.payment_id
                    LIMIT $6"#], $($arg)+)
    };
    (@run [$($rows:literal),+], $conn:ident, $tenant:ident, $cursor:ident, $from:ident, $until:ident, $status:ident, $page:ident) => {
        payment_columns!([$($rows),+], $tenant.get(), $cursor, $from, $until, $status, $page.fetch())
            .fetch_one(&mut *$conn)
            .await?
            .rows($page.newer())?
    };
}

/// `GET /payments`: the tenant's payments, of one account if given. `None`: the cursor is
/// no payment of the tenant's.
pub async fn payments(
    conn: &mut PgConnection,
    tenant: TenantId,
    account: Option<&AccountId>,
    status: Option<PaymentStatus>,
    page: &PageRequest<PaymentId>,
) -> Result<Option<Page<PaymentState>>, sqlx::Error> {
    let cursor = page.cursor_id().map(|id| id.get());
    let (from, until) = (page.created.from, page.created.until);
    let status = status.map(PaymentStatus::as_str);
    let rows: Vec<PaymentState> = match (account, page.newer()) {
        (None, newer) => {
            // A page of refunds reads the index of refunded payments (migrations/V41): its
            // query names the index's predicate, so that a generic plan can use it too.
            let refunded = status == Some(PaymentStatus::Refunded.as_str());
            match (newer, refunded) {
                (false, false) => tenant_page!(OLDER
                    "AND ($5::text IS NULL OR ($5 = 'refunded') = (r.refunded_at IS NOT NULL))",
                    conn, tenant, cursor, from, until, status, page),
                (false, true) => tenant_page!(OLDER
                    "AND $5::text = 'refunded' AND r.refunded_at IS NOT NULL",
                    conn, tenant, cursor, from, until, status, page),
                (true, false) => tenant_page!(NEWER
                    "AND ($5::text IS NULL OR ($5 = 'refunded') = (r.refunded_at IS NOT NULL))",
                    conn, tenant, cursor, from, until, status, page),
                (true, true) => tenant_page!(NEWER
                    "AND $5::text = 'refunded' AND r.refunded_at IS NOT NULL",
                    conn, tenant, cursor, from, until, status, page),
            }
        }
        (Some(account), false) => {
            payment_columns!(
                [r#"SELECT r.payment_id, r.account_id, r.amount, r.created_at, r.refunded_at
                    FROM payments r
                    WHERE r.tenant_id = $1 AND r.account_id = $7
                      AND (r.created_at, r.payment_id) <
                          (CASE WHEN $2::uuid IS NULL THEN coalesce($4::timestamptz, 'infinity')
                                WHEN $4::timestamptz <= (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) THEN $4::timestamptz
                                ELSE (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) END,
                           CASE WHEN $2::uuid IS NULL OR $4::timestamptz <= (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid
                                ELSE $2 END)
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                      AND ($5::text IS NULL OR ($5 = 'refunded') = (r.refunded_at IS NOT NULL))
                    ORDER BY r.created_at DESC, r.payment_id DESC
                    LIMIT $6"#],
                tenant.get(),
                cursor,
                from,
                until,
                status,
                page.fetch(),
                account.as_str(),
            )
            .fetch_one(&mut *conn)
            .await?
            .rows(page.newer())?
        }
        (Some(account), true) => {
            payment_columns!(
                [r#"SELECT r.payment_id, r.account_id, r.amount, r.created_at, r.refunded_at
                    FROM payments r
                    WHERE r.tenant_id = $1 AND r.account_id = $7
                      AND (r.created_at, r.payment_id) >
                          (CASE WHEN $3::timestamptz > (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) THEN $3::timestamptz ELSE (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) END,
                           CASE WHEN $3::timestamptz > (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE $2 END)
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                      AND ($5::text IS NULL OR ($5 = 'refunded') = (r.refunded_at IS NOT NULL))
                    ORDER BY r.created_at, r.payment_id
                    LIMIT $6"#],
                tenant.get(),
                cursor,
                from,
                until,
                status,
                page.fetch(),
                account.as_str(),
            )
            .fetch_one(&mut *conn)
            .await?
            .rows(page.newer())?
        }
    };
    if let (true, Some(id)) = (rows.is_empty(), cursor) {
        let known = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT FROM payments WHERE tenant_id = $1 AND payment_id = $2) AS "known!""#,
            tenant.get(),
            id,
        )
        .fetch_one(&mut *conn)
        .await?;
        if !known {
            return Ok(None);
        }
    }
    Ok(Some(page.page(rows)))
}
