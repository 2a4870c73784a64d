//! The schema itself: every CHECK constraint and domain, the rules across a key row's columns, and the
//! enum types against their Rust types.

use oncepay::domain::PaymentId;
use oncepay::ledger::Refund;
use oncepay::operation::{ClaimOutcome, Decline, Operation};
use sqlx::PgPool;

use super::{deposit, open_account, pay, refund_path, transfer, Fx};
use crate::support::helpers::MAIN_BALANCE;

// ---------------------------------------------------------------------------------------
// CHECK constraints
// ---------------------------------------------------------------------------------------

/// One column list with valid values per table; each case overrides one or two of them.
fn insert(table: &str, base: &[(&str, &str)], changes: &[(&str, &str)]) -> String {
    let values: Vec<&str> = base
        .iter()
        .map(|(column, value)| changes.iter().find(|(c, _)| c == column).map_or(*value, |(_, v)| *v))
        .collect();
    let columns: Vec<&str> = base.iter().map(|(c, _)| *c).collect();
    format!(
        "INSERT INTO {table} ({}) VALUES ({})",
        columns.join(", "),
        values.join(", ")
    )
}

#[tokio::test]
async fn every_check_constraint_and_domain_refuses_a_row_that_breaks_it() {
    let fx = Fx::new().await;
    fx.open("other", 0).await;
    let tenant = format!("'{}'", fx.tenant);
    let fp32 = "'\\x0000000000000000000000000000000000000000000000000000000000000000'::bytea";
    let key = [
        ("tenant_id", tenant.as_str()),
        ("key", "'k'"),
        ("fingerprint", fp32),
        ("operation", "'pay'"),
        ("method", "'POST'"),
        ("path", "'/payments'"),
        ("status", "201"),
        ("resource_id", "'r'"),
        ("error_code", "NULL"),
        ("created_at", "now()"),
        ("expires_at", "now() + interval '1 hour'"),
    ];
    let accounts = [
        ("tenant_id", tenant.as_str()),
        ("account_id", "'fresh'"),
        ("balance", "0"),
        ("opening_balance", "0"),
    ];
    let payments = [
        ("tenant_id", tenant.as_str()),
        ("payment_id", "gen_random_uuid()"),
        ("account_id", "'main'"),
        ("amount", "1"),
        ("balance_after", "0"),
        ("created_at", "now()"),
        ("refunded_at", "NULL"),
        ("balance_after_refund", "NULL"),
    ];
    let deposits = [
        ("tenant_id", tenant.as_str()),
        ("deposit_id", "gen_random_uuid()"),
        ("account_id", "'main'"),
        ("amount", "1"),
        ("balance_after", "1"),
        ("created_at", "now()"),
    ];
    let tenants = [
        ("tenant_id", "gen_random_uuid()"),
        ("name", "'shop'"),
        ("api_key_hash", "sha256(gen_random_uuid()::text::bytea)"),
        ("creation_fingerprint", "NULL"),
        ("creation_expires_at", "NULL"),
    ];
    let transfers = [
        ("tenant_id", tenant.as_str()),
        ("transfer_id", "gen_random_uuid()"),
        ("from_account_id", "'main'"),
        ("to_account_id", "'other'"),
        ("amount", "1"),
        ("from_balance_after", "0"),
        ("to_balance_after", "1"),
        ("created_at", "now()"),
    ];
    let top_ups = [
        ("tenant_id", tenant.as_str()),
        ("top_up_id", "gen_random_uuid()"),
        ("account_id", "'main'"),
        ("amount", "1"),
        ("currency", "'usd'"),
        ("payment_method", "'pm_card_visa'"),
        ("status", "'succeeded'"),
        ("recovery_point", "'finished'"),
        ("balance_after", "1"),
        ("refund_state", "NULL"),
        ("created_at", "now()"),
        ("updated_at", "now()"),
        ("processor", "'http://127.0.0.1:8420'"),
    ];
    let long_key = format!("'{}'", "k".repeat(256));
    let long_account = format!("'{}'", "a".repeat(65));
    let long_name = format!("'{}'", "n".repeat(201));
    let cases: Vec<(&str, String)> = vec![
        (
            "oncepay_idempotency_key_check",
            insert("idempotency_keys", &key, &[("key", &long_key)]),
        ),
        (
            "oncepay_idempotency_key_check",
            insert("idempotency_keys", &key, &[("key", "''")]),
        ),
        (
            "oncepay_fingerprint_check",
            insert("idempotency_keys", &key, &[("fingerprint", "'\\x00'::bytea")]),
        ),
        (
            "oncepay_http_method_check",
            insert("idempotency_keys", &key, &[("method", "'GET'")]),
        ),
        (
            "oncepay_key_status_check",
            insert(
                "idempotency_keys",
                &key,
                &[
                    ("status", "500"),
                    ("resource_id", "NULL"),
                    ("error_code", "'not_found'"),
                ],
            ),
        ),
        (
            "oncepay_key_status_check",
            insert("idempotency_keys", &key, &[("status", "199")]),
        ),
        (
            "oncepay_account_id_check",
            insert("accounts", &accounts, &[("account_id", "'a b'")]),
        ),
        (
            "oncepay_account_id_check",
            insert("accounts", &accounts, &[("account_id", &long_account)]),
        ),
        (
            "oncepay_opening_balance_check",
            insert("accounts", &accounts, &[("opening_balance", "-1")]),
        ),
        (
            "oncepay_opening_balance_check",
            insert("accounts", &accounts, &[("opening_balance", "1000000000001")]),
        ),
        (
            "oncepay_balance_check",
            insert("accounts", &accounts, &[("balance", "-1")]),
        ),
        (
            "oncepay_amount_check",
            insert("payments", &payments, &[("amount", "0")]),
        ),
        (
            "oncepay_amount_check",
            insert("payments", &payments, &[("amount", "1000000000001")]),
        ),
        (
            "oncepay_balance_check",
            insert("payments", &payments, &[("balance_after", "-1")]),
        ),
        (
            "payments_refund_check",
            insert("payments", &payments, &[("refunded_at", "now()")]),
        ),
        (
            "payments_refund_check",
            insert("payments", &payments, &[("balance_after_refund", "1")]),
        ),
        (
            "oncepay_amount_check",
            insert("deposits", &deposits, &[("amount", "0")]),
        ),
        ("tenants_name_check", insert("tenants", &tenants, &[("name", "''")])),
        (
            "tenants_name_check",
            insert("tenants", &tenants, &[("name", &long_name)]),
        ),
        (
            "tenants_name_check",
            insert("tenants", &tenants, &[("name", "E'shop\\n'")]),
        ),
        (
            "tenants_creation_key_check",
            insert("tenants", &tenants, &[("creation_fingerprint", fp32)]),
        ),
        (
            "tenants_creation_key_check",
            insert("tenants", &tenants, &[("creation_expires_at", "now()")]),
        ),
        (
            "transfers_accounts_check",
            insert("transfers", &transfers, &[("to_account_id", "'main'")]),
        ),
        (
            "oncepay_amount_check",
            insert("transfers", &transfers, &[("amount", "0")]),
        ),
        (
            "oncepay_balance_check",
            insert("transfers", &transfers, &[("from_balance_after", "-1")]),
        ),
        (
            "oncepay_balance_check",
            insert("transfers", &transfers, &[("to_balance_after", "-1")]),
        ),
        (
            "oncepay_top_up_status_check",
            insert("top_ups", &top_ups, &[("status", "'pending'")]),
        ),
        (
            "oncepay_top_up_recovery_point_check",
            insert("top_ups", &top_ups, &[("recovery_point", "'confirmed'")]),
        ),
        (
            "oncepay_top_up_refund_state_check",
            insert("top_ups", &top_ups, &[("refund_state", "'asked'")]),
        ),
        ("oncepay_amount_check", insert("top_ups", &top_ups, &[("amount", "0")])),
        (
            "top_ups_succeeded_check",
            insert("top_ups", &top_ups, &[("balance_after", "NULL")]),
        ),
        (
            "top_ups_succeeded_check",
            insert(
                "top_ups",
                &top_ups,
                &[("status", "'processing'"), ("recovery_point", "'started'")],
            ),
        ),
        (
            "top_ups_refund_check",
            insert(
                "top_ups",
                &top_ups,
                &[
                    ("status", "'failed'"),
                    ("balance_after", "NULL"),
                    ("refund_state", "'debited'"),
                ],
            ),
        ),
        (
            "top_ups_refunded_check",
            insert("top_ups", &top_ups, &[("status", "'refunded'")]),
        ),
        (
            "top_ups_refunded_check",
            insert("top_ups", &top_ups, &[("refund_state", "'refunded'")]),
        ),
        (
            "oncepay_webhook_event_type_check",
            "SELECT 'payment.created'::oncepay_webhook_event_type".to_owned(),
        ),
    ];

    // Each base row is valid: a refusal below is the case's doing.
    for (table, base) in [
        ("idempotency_keys", &key[..]),
        ("accounts", &accounts[..]),
        ("payments", &payments[..]),
        ("deposits", &deposits[..]),
        ("tenants", &tenants[..]),
        ("transfers", &transfers[..]),
        ("top_ups", &top_ups[..]),
    ] {
        let mut tx = fx.pool.begin().await.unwrap();
        let valid = sqlx::query(&insert(table, base, &[])).execute(&mut *tx).await;
        assert!(valid.is_ok(), "the base row of {table} is refused: {valid:?}");
        tx.rollback().await.unwrap();
    }
    for (constraint, sql) in &cases {
        let mut tx = fx.pool.begin().await.unwrap();
        let refused = sqlx::query(sql).execute(&mut *tx).await.expect_err(sql);
        tx.rollback().await.unwrap();
        let db = refused.as_database_error().expect("a database error");
        assert_eq!(db.code().as_deref(), Some("23514"), "{sql}: {refused}");
        assert_eq!(db.constraint(), Some(*constraint), "{sql}");
    }

    // Every CHECK constraint of these tables and of oncepay's domains has a case above.
    let mut added: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT conname::text FROM pg_constraint
          WHERE contype = 'c'
            AND (conrelid IN ('idempotency_keys'::regclass, 'accounts'::regclass, 'payments'::regclass,
                              'deposits'::regclass, 'tenants'::regclass, 'transfers'::regclass,
                              'top_ups'::regclass)
                 OR contypid IN (SELECT oid FROM pg_type WHERE typtype = 'd' AND typname LIKE 'oncepay\\_%'))
            AND conname <> 'tenants_missing_key_policy_check'",
    )
    .fetch_all(&fx.pool)
    .await
    .unwrap();
    added.sort();
    let mut tested: Vec<String> = cases.iter().map(|(c, _)| c.to_string()).collect();
    tested.sort();
    tested.dedup();
    assert_eq!(tested, added, "one case at least per CHECK constraint and domain");
}

/// The rules across a key row's columns are not CHECKs (V5: ~75k instructions per new key);
/// the two statements that write key rows keep them. Every outcome of every operation, then
/// the rows as stored: a success names its resource and no error, a stored failure the
/// reverse, and each row's window is positive.
#[tokio::test]
async fn key_rows_written_by_the_functions_keep_the_cross_column_rules() {
    let fx = Fx::new().await;
    fx.open("other", 0).await;
    let payment = fx.paid(300).await;
    let missing = PaymentId::new_random();
    let (refund, refund_missing) = (refund_path(payment), refund_path(missing));
    let mut n = 0;
    let mut key = || {
        n += 1;
        format!("rules-{n}")
    };
    fx.run_keyed(&pay("main", 1), "/payments", &key()).await;
    fx.run_keyed(&pay("main", MAIN_BALANCE * 2), "/payments", &key()).await;
    fx.run_keyed(&pay("nobody", 1), "/payments", &key()).await;
    fx.run_keyed(&Refund { payment }, &refund, &key()).await;
    fx.run_keyed(&Refund { payment }, &refund, &key()).await;
    fx.run_keyed(&Refund { payment: missing }, &refund_missing, &key())
        .await;
    fx.run_keyed(&deposit("main", 5), "/accounts/main/deposits", &key())
        .await;
    fx.run_keyed(&deposit("nobody", 5), "/accounts/nobody/deposits", &key())
        .await;
    fx.run_keyed(&open_account("fresh", 1), "/accounts", &key()).await;
    fx.run_keyed(&open_account("fresh", 1), "/accounts", &key()).await;
    fx.run_keyed(&transfer("main", "other", 1), "/transfers", &key()).await;
    fx.run_keyed(&transfer("main", "nobody", 1), "/transfers", &key()).await;

    let (rows, successes, failures, broken): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*),
                count(*) FILTER (WHERE status < 300),
                count(*) FILTER (WHERE status >= 400),
                count(*) FILTER (WHERE NOT (
                    expires_at > created_at
                    AND ((status < 300 AND error_code IS NULL AND resource_id IS NOT NULL)
                         OR (status >= 400 AND error_code IS NOT NULL AND resource_id IS NULL))))
           FROM idempotency_keys WHERE tenant_id = $1 AND key LIKE 'rules-%'",
    )
    .bind(fx.tenant.get())
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert_eq!((rows, successes, failures), (12, 5, 7), "every outcome was stored");
    assert_eq!(broken, 0, "a key row breaks the result or window rule");
}

// ---------------------------------------------------------------------------------------
// Enum types
// ---------------------------------------------------------------------------------------

async fn labels(pool: &PgPool, enum_type: &str) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT label::text FROM unnest(enum_range(NULL::{enum_type})) WITH ORDINALITY AS e (label, n) ORDER BY n"
    ))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Decodes every label of a PostgreSQL enum into its Rust type, in the type's order.
async fn decoded<T>(pool: &PgPool, enum_type: &str) -> Vec<T>
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    sqlx::query_scalar(&format!(
        "SELECT label FROM unnest(enum_range(NULL::{enum_type})) WITH ORDINALITY AS e (label, n) ORDER BY n"
    ))
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_operation_enum_lists_operation_all_in_order() {
    let fx = Fx::new().await;
    let decoded: Vec<Operation> = decoded(&fx.pool, "oncepay_operation").await;
    assert_eq!(decoded, Operation::ALL);
    assert_eq!(
        labels(&fx.pool, "oncepay_operation").await,
        [
            "pay",
            "refund",
            "deposit",
            "open_account",
            "transfer",
            "top_up",
            "refund_top_up",
            "create_webhook_endpoint",
            "rotate_webhook_secret",
            "enable_webhook_endpoint",
            "resend_webhook_event",
            "recover_webhook_endpoint"
        ]
    );
}

#[tokio::test]
async fn the_decline_enum_lists_the_codes_of_decline_all_in_order() {
    let fx = Fx::new().await;
    let codes: Vec<&str> = Decline::ALL.iter().map(|d| d.code().as_str()).collect();
    assert_eq!(labels(&fx.pool, "oncepay_decline").await, codes);
    let decoded: Vec<Decline> = decoded(&fx.pool, "oncepay_decline").await;
    assert_eq!(decoded, Decline::ALL);
}

#[tokio::test]
async fn the_outcome_enum_names_every_claim_outcome_in_order() {
    use ClaimOutcome::*;
    // Fails to compile when a variant is added, so the list below stays complete.
    let every = |o: ClaimOutcome| match o {
        Created | Replayed | Declined | KeyReused | Expired => o,
    };
    let fx = Fx::new().await;
    let decoded: Vec<ClaimOutcome> = decoded(&fx.pool, "oncepay_outcome").await;
    assert_eq!(decoded, [Created, Replayed, Declined, KeyReused, Expired].map(every));
    assert_eq!(
        labels(&fx.pool, "oncepay_outcome").await,
        ["created", "replayed", "declined", "key_reused", "expired"]
    );
}

/// `oncepay_pay_in_batch` repeats `oncepay_pay`'s body without the event, which the batch
/// writes for all its payments in one INSERT (migrations/V20; one calling the other would cost
/// every lone payment a PL/pgSQL call): nothing else may differ, or the two paths of a payment
/// would part. As the database holds them (schema/functions/ shows the same).
#[tokio::test]
async fn oncepay_pay_in_batch_is_oncepay_pay_without_its_event() {
    let fx = Fx::new().await;
    let definition = |name: &'static str| {
        let pool = fx.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT pg_get_functiondef($1::regproc)")
                .bind(name)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    // oncepay_pay, called by the server, carries the seqscan setting; oncepay_pay_in_batch
    // plans under that of oncepay_pay_batch, its only caller (migrations/V27).
    let setting = "\n SET enable_seqscan TO 'off'\n";
    let pay = definition("oncepay_pay").await;
    assert!(pay.contains(setting), "oncepay_pay plans without the seqscan setting");
    assert!(
        definition("oncepay_pay_batch").await.contains(setting),
        "oncepay_pay_batch plans without the seqscan setting"
    );
    let pay = pay.replacen(setting, "\n", 1);
    let in_batch = definition("oncepay_pay_in_batch").await;
    // The event: the check for an endpoint and the event's INSERT, one IF block.
    let start = pay
        .find("            IF EXISTS (SELECT FROM webhook_endpoints")
        .expect("oncepay_pay writes its event");
    let end_of_block = "            END IF;\n";
    let end = start + pay[start..].find(end_of_block).expect("the event's block ends") + end_of_block.len();
    let without_event = format!("{}{}", &pay[..start], &pay[end..]);
    let in_batch = in_batch
        .replacen("oncepay_pay_in_batch(", "oncepay_pay(", 1)
        .replacen("\n ROWS 1\n", "\n", 1);
    assert_eq!(
        without_event, in_batch,
        "oncepay_pay_in_batch is no longer oncepay_pay without its event"
    );
}
