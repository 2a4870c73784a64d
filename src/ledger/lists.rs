//! The lists of payments, transfers, top-ups and accounts (contract section 4d), each read
//! through one index in its order (migrations/V24): `(tenant, created_at, id)`, or
//! `(tenant, account, created_at, id)` for an account's payments and transfers.
//!
//! Each query reads at most one row more than its page (`PageRequest::fetch`), older than its
//! cursor from the newest down, or newer than it from the oldest up. The cursor's
//! `(created_at, id)` is looked up within the tenant in the same statement (an uncorrelated
//! subquery, run once before the scan); an unknown cursor compares as NULL and reads nothing,
//! and only then does a second statement tell an unknown cursor from the end of the list.
//! Conditions that are not columns of the index (a payment's status) are checked on the rows
//! the index gives. Every query states its tenant first.

use sqlx::PgConnection;

use super::rows::{AccountRow, PaymentRow, TopUpRow, TransferRow};
use crate::domain::page::{Page, PageRequest};
use crate::domain::{AccountId, PaymentId, TenantId, TopUpId, TransferId};

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

/// `GET /payments`: the tenant's payments, of one account if given. `None`: the cursor is
/// no payment of the tenant's.
pub async fn payments(
    conn: &mut PgConnection,
    tenant: TenantId,
    account: Option<&AccountId>,
    status: Option<PaymentStatus>,
    page: &PageRequest<PaymentId>,
) -> Result<Option<Page<PaymentRow>>, sqlx::Error> {
    let cursor = page.cursor_id().map(|id| id.get());
    let (from, until) = (page.created.from, page.created.until);
    let status = status.map(PaymentStatus::as_str);
    let rows = match (account, page.newer()) {
        (None, false) => {
            sqlx::query_scalar!(
                r#"SELECT r AS "r!: PaymentRow" FROM payments r
                    WHERE r.tenant_id = $1
                      AND (r.created_at, r.payment_id) <
                          (CASE WHEN $2::uuid IS NULL THEN 'infinity'::timestamptz
                                ELSE (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) END,
                           coalesce($2, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                      AND ($5::text IS NULL OR ($5 = 'refunded') = (r.refunded_at IS NOT NULL))
                    ORDER BY r.created_at DESC, r.payment_id DESC
                    LIMIT $6"#,
                tenant.get(),
                cursor,
                from,
                until,
                status,
                page.fetch(),
            )
            .fetch_all(&mut *conn)
            .await?
        }
        (None, true) => {
            sqlx::query_scalar!(
                r#"SELECT r AS "r!: PaymentRow" FROM payments r
                    WHERE r.tenant_id = $1
                      AND (r.created_at, r.payment_id) >
                          ((SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2), $2)
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                      AND ($5::text IS NULL OR ($5 = 'refunded') = (r.refunded_at IS NOT NULL))
                    ORDER BY r.created_at, r.payment_id
                    LIMIT $6"#,
                tenant.get(),
                cursor,
                from,
                until,
                status,
                page.fetch(),
            )
            .fetch_all(&mut *conn)
            .await?
        }
        (Some(account), false) => {
            sqlx::query_scalar!(
                r#"SELECT r AS "r!: PaymentRow" FROM payments r
                    WHERE r.tenant_id = $1 AND r.account_id = $7
                      AND (r.created_at, r.payment_id) <
                          (CASE WHEN $2::uuid IS NULL THEN 'infinity'::timestamptz
                                ELSE (SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2) END,
                           coalesce($2, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                      AND ($5::text IS NULL OR ($5 = 'refunded') = (r.refunded_at IS NOT NULL))
                    ORDER BY r.created_at DESC, r.payment_id DESC
                    LIMIT $6"#,
                tenant.get(),
                cursor,
                from,
                until,
                status,
                page.fetch(),
                account.as_str(),
            )
            .fetch_all(&mut *conn)
            .await?
        }
        (Some(account), true) => {
            sqlx::query_scalar!(
                r#"SELECT r AS "r!: PaymentRow" FROM payments r
                    WHERE r.tenant_id = $1 AND r.account_id = $7
                      AND (r.created_at, r.payment_id) >
                          ((SELECT c.created_at FROM payments c WHERE c.tenant_id = $1 AND c.payment_id = $2), $2)
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                      AND ($5::text IS NULL OR ($5 = 'refunded') = (r.refunded_at IS NOT NULL))
                    ORDER BY r.created_at, r.payment_id
                    LIMIT $6"#,
                tenant.get(),
                cursor,
                from,
                until,
                status,
                page.fetch(),
                account.as_str(),
            )
            .fetch_all(&mut *conn)
            .await?
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

/// `GET /transfers`: the tenant's transfers, of one account (on either side) if given: the
/// two indexes of its sides, each read as far as the page goes, merged. `None`: the cursor
/// is no transfer of the tenant's.
pub async fn transfers(
    conn: &mut PgConnection,
    tenant: TenantId,
    account: Option<&AccountId>,
    page: &PageRequest<TransferId>,
) -> Result<Option<Page<TransferRow>>, sqlx::Error> {
    let cursor = page.cursor_id().map(|id| id.get());
    let (from, until) = (page.created.from, page.created.until);
    let rows = match (account, page.newer()) {
        (None, false) => {
            sqlx::query_scalar!(
                r#"SELECT r AS "r!: TransferRow" FROM transfers r
                    WHERE r.tenant_id = $1
                      AND (r.created_at, r.transfer_id) <
                          (CASE WHEN $2::uuid IS NULL THEN 'infinity'::timestamptz
                                ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                           coalesce($2, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                    ORDER BY r.created_at DESC, r.transfer_id DESC
                    LIMIT $5"#,
                tenant.get(),
                cursor,
                from,
                until,
                page.fetch(),
            )
            .fetch_all(&mut *conn)
            .await?
        }
        (None, true) => {
            sqlx::query_scalar!(
                r#"SELECT r AS "r!: TransferRow" FROM transfers r
                    WHERE r.tenant_id = $1
                      AND (r.created_at, r.transfer_id) >
                          ((SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2), $2)
                      AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                    ORDER BY r.created_at, r.transfer_id
                    LIMIT $5"#,
                tenant.get(),
                cursor,
                from,
                until,
                page.fetch(),
            )
            .fetch_all(&mut *conn)
            .await?
        }
        (Some(account), false) => {
            sqlx::query_scalar!(
                r#"SELECT u.r AS "r!: TransferRow" FROM (
                       (SELECT t AS r FROM transfers t
                         WHERE t.tenant_id = $1 AND t.from_account_id = $6
                           AND (t.created_at, t.transfer_id) <
                               (CASE WHEN $2::uuid IS NULL THEN 'infinity'::timestamptz
                                     ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                                coalesce($2, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at DESC, t.transfer_id DESC
                         LIMIT $5)
                       UNION ALL
                       (SELECT t AS r FROM transfers t
                         WHERE t.tenant_id = $1 AND t.to_account_id = $6
                           AND (t.created_at, t.transfer_id) <
                               (CASE WHEN $2::uuid IS NULL THEN 'infinity'::timestamptz
                                     ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                                coalesce($2, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at DESC, t.transfer_id DESC
                         LIMIT $5)) AS u
                    ORDER BY (u.r).created_at DESC, (u.r).transfer_id DESC
                    LIMIT $5"#,
                tenant.get(),
                cursor,
                from,
                until,
                page.fetch(),
                account.as_str(),
            )
            .fetch_all(&mut *conn)
            .await?
        }
        (Some(account), true) => {
            sqlx::query_scalar!(
                r#"SELECT u.r AS "r!: TransferRow" FROM (
                       (SELECT t AS r FROM transfers t
                         WHERE t.tenant_id = $1 AND t.from_account_id = $6
                           AND (t.created_at, t.transfer_id) >
                               ((SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2), $2)
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at, t.transfer_id
                         LIMIT $5)
                       UNION ALL
                       (SELECT t AS r FROM transfers t
                         WHERE t.tenant_id = $1 AND t.to_account_id = $6
                           AND (t.created_at, t.transfer_id) >
                               ((SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2), $2)
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at, t.transfer_id
                         LIMIT $5)) AS u
                    ORDER BY (u.r).created_at, (u.r).transfer_id
                    LIMIT $5"#,
                tenant.get(),
                cursor,
                from,
                until,
                page.fetch(),
                account.as_str(),
            )
            .fetch_all(&mut *conn)
            .await?
        }
    };
    if let (true, Some(id)) = (rows.is_empty(), cursor) {
        let known = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT FROM transfers WHERE tenant_id = $1 AND transfer_id = $2) AS "known!""#,
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

/// `GET /top-ups`: the tenant's top-ups, of one status if given (`processing`, `succeeded`,
/// ...: checked at the edge). `None`: the cursor is no top-up of the tenant's.
pub async fn top_ups(
    conn: &mut PgConnection,
    tenant: TenantId,
    status: Option<&str>,
    page: &PageRequest<TopUpId>,
) -> Result<Option<Page<TopUpRow>>, sqlx::Error> {
    let cursor = page.cursor_id().map(|id| id.get());
    let (from, until) = (page.created.from, page.created.until);
    let rows = if page.newer() {
        sqlx::query_scalar!(
            r#"SELECT r AS "r!: TopUpRow" FROM top_ups r
                WHERE r.tenant_id = $1
                  AND (r.created_at, r.top_up_id) >
                      ((SELECT c.created_at FROM top_ups c WHERE c.tenant_id = $1 AND c.top_up_id = $2), $2)
                  AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                  AND ($5::text IS NULL OR r.status = $5)
                ORDER BY r.created_at, r.top_up_id
                LIMIT $6"#,
            tenant.get(),
            cursor,
            from,
            until,
            status,
            page.fetch(),
        )
        .fetch_all(&mut *conn)
        .await?
    } else {
        sqlx::query_scalar!(
            r#"SELECT r AS "r!: TopUpRow" FROM top_ups r
                WHERE r.tenant_id = $1
                  AND (r.created_at, r.top_up_id) <
                      (CASE WHEN $2::uuid IS NULL THEN 'infinity'::timestamptz
                            ELSE (SELECT c.created_at FROM top_ups c WHERE c.tenant_id = $1 AND c.top_up_id = $2) END,
                       coalesce($2, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
                  AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                  AND ($5::text IS NULL OR r.status = $5)
                ORDER BY r.created_at DESC, r.top_up_id DESC
                LIMIT $6"#,
            tenant.get(),
            cursor,
            from,
            until,
            status,
            page.fetch(),
        )
        .fetch_all(&mut *conn)
        .await?
    };
    if let (true, Some(id)) = (rows.is_empty(), cursor) {
        let known = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT FROM top_ups WHERE tenant_id = $1 AND top_up_id = $2) AS "known!""#,
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

/// `GET /accounts`: the tenant's accounts. `None`: the cursor is no account of the tenant's.
pub async fn accounts(
    conn: &mut PgConnection,
    tenant: TenantId,
    page: &PageRequest<AccountId>,
) -> Result<Option<Page<AccountRow>>, sqlx::Error> {
    let cursor = page.cursor_id().map(AccountId::as_str);
    let (from, until) = (page.created.from, page.created.until);
    let rows = if page.newer() {
        sqlx::query_scalar!(
            r#"SELECT r AS "r!: AccountRow" FROM accounts r
                WHERE r.tenant_id = $1
                  AND (r.created_at, r.account_id) >
                      ((SELECT c.created_at FROM accounts c WHERE c.tenant_id = $1 AND c.account_id = $2), $2::text)
                  AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                ORDER BY r.created_at, r.account_id
                LIMIT $5"#,
            tenant.get(),
            cursor,
            from,
            until,
            page.fetch(),
        )
        .fetch_all(&mut *conn)
        .await?
    } else {
        // Without a cursor, ('infinity', '') is after every account.
        sqlx::query_scalar!(
            r#"SELECT r AS "r!: AccountRow" FROM accounts r
                WHERE r.tenant_id = $1
                  AND (r.created_at, r.account_id) <
                      (CASE WHEN $2::text IS NULL THEN 'infinity'::timestamptz
                            ELSE (SELECT c.created_at FROM accounts c WHERE c.tenant_id = $1 AND c.account_id = $2) END,
                       coalesce($2, ''))
                  AND r.created_at >= coalesce($3::timestamptz, '-infinity') AND r.created_at < coalesce($4::timestamptz, 'infinity')
                ORDER BY r.created_at DESC, r.account_id DESC
                LIMIT $5"#,
            tenant.get(),
            cursor,
            from,
            until,
            page.fetch(),
        )
        .fetch_all(&mut *conn)
        .await?
    };
    if let (true, Some(id)) = (rows.is_empty(), cursor) {
        let known = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT FROM accounts WHERE tenant_id = $1 AND account_id = $2) AS "known!""#,
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
