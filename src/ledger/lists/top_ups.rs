//! `GET /top-ups`: by `(tenant, created_at, top_up_id)`.

use sqlx::PgConnection;

use crate::domain::page::{Page, PageRequest};
use crate::domain::{TenantId, TopUpId};
use crate::ledger::rows::{SqlAccountId, SqlAmount, SqlRecoveryPoint, SqlRefundState, SqlTopUpStatus, TopUpRow};

/// A top-up's row from a list query's columns (the domains' columns arrive as their base
/// types).
macro_rules! top_up_row {
    ($r:expr) => {{
        let r = $r;
        TopUpRow {
            tenant_id: r.tenant_id,
            top_up_id: r.top_up_id,
            account_id: SqlAccountId(r.account_id),
            amount: SqlAmount(r.amount),
            currency: r.currency,
            payment_method: r.payment_method,
            status: SqlTopUpStatus(r.status),
            recovery_point: SqlRecoveryPoint(r.recovery_point),
            processor_payment_id: r.processor_payment_id,
            failure_code: r.failure_code,
            decline_code: r.decline_code,
            balance_after: r.balance_after,
            idempotency_key: r.idempotency_key,
            refund_state: r.refund_state.map(SqlRefundState),
            refund_key: r.refund_key,
            processor_refund_id: r.processor_refund_id,
            balance_after_refund: r.balance_after_refund,
            lease_owner: r.lease_owner,
            lease_expires_at: r.lease_expires_at,
            attempts: r.attempts,
            created_at: r.created_at,
            updated_at: r.updated_at,
            finished_at: r.finished_at,
            refunded_at: r.refunded_at,
            processor: r.processor,
            processor_status: r.processor_status,
            next_check_at: r.next_check_at,
            checks: r.checks,
            create_key_series: r.create_key_series,
            confirm_key_series: r.confirm_key_series,
            cancel_key_series: r.cancel_key_series,
            refund_key_series: r.refund_key_series,
            refund_status: r.refund_status,
            refund_failure_code: r.refund_failure_code,
            refund_requested_at: r.refund_requested_at,
        }
    }};
}

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
    let rows: Vec<TopUpRow> = if page.newer() {
        sqlx::query!(
            r#"SELECT r.tenant_id, r.top_up_id, r.account_id, r.amount, r.currency, r.payment_method, r.status,
                       r.recovery_point, r.processor_payment_id, r.failure_code, r.decline_code, r.balance_after,
                       r.idempotency_key, r.refund_state, r.refund_key, r.processor_refund_id, r.balance_after_refund,
                       r.lease_owner, r.lease_expires_at, r.attempts, r.created_at, r.updated_at, r.finished_at,
                       r.refunded_at, r.processor, r.processor_status, r.next_check_at, r.checks, r.create_key_series,
                       r.confirm_key_series, r.cancel_key_series, r.refund_key_series, r.refund_status,
                       r.refund_failure_code, r.refund_requested_at
                FROM top_ups r
                WHERE r.tenant_id = $1
                  AND (r.created_at, r.top_up_id) >
                      (CASE WHEN $3::timestamptz > (SELECT c.created_at FROM top_ups c WHERE c.tenant_id = $1 AND c.top_up_id = $2) THEN $3::timestamptz ELSE (SELECT c.created_at FROM top_ups c WHERE c.tenant_id = $1 AND c.top_up_id = $2) END,
                       CASE WHEN $3::timestamptz > (SELECT c.created_at FROM top_ups c WHERE c.tenant_id = $1 AND c.top_up_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid ELSE $2 END)
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
        .into_iter()
        .map(|r| top_up_row!(r))
        .collect()
    } else {
        sqlx::query!(
            r#"SELECT r.tenant_id, r.top_up_id, r.account_id, r.amount, r.currency, r.payment_method, r.status,
                       r.recovery_point, r.processor_payment_id, r.failure_code, r.decline_code, r.balance_after,
                       r.idempotency_key, r.refund_state, r.refund_key, r.processor_refund_id, r.balance_after_refund,
                       r.lease_owner, r.lease_expires_at, r.attempts, r.created_at, r.updated_at, r.finished_at,
                       r.refunded_at, r.processor, r.processor_status, r.next_check_at, r.checks, r.create_key_series,
                       r.confirm_key_series, r.cancel_key_series, r.refund_key_series, r.refund_status,
                       r.refund_failure_code, r.refund_requested_at
                FROM top_ups r
                WHERE r.tenant_id = $1
                  AND (r.created_at, r.top_up_id) <
                      (CASE WHEN $2::uuid IS NULL THEN coalesce($4::timestamptz, 'infinity')
                            WHEN $4::timestamptz <= (SELECT c.created_at FROM top_ups c WHERE c.tenant_id = $1 AND c.top_up_id = $2) THEN $4::timestamptz
                            ELSE (SELECT c.created_at FROM top_ups c WHERE c.tenant_id = $1 AND c.top_up_id = $2) END,
                       CASE WHEN $2::uuid IS NULL OR $4::timestamptz <= (SELECT c.created_at FROM top_ups c WHERE c.tenant_id = $1 AND c.top_up_id = $2) THEN '00000000-0000-0000-0000-000000000000'::uuid
                            ELSE $2 END)
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
        .into_iter()
        .map(|r| top_up_row!(r))
        .collect()
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
