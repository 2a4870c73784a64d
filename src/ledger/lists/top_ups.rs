//! `GET /top-ups`: by `(tenant, created_at, top_up_id)`.

use sqlx::PgConnection;

use crate::domain::page::{Page, PageRequest};
use crate::domain::{TenantId, TopUpId};
use crate::ledger::rows::TopUpRow;

/// `GET /top-ups`: the tenant's top-ups, of one status if given (`processing`, `succeeded`,
/// ...: checked at the edge) as `GET /top-ups/{id}` shows it (`refund_pending` while a
/// refund's debit waits for the processor: `TopUpRow::shown_status`). `None`: the cursor is
/// no top-up of the tenant's.
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
                  AND ($5::text IS NULL OR (CASE WHEN r.refund_state = 'debited' THEN 'refund_pending' ELSE r.status END) = $5)
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
                  AND ($5::text IS NULL OR (CASE WHEN r.refund_state = 'debited' THEN 'refund_pending' ELSE r.status END) = $5)
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
