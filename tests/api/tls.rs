//! HTTPS on both ends (README.md, settings: ONCEPAY_TLS_CERT): `serve` with ONCEPAY_TLS_CERT /
//! ONCEPAY_TLS_KEY, the client and the CLI trusting the system's roots plus ONCEPAY_CA_CERT.
//! The certificates are made at run time: a CA and a server certificate for localhost and
//! 127.0.0.1, a certificate from a CA nobody trusts, and one for another host name.

use std::path::{Path, PathBuf};
use std::time::Duration;

use oncepay_client::{Client, ClientError, IdempotencyKey};
use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use uuid::Uuid;

use crate::cli::{oncepay, server_args};
use crate::client::fast_config;
use crate::support::helpers::{database_url, spawn_app_with, TestApp, MAIN_BALANCE};
use crate::support::tcp_cut::TlsCutProxy;

/// A certificate authority of the test.
pub struct Authority {
    certificate: Certificate,
    key: KeyPair,
}

impl Authority {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let certificate = params.self_signed(&key).unwrap();
        Self { certificate, key }
    }

    /// A server certificate for `names` (host names or IP addresses) and its key, in PEM.
    fn issue(&self, names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
        let key = KeyPair::generate().unwrap();
        let certificate = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &self.certificate, &self.key)
            .unwrap();
        (certificate.pem(), key.serialize_pem())
    }

    pub fn pem(&self) -> String {
        self.certificate.pem()
    }
}

/// A folder of PEM files, removed at the end of the test.
pub struct Files(PathBuf);

impl Files {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("oncepay-tls-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A server speaking HTTPS with this certificate and key.
async fn https_app(files: &Files, (certificate, key): (String, String)) -> TestApp {
    let cert = files.write("server.pem", &certificate);
    let key = files.write("server.key", &key);
    spawn_app_with(|settings| {
        settings.tls_cert = Some(cert);
        settings.tls_key = Some(key);
    })
    .await
}

fn port_of(app: &TestApp) -> u16 {
    app.address.rsplit(':').next().unwrap().parse().unwrap()
}

fn https_client(url: &str, app: &TestApp, trusted: &Authority) -> Client {
    Client::builder(url, &app.api_key)
        .config(fast_config())
        .add_root_certificates_pem(trusted.pem().as_bytes())
        .build()
        .expect("client builds")
}

#[tokio::test]
async fn a_client_that_trusts_the_ca_pays_over_https_by_name_and_by_address() {
    let (ca, files) = (Authority::new("oncepay test CA"), Files::new());
    let app = https_app(&files, ca.issue(&["localhost", "127.0.0.1"])).await;
    let port = port_of(&app);

    let by_name = https_client(&format!("https://localhost:{port}"), &app, &ca);
    let payment = by_name
        .pay(100, None, &IdempotencyKey::generate())
        .await
        .expect("paid over HTTPS");
    let by_address = https_client(&format!("https://127.0.0.1:{port}"), &app, &ca);
    let account = by_address.account("main").await.expect("read over HTTPS");

    assert_eq!((payment.status, payment.value.balance), (201, MAIN_BALANCE - 100));
    assert_eq!(account.value.balance, MAIN_BALANCE - 100);
    let plain = app.client.get(format!("http://127.0.0.1:{port}/healthz")).send().await;
    assert!(plain.is_err(), "the port speaks HTTPS instead of HTTP: {plain:?}");
}

#[tokio::test]
async fn certificates_that_do_not_verify_fail_at_once_and_send_nothing() {
    let (trusted, stranger, files) = (
        Authority::new("oncepay test CA"),
        Authority::new("nobody's CA"),
        Files::new(),
    );
    let cases = [
        (
            "an untrusted issuer",
            stranger.issue(&["localhost", "127.0.0.1"]),
            "UnknownIssuer",
        ),
        (
            "another host name",
            trusted.issue(&["pay.example.com"]),
            "NotValidForName",
        ),
    ];
    for (case, certificate, reason) in cases {
        let app = https_app(&files, certificate).await;
        let proxy = TlsCutProxy::relay(port_of(&app)).await;
        let client = https_client(&format!("https://127.0.0.1:{}", proxy.port), &app, &trusted);

        let err = client
            .pay(100, None, &IdempotencyKey::generate())
            .await
            .expect_err(case);

        assert!(matches!(err, ClientError::Tls { .. }), "{case}: {err:?}");
        assert_eq!(err.code(), "tls_certificate_refused", "{case}");
        assert!(format!("{err:?}").contains(reason), "{case}: {err:?}");
        assert!(!err.outcome_unknown(), "{case}: nothing was sent");
        assert_eq!(proxy.connections(), 1, "{case}: no retry");
        assert_eq!((app.key_count().await, app.payment_count().await), (0, 0), "{case}");
        assert_eq!(app.balance("main").await, MAIN_BALANCE, "{case}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_connection_cut_after_the_request_was_sent_is_retried_and_the_retry_replays() {
    let (ca, files) = (Authority::new("oncepay test CA"), Files::new());
    let app = https_app(&files, ca.issue(&["localhost", "127.0.0.1"])).await;
    let proxy = TlsCutProxy::cutting_the_first(port_of(&app)).await;
    let client = https_client(&format!("https://127.0.0.1:{}", proxy.port), &app, &ca);
    let key = IdempotencyKey::generate();

    let payment = tokio::spawn({
        let (client, key) = (client.clone(), key.clone());
        async move { client.pay(100, None, &key).await }
    });
    proxy.request_through().await;
    // The payment commits on the server while its answer is held by the proxy; then the
    // connection is cut, the answer lost.
    wait_for(|| async { app.payment_count().await == 1 }).await;
    proxy.cut();
    let payment = payment.await.unwrap().expect("the retry gets the answer");

    assert!(payment.replayed, "the retry is answered with the stored result");
    assert_eq!((payment.attempts, proxy.connections()), (2, 2));
    assert_eq!((payment.status, payment.value.charged), (201, 100));
    assert_eq!(app.payment_count().await, 1, "charged once");
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 100);
}

#[tokio::test]
async fn the_cli_trusts_the_roots_named_by_oncepay_ca_cert() {
    let (ca, files) = (Authority::new("oncepay test CA"), Files::new());
    let app = https_app(&files, ca.issue(&["localhost", "127.0.0.1"])).await;
    let ca_file = files.write("ca.pem", &ca.pem());
    let url = format!("https://localhost:{}", port_of(&app));
    let mut args = vec!["pay"];
    args.extend(server_args(&url, &app));
    args.extend(["--amount", "100"]);

    let untrusting = oncepay(&args, &[]).await;
    let trusting = oncepay(&args, &[("ONCEPAY_CA_CERT", path_str(&ca_file))]).await;

    assert_eq!(untrusting.status, 3, "stderr: {}", untrusting.stderr);
    assert!(
        untrusting.stderr.contains("code=tls_certificate_refused") && !untrusting.stderr.contains("retrying"),
        "{}",
        untrusting.stderr
    );
    assert_eq!(trusting.status, 0, "stderr: {}", trusting.stderr);
    assert_eq!(trusting.json()["charged"], 100);
    assert_eq!(app.payment_count().await, 1);
}

#[tokio::test]
async fn serve_refuses_to_start_with_a_certificate_but_no_key() {
    let files = Files::new();
    let cert = files.write("server.pem", &Authority::new("oncepay test CA").issue(&["localhost"]).0);
    let database = database_url();

    let run = oncepay(
        &["serve"],
        &[
            ("DATABASE_URL", &database),
            ("ONCEPAY_BIND", "127.0.0.1:0"),
            ("ONCEPAY_METRICS_BIND", "127.0.0.1:0"),
            ("ONCEPAY_TLS_CERT", path_str(&cert)),
        ],
    )
    .await;

    assert_eq!(run.status, 1, "stdout: {} stderr: {}", run.stdout, run.stderr);
    assert_eq!(
        run.stderr.trim(),
        "oncepay: ONCEPAY_TLS_CERT is set but ONCEPAY_TLS_KEY is not: set both to serve HTTPS, or neither"
    );
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temporary path")
}

/// Polls `condition` every 20 ms for at most 10 s.
async fn wait_for<F, Fut>(condition: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..500 {
        if condition().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the condition did not hold within 10 s");
}
