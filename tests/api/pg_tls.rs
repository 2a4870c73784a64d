//! TLS to PostgreSQL: `DATABASE_URL`'s `sslmode` and `sslrootcert` are honoured by `serve`,
//! `migrate` and every command (sqlx with rustls; migrations go through sqlx too).
//!
//! The local cluster has `ssl = on` with a certificate for 127.0.0.1 alone, signed by a CA of
//! its own (scripts/db.sh); `make test` names that CA in `ONCEPAY_TEST_PG_CA`.

use oncepay::config::Pooler;
use sqlx::PgPool;

use crate::commands::oncepay;
use crate::support::helpers::{database_url, new_key, TestApp};
use crate::tls::{Authority, Files};

fn cluster_ca() -> String {
    std::env::var("ONCEPAY_TEST_PG_CA")
        .expect("ONCEPAY_TEST_PG_CA names the test cluster's CA certificate (make test sets it: scripts/db.sh ca)")
}

/// The test database's URL with TLS parameters, and `host` instead of its host.
fn url_with(host: &str, params: &str) -> String {
    let mut url = reqwest::Url::parse(&database_url()).unwrap();
    url.set_host(Some(host)).unwrap();
    format!("{url}?{params}")
}

/// Connections of this database whose traffic is encrypted, from the view of the server.
async fn encrypted_sessions(pool: &PgPool, application: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
          WHERE s.ssl AND a.application_name = $1 AND a.datname = current_database()",
    )
    .bind(application)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn verify_full_with_the_clusters_ca_migrates_serves_and_encrypts() {
    let url = url_with(
        "127.0.0.1",
        &format!("sslmode=verify-full&sslrootcert={}", cluster_ca()),
    );
    oncepay::db::migrate(&url).await.unwrap();
    let run = oncepay(&["migrate"], &url).await;
    assert_eq!(run.status, 0, "{}", run.stderr);

    let app = TestApp::builder()
        .settings(|s| {
            s.database_url = url.clone();
            s.db_pooler = Pooler::None;
        })
        .spawn()
        .await;
    assert_eq!(app.pay(Some(&new_key()), 10).await.status, 201);
    // The server's own connections, as PostgreSQL sees them.
    let sessions = encrypted_sessions(&app.pool, oncepay::db::APPLICATION_NAME).await;
    assert!(sessions >= 1, "the server's connection is encrypted");
}

#[tokio::test]
async fn sslmode_require_encrypts_without_verifying() {
    // Reached as `localhost`, which the certificate does not name: require checks nothing.
    let url = url_with("localhost", "sslmode=require&application_name=oncepay-tls-require");
    let pool = PgPool::connect(&url).await.unwrap();
    assert_eq!(encrypted_sessions(&pool, "oncepay-tls-require").await, 1);
    oncepay::db::migrate(&url).await.unwrap();
}

#[tokio::test]
async fn a_certificate_that_does_not_verify_is_a_one_line_error_naming_the_problem() {
    let files = Files::new();
    let stranger = files.write("stranger.pem", &Authority::new("nobody's CA").pem());
    let cases = [
        // Signed by a CA that is not trusted.
        (
            url_with(
                "127.0.0.1",
                &format!("sslmode=verify-full&sslrootcert={}", stranger.display()),
            ),
            "UnknownIssuer",
        ),
        // The right CA, but the certificate does not name `localhost`.
        (
            url_with(
                "localhost",
                &format!("sslmode=verify-full&sslrootcert={}", cluster_ca()),
            ),
            "not valid for name",
        ),
    ];
    for (url, problem) in &cases {
        for command in ["migrate", "serve"] {
            let run = oncepay(&[command], url).await;
            assert_ne!(run.status, 0, "{command} {url}");
            // The error is one line (log lines may precede it on stderr).
            let errors: Vec<&str> = run.stderr.lines().filter(|l| l.starts_with("oncepay: ")).collect();
            assert_eq!(errors.len(), 1, "{command}: one error line: {:?}", run.stderr);
            assert!(
                errors[0].contains("certificate") && errors[0].contains(problem),
                "{command} names the problem ({problem}): {}",
                errors[0]
            );
        }
    }
    // verify-ca: the chain is checked. (libpq's verify-ca skips the name; sqlx 0.8.6's does
    // too only for rustls' older NotValidForName error, and the rustls in the tree reports
    // NotValidForNameContext, so here a wrong name is refused as under verify-full: stricter,
    // never weaker. docs/security.md recommends verify-full.)
    let right = url_with("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={}", cluster_ca()));
    assert_eq!(oncepay(&["migrate"], &right).await.status, 0);
    let stranger_ca = url_with(
        "127.0.0.1",
        &format!("sslmode=verify-ca&sslrootcert={}", stranger.display()),
    );
    assert_ne!(oncepay(&["migrate"], &stranger_ca).await.status, 0);
}
