//! `GET /payments`: by `(tenant, created_at, payment_id)`, or `(tenant, account, created_at,
//! payment_id)` for one account's.

use sqlx::PgConnection;

use crate::db::Timestamptz;
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

/// A payment's state from a list query's columns (the domain's column arrives as its base
/// type).
macro_rules! payment_state {
    ($r:expr) => {{
        let r = $r;
        PaymentState {
            payment_id: r.payment_id,
            account_id: r.account_id,
            amount: SqlAmount(r.amount),
            created_at: r.created_at.0,
            refunded_at: r.refunded_at.map(|t| t.0),
        }
    }};
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
        (None, false) => {
            sqlx::query!(
                r#"SELECT r.payment_id, r.account_id, r.amount,
                           r.created_at AS "created_at: Timestamptz", r.refunded_at AS "refunded_at: Timestamptz"
                    FROM payments r
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
            .into_iter()
            .map(|r| payment_state!(r))
            .collect()
        }
        (None, true) => {
            sqlx::query!(
                r#"SELECT r.payment_id, r.account_id, r.amount,
                           r.created_at AS "created_at: Timestamptz", r.refunded_at AS "refunded_at: Timestamptz"
                    FROM payments r
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
            .into_iter()
            .map(|r| payment_state!(r))
            .collect()
        }
        (Some(account), false) => {
            sqlx::query!(
                r#"SELECT r.payment_id, r.account_id, r.amount,
                           r.created_at AS "created_at: Timestamptz", r.refunded_at AS "refunded_at: Timestamptz"
                    FROM payments r
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
            .into_iter()
            .map(|r| payment_state!(r))
            .collect()
        }
        (Some(account), true) => {
            sqlx::query!(
                r#"SELECT r.payment_id, r.account_id, r.amount,
                           r.created_at AS "created_at: Timestamptz", r.refunded_at AS "refunded_at: Timestamptz"
                    FROM payments r
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
            .into_iter()
            .map(|r| payment_state!(r))
            .collect()
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
