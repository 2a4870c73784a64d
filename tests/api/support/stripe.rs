//! A real card processor for the top-up tests: localstripe (PyPI, a stateful emulator of
//! Stripe's API that nobody here wrote), one instance per test on a free port, started with
//! `--from-scratch` so that it serves only this test's state. It saves its state to the fixed
//! file /tmp/localstripe.pickle on every change, but reads it back only without
//! `--from-scratch`: concurrent instances overwrite a file none of them reads, and each
//! serves from its own memory. It ignores `Idempotency-Key`, which is the point: oncepay must
//! not depend on the processor deduplicating.
//!
//! The executable comes from `ONCEPAY_TEST_LOCALSTRIPE` (the Makefile sets it) or is
//! installed on first use by `scripts/localstripe.sh install`.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::process::{Child, Command};

pub const API_KEY: &str = "sk_test_oncepay";

async fn executable() -> String {
    static EXE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
    EXE.get_or_init(|| async {
        if let Ok(exe) = std::env::var("ONCEPAY_TEST_LOCALSTRIPE") {
            return exe;
        }
        // Installed already by the Makefile (or an earlier test run) under the target dir.
        let target = std::env::var("CARGO_TARGET_DIR")
            .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").to_owned());
        let exe = format!("{target}/localstripe-venv/bin/localstripe");
        if std::path::Path::new(&exe).exists() {
            return exe;
        }
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/localstripe.sh");
        let output = Command::new(script)
            .arg("install")
            .output()
            .await
            .expect("scripts/localstripe.sh runs");
        assert!(
            output.status.success(),
            "localstripe could not be installed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap().trim().to_owned()
    })
    .await
    .clone()
}

/// A running localstripe, killed when dropped.
pub struct Localstripe {
    pub url: String,
    child: Child,
    _dir: TempDir,
    http: reqwest::Client,
}

/// A directory of its own, removed when dropped (localstripe's working directory).
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Localstripe {
    pub async fn start() -> Self {
        let exe = executable().await;
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let dir = std::env::temp_dir().join(format!("oncepay-localstripe-{}", uuid::Uuid::new_v4()));
            std::fs::create_dir_all(&dir).unwrap();
            let child = Command::new(&exe)
                .args(["--port", &port.to_string(), "--from-scratch"])
                .current_dir(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .expect("localstripe starts");
            let stripe = Self {
                url: format!("http://127.0.0.1:{port}"),
                child,
                _dir: TempDir(dir),
                http: reqwest::Client::new(),
            };
            for _ in 0..200 {
                if stripe.get("/v1/payment_intents?limit=1").await.is_ok() {
                    // Ours, or another test's that took the port first (ours then failed to
                    // bind): a nonce of ours must be the only one there.
                    if stripe.is_ours().await {
                        return stripe;
                    }
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // Dropped: killed (another process may have taken the port).
        }
        panic!("localstripe did not answer after five starts");
    }

    /// Leaves a customer with a nonce and checks that it is the only one: an instance
    /// another test started (and marked) on the same port fails this.
    async fn is_ours(&self) -> bool {
        let nonce = uuid::Uuid::new_v4().to_string();
        self.post("/v1/customers", &[("description", &nonce)]).await;
        let Ok(customers) = self.get("/v1/customers?limit=100").await else {
            return false;
        };
        let all = customers["data"].as_array().cloned().unwrap_or_default();
        all.len() == 1 && all[0]["description"] == nonce.as_str()
    }

    async fn get(&self, path: &str) -> Result<Value, String> {
        let response = self
            .http
            .get(format!("{}{path}", self.url))
            .bearer_auth(API_KEY)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("{}", response.status()));
        }
        response.json().await.map_err(|e| e.to_string())
    }

    async fn post(&self, path: &str, form: &[(&str, &str)]) -> Value {
        self.http
            .post(format!("{}{path}", self.url))
            .bearer_auth(API_KEY)
            .form(form)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Every PaymentIntent it holds.
    pub async fn intents(&self) -> Vec<Value> {
        let mut all: Vec<Value> = Vec::new();
        loop {
            let mut path = "/v1/payment_intents?limit=100".to_owned();
            if let Some(last) = all.last() {
                path.push_str(&format!("&starting_after={}", last["id"].as_str().unwrap()));
            }
            let page = self.get(&path).await.unwrap();
            let data = page["data"].as_array().unwrap().clone();
            let more = page["has_more"].as_bool().unwrap_or(false);
            all.extend(data);
            if !more || all.is_empty() {
                return all;
            }
        }
    }

    /// The PaymentIntents carrying `metadata[oncepay_top_up_id] = top_up`.
    pub async fn intents_of(&self, top_up: &str) -> Vec<Value> {
        self.intents()
            .await
            .into_iter()
            .filter(|i| i["metadata"]["oncepay_top_up_id"] == top_up)
            .collect()
    }

    /// How many of a top-up's PaymentIntents succeeded.
    pub async fn succeeded_of(&self, top_up: &str) -> usize {
        self.intents_of(top_up)
            .await
            .iter()
            .filter(|i| i["status"] == "succeeded")
            .count()
    }

    /// The refunds of a PaymentIntent.
    pub async fn refunds_of(&self, intent: &str) -> Vec<Value> {
        self.get(&format!("/v1/refunds?payment_intent={intent}&limit=100"))
            .await
            .unwrap()["data"]
            .as_array()
            .unwrap()
            .clone()
    }

    /// A card payment method of this test card number (localstripe holds the card numbers
    /// of Stripe's test cards: 4000002760003184 requires authentication).
    pub async fn card(&self, number: &str) -> String {
        let created = self
            .post(
                "/v1/payment_methods",
                &[
                    ("type", "card"),
                    ("card[number]", number),
                    ("card[exp_month]", "12"),
                    ("card[exp_year]", "2030"),
                    ("card[cvc]", "123"),
                ],
            )
            .await;
        created["id"].as_str().expect("a payment method").to_owned()
    }

    /// A PaymentIntent as localstripe holds it.
    pub async fn intent(&self, id: &str) -> Value {
        self.get(&format!("/v1/payment_intents/{id}")).await.unwrap()
    }

    /// A PaymentIntent naming `top_up`, made behind oncepay's back with `payment_method`, and
    /// confirmed when `confirm` (its status then is what the card makes of it).
    pub async fn intent_naming(&self, top_up: &str, amount: i64, payment_method: &str, confirm: bool) -> Value {
        let amount = amount.to_string();
        let created = self
            .post(
                "/v1/payment_intents",
                &[
                    ("amount", &amount),
                    ("currency", "usd"),
                    ("payment_method", payment_method),
                    ("metadata[oncepay_top_up_id]", top_up),
                ],
            )
            .await;
        if !confirm {
            return created;
        }
        let id = created["id"].as_str().unwrap().to_owned();
        self.post(&format!("/v1/payment_intents/{id}/confirm"), &[]).await
    }

    /// Cancels a PaymentIntent as the Dashboard or another system of the merchant would.
    pub async fn cancel_behind_the_back(&self, intent: &str) -> Value {
        self.post(&format!("/v1/payment_intents/{intent}/cancel"), &[]).await
    }

    /// A PaymentIntent made and confirmed behind oncepay's back, naming `top_up`.
    pub async fn charge_behind_the_back(&self, top_up: &str, amount: i64) -> String {
        let confirmed = self.intent_naming(top_up, amount, "pm_card_visa", true).await;
        assert_eq!(confirmed["status"], "succeeded");
        confirmed["id"].as_str().unwrap().to_owned()
    }
}

impl Drop for Localstripe {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}
