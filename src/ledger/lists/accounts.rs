//! `GET /accounts`: by `(tenant, created_at, account_id)`.

use sqlx::PgConnection;

use crate::domain::page::{Page, PageRequest};
use crate::domain::{AccountId, TenantId};
use crate::ledger::rows::{AccountRow, SqlAccountId, SqlBalance, SqlOpeningBalance};

/// An account's row from a list query's columns (the domains' columns arrive as their base
/// types).
macro_rules! account_row {
    ($r:expr) => {{
        let r = $r;
        AccountRow {
            tenant_id: r.tenant_id,
            account_id: SqlAccountId(r.account_id),
            balance: SqlBalance(r.balance),
            opening_balance: SqlOpeningBalance(r.opening_balance),
            created_at: r.created_at,
        }
    }};
}

/// `GET /accounts`: the tenant's accounts. `None`: the cursor is no account of the tenant's.
pub async fn accounts(
    conn: &mut PgConnection,
    tenant: TenantId,
    page: &PageRequest<AccountId>,
) -> Result<Option<Page<AccountRow>>, sqlx::Error> {
    let cursor = page.cursor_id().map(AccountId::as_str);
    let (from, until) = (page.created.from, page.created.until);
    let rows: Vec<AccountRow> = if page.newer() {
        sqlx::query!(
            r#"SELECT r.tenant_id, r.account_id, r.balance, r.opening_balance, r.created_at
                FROM accounts r
                WHERE r.tenant_id = $1
                  AND (r.created_at, r.account_id) >
                      (CASE WHEN $3::timestamptz > (SELECT c.created_at FROM accounts c WHERE c.tenant_id = $1 AND c.account_id = $2) THEN $3::timestamptz ELSE (SELECT c.created_at FROM accounts c WHERE c.tenant_id = $1 AND c.account_id = $2) END,
                       CASE WHEN $3::timestamptz > (SELECT c.created_at FROM accounts c WHERE c.tenant_id = $1 AND c.account_id = $2) THEN '' ELSE $2::text END)
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
        .into_iter()
        .map(|r| account_row!(r))
        .collect()
    } else {
        // Without a cursor, ('infinity', '') is after every account.
        sqlx::query!(
            r#"SELECT r.tenant_id, r.account_id, r.balance, r.opening_balance, r.created_at
                FROM accounts r
                WHERE r.tenant_id = $1
                  AND (r.created_at, r.account_id) <
                      (CASE WHEN $2::text IS NULL THEN coalesce($4::timestamptz, 'infinity')
                            WHEN $4::timestamptz <= (SELECT c.created_at FROM accounts c WHERE c.tenant_id = $1 AND c.account_id = $2) THEN $4::timestamptz
                            ELSE (SELECT c.created_at FROM accounts c WHERE c.tenant_id = $1 AND c.account_id = $2) END,
                       CASE WHEN $2::text IS NULL OR $4::timestamptz <= (SELECT c.created_at FROM accounts c WHERE c.tenant_id = $1 AND c.account_id = $2) THEN ''
                            ELSE $2 END)
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
        .into_iter()
        .map(|r| account_row!(r))
        .collect()
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
