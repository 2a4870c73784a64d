//! `GET /transfers`: by `(tenant, created_at, transfer_id)`, or for one account by the two
//! indexes of its sides, merged.

use sqlx::PgConnection;

use crate::domain::page::{Page, PageRequest};
use crate::domain::{AccountId, TenantId, TransferId};
use crate::ledger::rows::{SqlAmount, SqlBalance, TransferRow};

/// A transfer's row from a list query's columns (the domains' columns arrive as their base
/// types).
macro_rules! transfer_row {
    ($r:expr) => {{
        let r = $r;
        TransferRow {
            tenant_id: r.tenant_id,
            transfer_id: r.transfer_id,
            from_account_id: r.from_account_id,
            to_account_id: r.to_account_id,
            amount: SqlAmount(r.amount),
            from_balance_after: SqlBalance(r.from_balance_after),
            to_balance_after: SqlBalance(r.to_balance_after),
            idempotency_key: r.idempotency_key,
            created_at: r.created_at,
        }
    }};
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
    let rows: Vec<TransferRow> = match (account, page.newer()) {
        (None, false) => {
            sqlx::query!(
                r#"SELECT r.tenant_id, r.transfer_id, r.from_account_id, r.to_account_id, r.amount, r.from_balance_after,
                           r.to_balance_after, r.idempotency_key, r.created_at
                    FROM transfers r
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
            .into_iter()
            .map(|r| transfer_row!(r))
            .collect()
        }
        (None, true) => {
            sqlx::query!(
                r#"SELECT r.tenant_id, r.transfer_id, r.from_account_id, r.to_account_id, r.amount, r.from_balance_after,
                           r.to_balance_after, r.idempotency_key, r.created_at
                    FROM transfers r
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
            .into_iter()
            .map(|r| transfer_row!(r))
            .collect()
        }
        (Some(account), false) => {
            sqlx::query!(
                r#"SELECT u.tenant_id AS "tenant_id!", u.transfer_id AS "transfer_id!", u.from_account_id AS "from_account_id!",
                       u.to_account_id AS "to_account_id!", u.amount AS "amount!", u.from_balance_after AS "from_balance_after!",
                       u.to_balance_after AS "to_balance_after!", u.idempotency_key, u.created_at AS "created_at!"
                  FROM (
                       (SELECT t.* FROM transfers t
                         WHERE t.tenant_id = $1 AND t.from_account_id = $6
                           AND (t.created_at, t.transfer_id) <
                               (CASE WHEN $2::uuid IS NULL THEN 'infinity'::timestamptz
                                     ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                                coalesce($2, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at DESC, t.transfer_id DESC
                         LIMIT $5)
                       UNION ALL
                       (SELECT t.* FROM transfers t
                         WHERE t.tenant_id = $1 AND t.to_account_id = $6
                           AND (t.created_at, t.transfer_id) <
                               (CASE WHEN $2::uuid IS NULL THEN 'infinity'::timestamptz
                                     ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                                coalesce($2, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at DESC, t.transfer_id DESC
                         LIMIT $5)) AS u
                    ORDER BY u.created_at DESC, u.transfer_id DESC
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
            .into_iter()
            .map(|r| transfer_row!(r))
            .collect()
        }
        (Some(account), true) => {
            sqlx::query!(
                r#"SELECT u.tenant_id AS "tenant_id!", u.transfer_id AS "transfer_id!", u.from_account_id AS "from_account_id!",
                       u.to_account_id AS "to_account_id!", u.amount AS "amount!", u.from_balance_after AS "from_balance_after!",
                       u.to_balance_after AS "to_balance_after!", u.idempotency_key, u.created_at AS "created_at!"
                  FROM (
                       (SELECT t.* FROM transfers t
                         WHERE t.tenant_id = $1 AND t.from_account_id = $6
                           AND (t.created_at, t.transfer_id) >
                               ((SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2), $2)
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at, t.transfer_id
                         LIMIT $5)
                       UNION ALL
                       (SELECT t.* FROM transfers t
                         WHERE t.tenant_id = $1 AND t.to_account_id = $6
                           AND (t.created_at, t.transfer_id) >
                               ((SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2), $2)
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at, t.transfer_id
                         LIMIT $5)) AS u
                    ORDER BY u.created_at, u.transfer_id
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
            .into_iter()
            .map(|r| transfer_row!(r))
            .collect()
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
