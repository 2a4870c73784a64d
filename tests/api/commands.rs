//! The server-side commands of the real `oncepay` binary: serve's schema check, tenant
//! create, purge (contract section 1).

use std::time::Duration;

use tokio::process::Command;

use crate::helpers::{drop_database, empty_database};

struct Run {
    status: i32,
    stdout: String,
    stderr: String,
}

async fn oncepay(args: &[&str], database_url: &str) -> Run {
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .args(args)
            .env("DATABASE_URL", database_url)
            .env("ONCEPAY_BIND", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the command ends within 60 s")
    .expect("the binary runs");
    Run {
        status: output.status.code().expect("exited, not killed"),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

#[tokio::test]
async fn serve_on_a_schema_that_is_behind_exits_with_one_line_naming_migrate() {
    let url = empty_database("servebehind").await;

    let run = oncepay(&["serve"], &url).await;

    assert_ne!(run.status, 0);
    assert_eq!(run.stderr.trim().lines().count(), 1, "one line: {:?}", run.stderr);
    assert!(run.stderr.contains("oncepay migrate"), "{}", run.stderr);
    assert!(run.stdout.is_empty());
    drop_database(&url).await;
}

#[tokio::test]
async fn migrate_then_tenant_create_prints_one_json_object_with_a_working_key() {
    let url = empty_database("tenantcli").await;
    assert_eq!(oncepay(&["migrate"], &url).await.status, 0);

    let run = oncepay(
        &[
            "tenant",
            "create",
            "--name",
            "shop",
            "--missing-key-policy",
            "fingerprint",
            "--main-balance",
            "500",
        ],
        &url,
    )
    .await;

    assert_eq!(run.status, 0, "{}", run.stderr);
    let created: serde_json::Value = serde_json::from_str(run.stdout.trim()).expect("one JSON object on stdout");
    assert_eq!(created["name"], "shop");
    assert_eq!(created["missing_key_policy"], "fingerprint");
    assert!(created["api_key"].as_str().unwrap().starts_with("opk_"));
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let balance: i64 =
        sqlx::query_scalar("SELECT balance FROM accounts WHERE tenant_id = $1::uuid AND account_id = 'main'")
            .bind(created["tenant_id"].as_str().unwrap())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(balance, 500);
    let refused = oncepay(&["tenant", "create", "--name", "x", "--main-balance", "-1"], &url).await;
    assert_ne!(refused.status, 0);
    pool.close().await;
    drop_database(&url).await;
}

#[tokio::test]
async fn purge_prints_deleted_n() {
    let url = empty_database("purgecli").await;
    assert_eq!(oncepay(&["migrate"], &url).await.status, 0);
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant_id, key, fingerprint, method, path, status, created_at, expires_at)
         SELECT gen_random_uuid(), 'k' || i, '\\x00', 'POST', '/payments', 201, now() - interval '8 days', now() - interval '7 days'
           FROM generate_series(1, 42) i",
    )
    .execute(&pool)
    .await
    .unwrap();

    let run = oncepay(&["purge"], &url).await;

    assert_eq!(run.status, 0, "{}", run.stderr);
    assert_eq!(run.stdout.trim(), "deleted=42");
    pool.close().await;
    drop_database(&url).await;
}
