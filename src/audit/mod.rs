//! `oncepay audit`: reconciliation, the way settlement finds double charges.
//!
//! Every check is one set-based statement (hash joins and aggregates, no per-row lookups),
//! and all of them read one REPEATABLE READ snapshot, so an audit of a live database is
//! consistent with itself. Invariants (any finding fails the audit):
//! - per account: opening balance + deposits - payments + refunds + transfers in - transfers
//!   out = balance;
//! - every stored success (key row with status 200/201) names an existing resource: the
//!   payment made under that key, the refunded payment, the deposit or transfer made under
//!   that key, the account (the key row names its operation);
//! - every keyed payment, deposit or transfer younger than the key retention has its key row, naming
//!   it. Older key rows are purged, so older effects are not checked. A derived key (`fp:`,
//!   policy `fingerprint`) is renewed in place after its window and names only its latest
//!   effect; an older effect under it needs a row at least as recent as itself;
//! - no two effects under one key closer than the key allows: a client key can only be
//!   processed again after its row is purged (the retention), a derived key after the window
//!   stored in its own row (`expires_at - created_at`), so replicas started with different
//!   windows raise no false alarm.
//!
//! - top-ups (docs/audit.md, "Top-ups"): given the processor (`ONCEPAY_PROCESSOR_URL`), its
//!   PaymentIntents are read first and every one carrying `metadata[oncepay_top_up_id]` that
//!   succeeded must be the one PaymentIntent of a credited top-up of its amount (a top-up
//!   still `processing` past the completer's window with its PaymentIntent succeeded is a
//!   charge never credited), and every credited top-up (finished before the PaymentIntents
//!   were read) must have its PaymentIntent succeeded.
//!
//! Warning only: payments without a client's key (keyless under policy `allow`, or with a
//! key the server derived under `fingerprint`) of the same tenant, account and amount within
//! a few seconds. Without a key nothing tells a retry from a second purchase, so
//! these are suspicions for a human, not broken invariants. And every top-up (or refund)
//! unfinished past `ONCEPAY_COMPLETER_AFTER_SECS`, with its age and its PaymentIntent's status
//! at the processor: one may wait there legitimately (an action, a pending refund), so it is
//! reported, not failed. No state of a top-up row stops the audit from running.

mod report;

use std::time::{Duration, Instant};

use sqlx::PgConnection;
use uuid::Uuid;

use crate::db::{Db, DbError};
use crate::top_ups::processor::{Intent, ProcessorClient};

pub use report::*;

/// Exit status of `oncepay audit` when an invariant is broken (1 is any command's failure
/// to run, 2 a usage error).
pub const EXIT_BROKEN: i32 = 3;

/// What to audit and with which windows (the server's, from the same environment).
#[derive(Clone, Debug)]
pub struct Options {
    pub tenant_id: Option<Uuid>,
    pub retention: Duration,
    pub fingerprint_window: Duration,
    pub duplicate_window: Duration,
    /// How many example rows each finding lists.
    pub samples: i64,
    /// `ONCEPAY_COMPLETER_AFTER_SECS`: a top-up unfinished after this is reported.
    pub completer_after: Duration,
    /// The card processor, whose PaymentIntents the top-ups are reconciled with.
    pub processor: Option<ProcessorClient>,
}

/// Why an audit could not run.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("the processor's PaymentIntents could not be read: {0}")]
    Processor(String),
}

/// Runs every check on one snapshot (the processor's PaymentIntents read just before it).
pub async fn run(db: &Db, options: &Options) -> Result<Report, AuditError> {
    let started = Instant::now();
    // The database's clock before the PaymentIntents are read: only top-ups finished before
    // it must show as succeeded there.
    let intents = match &options.processor {
        None => None,
        Some(processor) => {
            let before = db
                .run(async |c| sqlx::query_scalar!(r#"SELECT now() AS "now!""#).fetch_one(c).await)
                .await?;
            let intents = processor
                .list_intents()
                .await
                .map_err(|e| AuditError::Processor(e.to_string()))?;
            Some((before, intents))
        }
    };
    // A batch job, not a request: the server's per-statement bound (and the wait for an
    // answer that follows it) would cut it off on a big ledger.
    let (snapshot_at, mut checked, invariants, warnings) = db
        .without_deadline()
        .transaction(async |tx| {
            // The joins want memory rather than temporary files.
            sqlx::query!("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                .execute(&mut *tx)
                .await?;
            sqlx::query!("SET LOCAL statement_timeout = 0")
                .execute(&mut *tx)
                .await?;
            sqlx::query!("SET LOCAL work_mem = '256MB'").execute(&mut *tx).await?;

            let (snapshot_at, checked) = checked(tx, options.tenant_id).await?;
            let invariants = Invariants {
                balances: balances(tx, options).await?,
                dangling_keys: dangling_keys(tx, options).await?,
                missing_keys: missing_keys(tx, options).await?,
                double_charges: double_charges(tx, options).await?,
                top_ups: Findings {
                    count: 0,
                    samples: Vec::new(),
                },
            };
            let warnings = Warnings {
                suspected_keyless_duplicates: keyless_duplicates(tx, options).await?,
                suspected_keyless_top_up_duplicates: keyless_top_up_duplicates(tx, options).await?,
                unconfirmed_intents: Findings {
                    count: 0,
                    samples: Vec::new(),
                },
                unfinished_top_ups: Findings {
                    count: 0,
                    samples: Vec::new(),
                },
            };
            let mut invariants = invariants;
            let mut warnings = warnings;
            let found = top_ups(tx, options, intents.as_ref()).await?;
            invariants.top_ups = sampled(found.broken, options.samples);
            warnings.unconfirmed_intents = sampled(found.orphans, options.samples);
            warnings.unfinished_top_ups = sampled(found.unfinished, options.samples);
            Ok((snapshot_at, checked, invariants, warnings))
        })
        .await?;
    checked.processor_intents = intents.as_ref().map(|(_, all)| all.len() as i64);
    Ok(Report {
        clean: invariants.broken() == 0,
        snapshot_at,
        elapsed_ms: started.elapsed().as_millis() as u64,
        scope: Scope {
            tenant_id: options.tenant_id,
            retention_secs: options.retention.as_secs(),
            fingerprint_window_secs: options.fingerprint_window.as_secs(),
            duplicate_window_secs: options.duplicate_window.as_secs(),
        },
        checked,
        invariants,
        warnings,
    })
}

async fn checked(
    conn: &mut PgConnection,
    tenant: Option<Uuid>,
) -> Result<(chrono::DateTime<chrono::Utc>, Checked), sqlx::Error> {
    let row = sqlx::query!(
        r#"SELECT now() AS "now!",
                  (SELECT count(*) FROM tenants WHERE $1::uuid IS NULL OR tenant_id = $1) AS "tenants!",
                  (SELECT count(*) FROM accounts WHERE $1::uuid IS NULL OR tenant_id = $1) AS "accounts!",
                  (SELECT count(*) FROM payments WHERE $1::uuid IS NULL OR tenant_id = $1) AS "payments!",
                  (SELECT count(*) FROM deposits WHERE $1::uuid IS NULL OR tenant_id = $1) AS "deposits!",
                  (SELECT count(*) FROM transfers WHERE $1::uuid IS NULL OR tenant_id = $1) AS "transfers!",
                  (SELECT count(*) FROM top_ups WHERE $1::uuid IS NULL OR tenant_id = $1) AS "top_ups!",
                  (SELECT count(*) FROM idempotency_keys WHERE $1::uuid IS NULL OR tenant_id = $1) AS "key_rows!""#,
        tenant,
    )
    .fetch_one(conn)
    .await?;
    Ok((
        row.now,
        Checked {
            tenants: row.tenants,
            accounts: row.accounts,
            payments: row.payments,
            deposits: row.deposits,
            transfers: row.transfers,
            key_rows: row.key_rows,
            top_ups: row.top_ups,
            processor_intents: None,
        },
    ))
}

async fn balances(conn: &mut PgConnection, o: &Options) -> Result<Findings<BalanceMismatch>, sqlx::Error> {
    let rows = sqlx::query_as!(
        BalanceMismatch,
        r#"WITH paid AS (
               SELECT tenant_id, account_id, sum(amount) AS paid,
                      sum(amount) FILTER (WHERE refunded_at IS NOT NULL) AS refunded
                 FROM payments WHERE $1::uuid IS NULL OR tenant_id = $1
                GROUP BY tenant_id, account_id),
           deposited AS (
               SELECT tenant_id, account_id, sum(amount) AS deposited
                 FROM deposits WHERE $1::uuid IS NULL OR tenant_id = $1
                GROUP BY tenant_id, account_id),
           transferred AS (
               SELECT tenant_id, account_id, sum(net) AS net
                 FROM (SELECT tenant_id, to_account_id AS account_id, amount AS net FROM transfers
                        WHERE $1::uuid IS NULL OR tenant_id = $1
                       UNION ALL
                       SELECT tenant_id, from_account_id, -amount FROM transfers
                        WHERE $1::uuid IS NULL OR tenant_id = $1) legs
                GROUP BY tenant_id, account_id),
           topped_up AS (
               SELECT tenant_id, account_id,
                      coalesce(sum(amount) FILTER (WHERE balance_after IS NOT NULL), 0)
                      - coalesce(sum(amount) FILTER (WHERE refund_state IS NOT NULL), 0) AS net
                 FROM top_ups WHERE $1::uuid IS NULL OR tenant_id = $1
                GROUP BY tenant_id, account_id),
           expected AS (
               SELECT a.tenant_id, a.account_id, a.opening_balance, a.balance,
                      coalesce(d.deposited, 0) AS deposited, coalesce(p.paid, 0) AS paid,
                      coalesce(p.refunded, 0) AS refunded, coalesce(t.net, 0) AS transferred_net,
                      coalesce(u.net, 0) AS topped_up_net
                 FROM accounts a
                 LEFT JOIN paid p USING (tenant_id, account_id)
                 LEFT JOIN deposited d USING (tenant_id, account_id)
                 LEFT JOIN transferred t USING (tenant_id, account_id)
                 LEFT JOIN topped_up u USING (tenant_id, account_id)
                WHERE $1::uuid IS NULL OR a.tenant_id = $1)
           SELECT tenant_id AS "tenant_id!", account_id AS "account_id!",
                  opening_balance AS "opening_balance!", deposited::bigint AS "deposited!",
                  paid::bigint AS "paid!", refunded::bigint AS "refunded!",
                  transferred_net::bigint AS "transferred_net!", topped_up_net::bigint AS "topped_up_net!",
                  (opening_balance + deposited - paid + refunded + transferred_net + topped_up_net)::bigint AS "expected!",
                  balance AS "balance!", count(*) OVER () AS "total!"
             FROM expected
            WHERE opening_balance + deposited - paid + refunded + transferred_net + topped_up_net <> balance
            ORDER BY tenant_id, account_id
            LIMIT $2"#,
        o.tenant_id,
        o.samples,
    )
    .fetch_all(conn)
    .await?;
    Ok(Findings::from_rows(rows, |r| r.total))
}

async fn dangling_keys(conn: &mut PgConnection, o: &Options) -> Result<Findings<DanglingKey>, sqlx::Error> {
    // One pass over the stored successes with hash joins to each kind of resource, chosen by
    // the operation the key row names. Resource ids are text: account ids for `open_account`,
    // UUIDs written by the server everywhere else.
    let rows = sqlx::query_as!(
        DanglingKey,
        r#"WITH k AS (
               SELECT tenant_id, key, operation, path, status, resource_id,
                      CASE WHEN operation <> 'open_account' AND length(resource_id) = 36
                           THEN resource_id::uuid END AS resource_uuid
                 FROM idempotency_keys
                WHERE error_code IS NULL AND ($1::uuid IS NULL OR tenant_id = $1)),
           found AS MATERIALIZED (
               SELECT k.tenant_id, k.key, k.path, k.status, k.resource_id,
                      CASE k.operation
                           WHEN 'pay' THEN
                                CASE WHEN p.idempotency_key IS DISTINCT FROM k.key
                                     THEN 'names no payment made with this key' END
                           WHEN 'refund' THEN
                                CASE WHEN p.refunded_at IS NULL THEN 'names no refunded payment' END
                           WHEN 'deposit' THEN
                                CASE WHEN d.idempotency_key IS DISTINCT FROM k.key
                                     THEN 'names no deposit made with this key' END
                           WHEN 'transfer' THEN
                                CASE WHEN t.idempotency_key IS DISTINCT FROM k.key
                                     THEN 'names no transfer made with this key' END
                           WHEN 'open_account' THEN
                                CASE WHEN a.account_id IS NULL THEN 'names no account' END
                           WHEN 'top_up' THEN
                                CASE WHEN u.idempotency_key IS DISTINCT FROM k.key
                                     THEN 'names no top-up made with this key'
                                     WHEN u.status = 'failed' THEN 'a stored success naming a failed top-up' END
                           WHEN 'refund_top_up' THEN
                                CASE WHEN u.refund_key IS DISTINCT FROM k.key
                                     THEN 'names no top-up refunded with this key' END
                      END AS problem
                 FROM k
                 LEFT JOIN payments p ON p.tenant_id = k.tenant_id AND p.payment_id = k.resource_uuid
                 LEFT JOIN deposits d ON d.tenant_id = k.tenant_id AND d.deposit_id = k.resource_uuid
                 LEFT JOIN transfers t ON t.tenant_id = k.tenant_id AND t.transfer_id = k.resource_uuid
                 LEFT JOIN accounts a ON a.tenant_id = k.tenant_id AND a.account_id = k.resource_id
                 LEFT JOIN top_ups u ON u.tenant_id = k.tenant_id AND u.top_up_id = k.resource_uuid)
           SELECT tenant_id AS "tenant_id!", key AS "key!", path AS "path!", status AS "status!",
                  resource_id, problem AS "problem!", count(*) OVER () AS "total!"
             FROM found
            WHERE problem IS NOT NULL
            ORDER BY tenant_id, key
            LIMIT $2"#,
        o.tenant_id,
        o.samples,
    )
    .fetch_all(conn)
    .await?;
    Ok(Findings::from_rows(rows, |r| r.total))
}

async fn missing_keys(conn: &mut PgConnection, o: &Options) -> Result<Findings<MissingKey>, sqlx::Error> {
    let rows = sqlx::query_as!(
        MissingKey,
        r#"WITH keyed AS (
               SELECT 'payment'::text AS kind, tenant_id, payment_id AS id, idempotency_key AS key, created_at
                 FROM payments
                WHERE idempotency_key IS NOT NULL AND created_at > now() - make_interval(secs => $2)
                  AND ($1::uuid IS NULL OR tenant_id = $1)
               UNION ALL
               SELECT 'deposit', tenant_id, deposit_id, idempotency_key, created_at
                 FROM deposits
                WHERE idempotency_key IS NOT NULL AND created_at > now() - make_interval(secs => $2)
                  AND ($1::uuid IS NULL OR tenant_id = $1)
               UNION ALL
               SELECT 'transfer', tenant_id, transfer_id, idempotency_key, created_at
                 FROM transfers
                WHERE idempotency_key IS NOT NULL AND created_at > now() - make_interval(secs => $2)
                  AND ($1::uuid IS NULL OR tenant_id = $1)),
           found AS MATERIALIZED (
               SELECT e.kind, e.tenant_id, e.id, e.key, e.created_at, k.resource_id
                 FROM keyed e
                 LEFT JOIN idempotency_keys k ON k.tenant_id = e.tenant_id AND k.key = e.key
                WHERE k.key IS NULL
                   OR (k.resource_id IS DISTINCT FROM e.id::text
                       AND NOT (e.key LIKE 'fp:%' AND k.created_at >= e.created_at)))
           SELECT kind AS "kind!", tenant_id AS "tenant_id!", id AS "id!", key AS "key!",
                  created_at AS "created_at!", resource_id AS key_row_resource,
                  count(*) OVER () AS "total!"
             FROM found
            ORDER BY tenant_id, created_at
            LIMIT $3"#,
        o.tenant_id,
        o.retention.as_secs_f64(),
        o.samples,
    )
    .fetch_all(conn)
    .await?;
    Ok(Findings::from_rows(rows, |r| r.total))
}

async fn double_charges(conn: &mut PgConnection, o: &Options) -> Result<Findings<DoubleCharge>, sqlx::Error> {
    // Grouping first keeps the sort to the keys that have more than one effect.
    let rows = sqlx::query_as!(
        DoubleCharge,
        r#"WITH keyed AS (
               SELECT 'payment'::text AS kind, tenant_id, payment_id AS id, idempotency_key AS key, created_at
                 FROM payments WHERE idempotency_key IS NOT NULL AND ($1::uuid IS NULL OR tenant_id = $1)
               UNION ALL
               SELECT 'deposit', tenant_id, deposit_id, idempotency_key, created_at
                 FROM deposits WHERE idempotency_key IS NOT NULL AND ($1::uuid IS NULL OR tenant_id = $1)
               UNION ALL
               SELECT 'transfer', tenant_id, transfer_id, idempotency_key, created_at
                 FROM transfers WHERE idempotency_key IS NOT NULL AND ($1::uuid IS NULL OR tenant_id = $1)),
           repeated AS (
               SELECT tenant_id, key FROM keyed GROUP BY tenant_id, key HAVING count(*) > 1),
           ordered AS (
               SELECT e.kind, e.tenant_id, e.key, e.id, e.created_at,
                      lag(e.id) OVER w AS earlier_id, lag(e.created_at) OVER w AS earlier_at,
                      k.expires_at - k.created_at AS own_window
                 FROM keyed e JOIN repeated r USING (tenant_id, key)
                 LEFT JOIN idempotency_keys k ON k.tenant_id = e.tenant_id AND k.key = e.key
               WINDOW w AS (PARTITION BY e.tenant_id, e.key ORDER BY e.created_at, e.id))
           SELECT kind AS "kind!", tenant_id AS "tenant_id!", key AS "key!", id AS "id!",
                  earlier_id AS "earlier_id!",
                  extract(epoch FROM created_at - earlier_at)::float8 AS "seconds_apart!",
                  count(*) OVER () AS "total!"
             FROM ordered
            WHERE earlier_id IS NOT NULL
              AND created_at - earlier_at < CASE WHEN key LIKE 'fp:%'
                                                 THEN coalesce(own_window, make_interval(secs => $2))
                                                 ELSE make_interval(secs => $3) END
            ORDER BY tenant_id, key, created_at
            LIMIT $4"#,
        o.tenant_id,
        o.fingerprint_window.as_secs_f64(),
        o.retention.as_secs_f64(),
        o.samples,
    )
    .fetch_all(conn)
    .await?;
    Ok(Findings::from_rows(rows, |r| r.total))
}

async fn keyless_duplicates(conn: &mut PgConnection, o: &Options) -> Result<Findings<SuspectedDuplicate>, sqlx::Error> {
    let rows = sqlx::query_as!(
        SuspectedDuplicate,
        r#"WITH ordered AS (
               SELECT tenant_id, account_id, amount, payment_id, created_at,
                      lag(payment_id) OVER w AS earlier_id, lag(created_at) OVER w AS earlier_at
                 FROM payments
                -- No client's key: keyless (`allow`), or derived (`fingerprint`: a tenant switched
                -- between the two, or one request spelled two ways, charges twice unseen else).
                WHERE (idempotency_key IS NULL OR idempotency_key LIKE 'fp:%')
                  AND ($1::uuid IS NULL OR tenant_id = $1)
               WINDOW w AS (PARTITION BY tenant_id, account_id, amount ORDER BY created_at, payment_id))
           SELECT tenant_id AS "tenant_id!", account_id AS "account_id!", amount AS "amount!",
                  payment_id AS "payment_id!", earlier_id AS "earlier_payment_id!",
                  extract(epoch FROM created_at - earlier_at)::float8 AS "seconds_apart!",
                  count(*) OVER () AS "total!"
             FROM ordered
            WHERE earlier_id IS NOT NULL AND created_at - earlier_at <= make_interval(secs => $2)
            ORDER BY tenant_id, account_id, created_at
            LIMIT $3"#,
        o.tenant_id,
        o.duplicate_window.as_secs_f64(),
        o.samples,
    )
    .fetch_all(conn)
    .await?;
    Ok(Findings::from_rows(rows, |r| r.total))
}

/// [`keyless_duplicates`] among top-ups: two of them both charged the card unless one failed.
/// Also a pair further apart, when the later one was made while the earlier was unfinished
/// (found from outside: a `fingerprint` top-up waiting for 3-D Secure, told by a replica of an
/// older build to retry, was sent again after its derived key's 60 s and charged the card a
/// second time, unseen by a 5 s window). A client does not make a second identical top-up
/// while the first is still processing unless it resent the first.
async fn keyless_top_up_duplicates(
    conn: &mut PgConnection,
    o: &Options,
) -> Result<Findings<SuspectedTopUpDuplicate>, sqlx::Error> {
    let rows = sqlx::query_as!(
        SuspectedTopUpDuplicate,
        r#"WITH ordered AS (
               SELECT tenant_id, account_id, amount, top_up_id, created_at,
                      lag(top_up_id) OVER w AS earlier_id, lag(created_at) OVER w AS earlier_at,
                      lag(coalesce(finished_at, 'infinity')) OVER w AS earlier_finished_at
                 FROM top_ups
                WHERE (idempotency_key IS NULL OR idempotency_key LIKE 'fp:%')
                  AND status <> 'failed'
                  AND ($1::uuid IS NULL OR tenant_id = $1)
               WINDOW w AS (PARTITION BY tenant_id, account_id, amount ORDER BY created_at, top_up_id))
           SELECT tenant_id AS "tenant_id!", account_id AS "account_id!", amount AS "amount!",
                  top_up_id AS "top_up_id!", earlier_id AS "earlier_top_up_id!",
                  extract(epoch FROM created_at - earlier_at)::float8 AS "seconds_apart!",
                  count(*) OVER () AS "total!"
             FROM ordered
            WHERE earlier_id IS NOT NULL
              AND (created_at - earlier_at <= make_interval(secs => $2) OR created_at < earlier_finished_at)
            ORDER BY tenant_id, account_id, created_at
            LIMIT $3"#,
        o.tenant_id,
        o.duplicate_window.as_secs_f64(),
        o.samples,
    )
    .fetch_all(conn)
    .await?;
    Ok(Findings::from_rows(rows, |r| r.total))
}

fn sampled<T>(mut all: Vec<T>, samples: i64) -> Findings<T> {
    let count = all.len() as i64;
    all.truncate(usize::try_from(samples).unwrap_or(0));
    Findings { count, samples: all }
}

/// What the top-ups' checks found.
struct TopUpChecks {
    broken: Vec<TopUpFinding>,
    orphans: Vec<TopUpFinding>,
    unfinished: Vec<UnfinishedTopUp>,
}

/// The top-ups' checks: those unfinished past the completer's window (with their
/// PaymentIntent's status, given the processor's PaymentIntents, read before the snapshot with
/// the database's clock then); each succeeded PaymentIntent of oncepay's against its top-up,
/// and each credited top-up against its PaymentIntent.
async fn top_ups(
    conn: &mut PgConnection,
    o: &Options,
    intents: Option<&(chrono::DateTime<chrono::Utc>, Vec<Intent>)>,
) -> Result<TopUpChecks, sqlx::Error> {
    let after = o.completer_after.as_secs_f64();
    let by_intent: std::collections::HashMap<&str, &Intent> = intents
        .map(|(_, all)| all.iter().map(|i| (i.id.as_str(), i)).collect())
        .unwrap_or_default();
    // Every unfinished top-up (or refund) older than the window: the unfinished ones are few
    // (the partial index of V8 holds them alone).
    let unfinished: Vec<UnfinishedTopUp> = sqlx::query!(
        r#"SELECT tenant_id, top_up_id, processor_payment_id, processor_status, refund_status,
                  CASE WHEN status = 'processing' THEN 'processing' ELSE 'refund_pending' END AS "state!",
                  extract(epoch FROM now() - CASE WHEN status = 'processing' THEN created_at
                                                  ELSE coalesce(refund_requested_at, updated_at) END)::float8 AS "age_secs!"
             FROM top_ups
            WHERE (status = 'processing' OR refund_state = 'debited')
              AND ($1::uuid IS NULL OR tenant_id = $1)
            ORDER BY created_at"#,
        o.tenant_id,
    )
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .filter(|r| r.age_secs > after)
    .map(|r| UnfinishedTopUp {
        tenant_id: r.tenant_id,
        top_up_id: r.top_up_id,
        state: r.state,
        age_secs: r.age_secs.round() as i64,
        at_processor: r
            .processor_payment_id
            .as_deref()
            .and_then(|id| by_intent.get(id))
            .map(|i| i.status.clone()),
        last_seen_status: if r.refund_status.is_some() { r.refund_status } else { r.processor_status },
        processor_payment_id: r.processor_payment_id,
    })
    .collect();
    let mut found = TopUpChecks {
        broken: Vec::new(),
        orphans: Vec::new(),
        unfinished,
    };
    let Some((read_at, intents)) = intents else {
        return Ok(found);
    };
    let ours: Vec<(&Intent, Option<Uuid>)> = intents
        .iter()
        .filter_map(|i| i.top_up_id().map(|id| (i, Uuid::parse_str(id).ok())))
        .collect();
    let ids: Vec<Uuid> = ours.iter().filter_map(|(_, id)| *id).collect();
    // Every top-up a PaymentIntent names (whatever the audit's tenant: a PaymentIntent names
    // no tenant), and every top-up of the audit's scope credited before the read. A top-up not
    // finished has no `finished_at`: not finished before the read either.
    let rows = sqlx::query!(
        r#"SELECT tenant_id, top_up_id, amount AS "amount!: i64", status AS "status!: String",
                  processor_payment_id, coalesce(finished_at < $3, false) AS "finished_before_read!",
                  extract(epoch FROM now() - created_at)::float8 AS "age_secs!"
             FROM top_ups
            WHERE top_up_id = ANY($2)
               OR (($1::uuid IS NULL OR tenant_id = $1) AND balance_after IS NOT NULL AND finished_at < $3)"#,
        o.tenant_id,
        &ids,
        read_at,
    )
    .fetch_all(&mut *conn)
    .await?;
    let by_id: std::collections::HashMap<Uuid, _> = rows.iter().map(|r| (r.top_up_id, r)).collect();
    let in_scope = |tenant: Uuid| o.tenant_id.is_none_or(|t| t == tenant);
    let mut succeeded_per_top_up: std::collections::HashMap<Uuid, usize> = std::collections::HashMap::new();
    for (intent, id) in &ours {
        let finding = |tenant, top_up, problem: &str| TopUpFinding {
            tenant_id: tenant,
            top_up_id: top_up,
            processor_payment_id: Some(intent.id.clone()),
            problem: problem.to_owned(),
        };
        let row = id.and_then(|id| by_id.get(&id));
        if let Some(row) = row {
            if !in_scope(row.tenant_id) {
                continue;
            }
        }
        let ours_committed = row.is_some_and(|r| r.processor_payment_id.as_deref() == Some(intent.id.as_str()));
        if intent.status != "succeeded" {
            if intent.status == "requires_confirmation" && !ours_committed {
                let settled = row.is_none_or(|r| r.status != "processing");
                if settled {
                    found.orphans.push(finding(
                        row.map(|r| r.tenant_id),
                        *id,
                        "never confirmed; charges nothing",
                    ));
                }
            }
            continue;
        }
        let Some(row) = row else {
            found.broken.push(finding(
                None,
                *id,
                "succeeded at the processor, but oncepay has no such top-up",
            ));
            continue;
        };
        *succeeded_per_top_up.entry(row.top_up_id).or_default() += 1;
        let problem = if !ours_committed {
            Some("succeeded at the processor, but is not its top-up's PaymentIntent (a second charge)".to_owned())
        } else if row.status == "failed" {
            Some("succeeded at the processor, but its top-up is recorded as failed (not credited)".to_owned())
        } else if row.status == "processing" && row.age_secs > after {
            // Charged, and still not credited after the completer's window.
            Some(format!(
                "succeeded at the processor, but its top-up is still processing after {:.0} s (charged, not credited)",
                row.age_secs
            ))
        } else if row.status == "processing" {
            // Between the confirmation and its record.
            None
        } else if row.amount != intent.amount {
            Some("succeeded with another amount than its top-up's".to_owned())
        } else {
            None
        };
        if let Some(problem) = problem {
            found
                .broken
                .push(finding(Some(row.tenant_id), Some(row.top_up_id), &problem));
        }
    }
    for row in &rows {
        if !in_scope(row.tenant_id)
            || !(row.status == "succeeded" || row.status == "refunded")
            || !row.finished_before_read
        {
            continue;
        }
        let charged = ours.iter().any(|(intent, id)| {
            *id == Some(row.top_up_id)
                && intent.status == "succeeded"
                && row.processor_payment_id.as_deref() == Some(intent.id.as_str())
        });
        if !charged {
            // What the processor says of it points the operator at the cause.
            let seen = ours
                .iter()
                .find(|(intent, _)| row.processor_payment_id.as_deref() == Some(intent.id.as_str()));
            let problem = match seen {
                Some((intent, _)) if intent.status != "succeeded" => {
                    format!("credited, but its PaymentIntent is {} at the processor", intent.status)
                }
                Some(_) => "credited, but its PaymentIntent names another top-up".to_owned(),
                None => "credited, but the processor lists no such PaymentIntent naming it (unknown there: \
                         another processor account, or a processor that lost it)"
                    .to_owned(),
            };
            found.broken.push(TopUpFinding {
                tenant_id: Some(row.tenant_id),
                top_up_id: Some(row.top_up_id),
                processor_payment_id: row.processor_payment_id.clone(),
                problem,
            });
        }
    }
    for (top_up, n) in succeeded_per_top_up {
        if n > 1 {
            let tenant = by_id.get(&top_up).map(|r| r.tenant_id);
            found.broken.push(TopUpFinding {
                tenant_id: tenant,
                top_up_id: Some(top_up),
                processor_payment_id: None,
                problem: format!("{n} succeeded PaymentIntents for one top-up"),
            });
        }
    }
    Ok(found)
}
