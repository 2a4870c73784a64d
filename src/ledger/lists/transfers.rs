//! `GET /transfers`: by `(tenant, created_at, transfer_id)`, or for one account by the two
//! indexes of its sides, merged.

use sqlx::PgConnection;

use crate::domain::page::{Page, PageRequest};
use crate::domain::{AccountId, TenantId, TransferId};
use crate::ledger::rows::{SqlAmount, TransferState};

/// A transfer's state from a list query's columns (the domain's column arrives as its base
/// type).
macro_rules! transfer_state {
    ($r:expr) => {{
        let r = $r;
        TransferState {
            transfer_id: r.transfer_id,
            from_account_id: r.from_account_id,
            to_account_id: r.to_account_id,
            amount: SqlAmount(r.amount),
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
) -> Result<Option<Page<TransferState>>, sqlx::Error> {
    let cursor = page.cursor_id().map(|id| id.get());
    let (from, until) = (page.created.from, page.created.until);
    let rows: Vec<TransferState> = match (account, page.newer()) {
        (None, false) => {
            sqlx::query!(
                r#"SELECT r.transfer_id, r.from_account_id, r.to_account_id, r.amount, r.created_at
                    FROM transfers r
                    WHERE r.tenant_id = $1
                      AND (r.created_at, r.transfer_id) <
                          (CASE WHEN $2::uuid IS NULL THEN coalesce($4::timestamptz, 'infinity')
                                WHEN $4::timestamptz <= (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN $4::timestamptz
                                ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                           CASE WHEN $2::uuid IS NULL OR $4::timestamptz <= (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid
                                ELSE $2 END)
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
            .map(|r| transfer_state!(r))
            .collect()
        }
        (None, true) => {
            sqlx::query!(
                r#"SELECT r.transfer_id, r.from_account_id, r.to_account_id, r.amount, r.created_at
                    FROM transfers r
                    WHERE r.tenant_id = $1
                      AND (r.created_at, r.transfer_id) >
                          (CASE WHEN $3::timestamptz > (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN $3::timestamptz ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                           CASE WHEN $3::timestamptz > (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE $2 END)
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
            .map(|r| transfer_state!(r))
            .collect()
        }
        (Some(account), false) => {
            sqlx::query!(
                r#"SELECT u.transfer_id AS "transfer_id!", u.from_account_id AS "from_account_id!",
                       u.to_account_id AS "to_account_id!", u.amount AS "amount!", u.created_at AS "created_at!"
                  FROM (
                       (SELECT t.transfer_id, t.from_account_id, t.to_account_id, t.amount, t.created_at FROM transfers t
                         WHERE t.tenant_id = $1 AND t.from_account_id = $6
                           AND (t.created_at, t.transfer_id) <
                               (CASE WHEN $2::uuid IS NULL THEN coalesce($4::timestamptz, 'infinity')
                                     WHEN $4::timestamptz <= (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN $4::timestamptz
                                     ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                                CASE WHEN $2::uuid IS NULL OR $4::timestamptz <= (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid
                                     ELSE $2 END)
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at DESC, t.transfer_id DESC
                         LIMIT $5)
                       UNION ALL
                       (SELECT t.transfer_id, t.from_account_id, t.to_account_id, t.amount, t.created_at FROM transfers t
                         WHERE t.tenant_id = $1 AND t.to_account_id = $6
                           AND (t.created_at, t.transfer_id) <
                               (CASE WHEN $2::uuid IS NULL THEN coalesce($4::timestamptz, 'infinity')
                                     WHEN $4::timestamptz <= (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN $4::timestamptz
                                     ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                                CASE WHEN $2::uuid IS NULL OR $4::timestamptz <= (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid
                                     ELSE $2 END)
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
            .map(|r| transfer_state!(r))
            .collect()
        }
        (Some(account), true) => {
            sqlx::query!(
                r#"SELECT u.transfer_id AS "transfer_id!", u.from_account_id AS "from_account_id!",
                       u.to_account_id AS "to_account_id!", u.amount AS "amount!", u.created_at AS "created_at!"
                  FROM (
                       (SELECT t.transfer_id, t.from_account_id, t.to_account_id, t.amount, t.created_at FROM transfers t
                         WHERE t.tenant_id = $1 AND t.from_account_id = $6
                           AND (t.created_at, t.transfer_id) >
                               (CASE WHEN $3::timestamptz > (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN $3::timestamptz ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                                CASE WHEN $3::timestamptz > (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE $2 END)
                           AND t.created_at >= coalesce($3::timestamptz, '-infinity') AND t.created_at < coalesce($4::timestamptz, 'infinity')
                         ORDER BY t.created_at, t.transfer_id
                         LIMIT $5)
                       UNION ALL
                       (SELECT t.transfer_id, t.from_account_id, t.to_account_id, t.amount, t.created_at FROM transfers t
                         WHERE t.tenant_id = $1 AND t.to_account_id = $6
                           AND (t.created_at, t.transfer_id) >
                               (CASE WHEN $3::timestamptz > (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN $3::timestamptz ELSE (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) END,
                                CASE WHEN $3::timestamptz > (SELECT c.created_at FROM transfers c WHERE c.tenant_id = $1 AND c.transfer_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE $2 END)
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
            .map(|r| transfer_state!(r))
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
