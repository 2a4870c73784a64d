//! The phases of a card top-up and of its refund (migrations/V8, V23): each a call of its own
//! SQL function, one transaction, no processor call inside. `crate::top_ups` drives them and
//! makes the processor calls between them. Every phase after the first takes the lease's
//! owner and changes nothing for another: a driver whose lease was taken writes nothing.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::rows::TopUpRow;
use super::ClaimArgs;
use crate::domain::{AccountId, Amount, TenantId, TopUpId};
use crate::operation::{ClaimOutcome, Decline};

/// What the first phase of a top-up (or of its refund) found.
#[derive(Clone, Debug)]
pub struct Begun {
    pub outcome: ClaimOutcome,
    pub decline: Option<Decline>,
    pub expires_at: Option<DateTime<Utc>>,
    pub row: Option<TopUpRow>,
    /// The caller now holds the top-up's lease: it drives the unfinished top-up (or refund).
    pub owned: bool,
}

/// A new top-up (or the one its key names).
pub struct NewTopUp<'a> {
    pub account: &'a AccountId,
    pub amount: Amount,
    pub currency: &'a str,
    pub payment_method: &'a str,
    /// The processor it is made with (its `ONCEPAY_PROCESSOR_NAME`).
    pub processor: &'a str,
}

pub async fn begin(
    conn: &mut PgConnection,
    tenant: TenantId,
    claim: &ClaimArgs,
    top_up: &NewTopUp<'_>,
    owner: Uuid,
    lease_secs: i32,
) -> Result<Begun, sqlx::Error> {
    let r = sqlx::query!(
        r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                  resource AS "resource: TopUpRow", owned AS "owned!"
           FROM oncepay_top_up_begin($1, $2, $3, $4, $5, $6, $7, $8, $9)"#,
        tenant.get(),
        claim as _,
        top_up.account.as_str(),
        top_up.amount.get(),
        top_up.currency,
        top_up.payment_method,
        owner,
        lease_secs,
        top_up.processor,
    )
    .fetch_one(conn)
    .await?;
    Ok(Begun {
        outcome: r.outcome,
        decline: r.decline,
        expires_at: r.expires_at,
        row: r.resource,
        owned: r.owned,
    })
}

pub async fn refund_begin(
    conn: &mut PgConnection,
    tenant: TenantId,
    claim: &ClaimArgs,
    top_up: TopUpId,
    owner: Uuid,
    lease_secs: i32,
) -> Result<Begun, sqlx::Error> {
    let r = sqlx::query!(
        r#"SELECT outcome AS "outcome!: ClaimOutcome", decline AS "decline: Decline", expires_at,
                  resource AS "resource: TopUpRow", owned AS "owned!"
           FROM oncepay_top_up_refund_begin($1, $2, $3, $4, $5)"#,
        tenant.get(),
        claim as _,
        top_up.get(),
        owner,
        lease_secs,
    )
    .fetch_one(conn)
    .await?;
    Ok(Begun {
        outcome: r.outcome,
        decline: r.decline,
        expires_at: r.expires_at,
        row: r.resource,
        owned: r.owned,
    })
}

/// What a top-up's (or its refund's) key has stored, read without claiming anything: for a
/// replica without a card processor, whose retries are replays or nothing (a request that
/// would be new is `None`: a keyless one, a key never used, a derived key past its window).
/// As [`begin`] would find it, the lease aside: `Expired` past the replay window, `KeyReused`
/// under another fingerprint, else `Replayed` with the key's decline and its top-up's row.
/// A replay's result is answered as committed, as `oncepay_claim` answers it: with synchronous
/// standbys, the read writes a record, so that it returns once they hold the key row.
pub async fn stored(
    conn: &mut PgConnection,
    tenant: TenantId,
    claim: &ClaimArgs,
) -> Result<Option<Begun>, sqlx::Error> {
    let Some(key) = claim.key.as_deref() else {
        return Ok(None);
    };
    let r = sqlx::query!(
        r#"SELECT CASE WHEN k.expires_at <= now() THEN 'expired'
                       WHEN k.fingerprint <> $3 THEN 'key_reused'
                       ELSE 'replayed' END::oncepay_outcome AS "outcome!: ClaimOutcome",
                  k.error_code AS "decline: Decline", k.expires_at,
                  (SELECT t FROM top_ups t
                    WHERE t.tenant_id = k.tenant_id
                      AND t.top_up_id = CASE WHEN k.operation IN ('top_up', 'refund_top_up')
                                             THEN k.resource_id::uuid END) AS "resource: TopUpRow"
             FROM idempotency_keys k
            WHERE k.tenant_id = $1 AND k.key = $2
              AND (current_setting('synchronous_standby_names') = ''
                   OR pg_logical_emit_message(true, 'oncepay', 'replay') IS NOT NULL)"#,
        tenant.get(),
        key,
        claim.fingerprint.as_deref(),
    )
    .fetch_optional(conn)
    .await?;
    Ok(r.and_then(|r| {
        let begun = Begun {
            outcome: r.outcome,
            decline: r.decline,
            expires_at: Some(r.expires_at),
            row: r.resource,
            owned: false,
        };
        // A derived key past its window starts afresh (`oncepay_claim`): a new request.
        (!(claim.derived && begun.outcome == ClaimOutcome::Expired)).then_some(begun)
    }))
}

/// Commits the PaymentIntent's id (if the owner still holds the lease and none was
/// committed); the row as it is now.
pub async fn intent_created(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    intent: &str,
) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_intent_created($1, $2, $3, $4) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        intent,
    )
    .fetch_one(conn)
    .await
}

/// The PaymentIntent succeeded: credit the account (once), if `owner` still holds the lease.
pub async fn succeed(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    intent: &str,
) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_succeed($1, $2, $3, $4) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        intent,
    )
    .fetch_one(conn)
    .await
}

/// Why a top-up failed, as its row and its key row store it.
#[derive(Clone, Debug)]
pub struct Failure<'a> {
    /// The top-up's `failure_code`: the decline's code, or `authentication_required`,
    /// `capture_required`, `canceled`.
    pub failure: &'a str,
    /// What the key row stores and answers (a problem code of docs/api.md).
    pub decline: Decline,
    /// The processor's own reason.
    pub decline_code: Option<&'a str>,
    /// The PaymentIntent's status as last seen, when a look told.
    pub processor_status: Option<&'a str>,
}

/// The top-up failed (nothing was charged): its row and its key row store the failure, if
/// `owner` still holds the lease.
pub async fn fail(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    failure: &Failure<'_>,
) -> Result<TopUpRow, sqlx::Error> {
    let status = i16::try_from(failure.decline.status()).unwrap_or(i16::MAX);
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_fail($1, $2, $3, $4, $5, $6, $7, $8) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        failure.failure,
        failure.decline.code().as_str(),
        status,
        failure.decline_code,
        failure.processor_status,
    )
    .fetch_one(conn)
    .await
}

/// The processor refunded: the refund is recorded (once), if `owner` still holds the lease.
pub async fn refunded(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    refund: &str,
) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_refunded($1, $2, $3, $4) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        refund,
    )
    .fetch_one(conn)
    .await
}

/// The refund failed, was canceled or refused at the processor: the amount is credited back,
/// the refund's key stores `refund_failed` and the event `top_up.refund_failed` is written, in
/// one transaction, if `owner` still holds the lease.
pub async fn refund_failed(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    refund: Option<&str>,
    refund_status: &str,
    failure_code: &str,
) -> Result<TopUpRow, sqlx::Error> {
    let status = i16::try_from(Decline::RefundFailed.status()).unwrap_or(i16::MAX);
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_refund_failed($1, $2, $3, $4, $5, $6, $7) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        refund,
        refund_status,
        failure_code,
        status,
    )
    .fetch_one(conn)
    .await
}

/// The owner renews its lease (`lease_secs` from now); the row as it is now, whose
/// `lease_owner` tells whether the lease is still the owner's.
pub async fn renew(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    lease_secs: i32,
) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_renew($1, $2, $3, $4) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        lease_secs,
    )
    .fetch_one(conn)
    .await
}

/// The key `from` of `call` (`create`, `confirm`, `cancel`, `refund`) was answered with a
/// saved 5xx, and the processor's state shows the call did not happen: the series moves on
/// (once, whoever asks), and the lease is renewed.
pub async fn next_key(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    call: &str,
    from: i32,
    lease_secs: i32,
) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_next_key($1, $2, $3, $4, $5, $6) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        call,
        from,
        lease_secs,
    )
    .fetch_one(conn)
    .await
}

/// The PaymentIntent waits (`requires_action`, `requires_capture`, `processing`): its status
/// and the next look in `next_check_secs` are recorded, and the lease given back. A look
/// not `counted` (a client's retry) leaves the count of looks as it is and never moves the
/// next look later (migrations/V38).
pub async fn wait(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    processor_status: Option<&str>,
    next_check_secs: i32,
    counted: bool,
) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_wait($1, $2, $3, $4, $5, $6) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        processor_status,
        next_check_secs,
        counted,
    )
    .fetch_one(conn)
    .await
}

/// The refund waits at the processor (`pending`): the refund, its status and the next look
/// are recorded, and the lease given back; `counted` as for [`wait`].
pub async fn refund_wait(
    conn: &mut PgConnection,
    row: &TopUpRow,
    owner: Uuid,
    refund: Option<&str>,
    refund_status: Option<&str>,
    next_check_secs: i32,
    counted: bool,
) -> Result<TopUpRow, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_refund_wait($1, $2, $3, $4, $5, $6, $7) r"#,
        row.tenant_id,
        row.top_up_id,
        owner,
        refund,
        refund_status,
        next_check_secs,
        counted,
    )
    .fetch_one(conn)
    .await
}

/// The owner gives the lease back (a call's outcome is unknown): a retry resumes at once.
pub async fn release(conn: &mut PgConnection, row: &TopUpRow, owner: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "SELECT oncepay_top_up_release($1, $2, $3)",
        row.tenant_id,
        row.top_up_id,
        owner
    )
    .fetch_one(conn)
    .await
    .map(|_| ())
}

/// Up to `limit` unfinished top-ups (or refunds) made with one of `processors` that are due
/// (their next look has come, or they were left untouched for `after_secs`) and whose lease is
/// free, leased to `owner` (the completer).
pub async fn claim_due(
    conn: &mut PgConnection,
    owner: Uuid,
    after_secs: i32,
    lease_secs: i32,
    limit: i32,
    processors: &[String],
) -> Result<Vec<TopUpRow>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM oncepay_top_up_claim_due($1, $2, $3, $4, $5) r"#,
        owner,
        after_secs,
        lease_secs,
        limit,
        processors,
    )
    .fetch_all(conn)
    .await
}

/// Top-ups and refunds waiting for the processor, on every tenant, and how long the oldest
/// of them has waited (a top-up since its creation, a refund since its debit), in seconds.
pub async fn unfinished(conn: &mut PgConnection) -> Result<(i64, i64), sqlx::Error> {
    let r = sqlx::query!(
        r#"SELECT count(*) AS "n!",
                  coalesce(extract(epoch FROM max(now() - CASE WHEN status = 'processing' THEN created_at
                                                               ELSE coalesce(refund_requested_at, updated_at) END)), 0)::bigint
                      AS "oldest_secs!"
             FROM top_ups WHERE status = 'processing' OR refund_state = 'debited'"#
    )
    .fetch_one(conn)
    .await?;
    Ok((r.n, r.oldest_secs))
}

/// A top-up's row, for `GET /top-ups/{id}`.
pub async fn top_up(
    conn: &mut PgConnection,
    tenant: TenantId,
    top_up: TopUpId,
) -> Result<Option<TopUpRow>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT r AS "r!: TopUpRow" FROM top_ups r WHERE tenant_id = $1 AND top_up_id = $2"#,
        tenant.get(),
        top_up.get(),
    )
    .fetch_optional(conn)
    .await
}
