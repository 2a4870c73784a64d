//! `oncepay-client`: a client of the oncepay tenant API that retries safely. It depends on
//! no server crate (no actix-web, sqlx or refinery). The rules it shares with the server are
//! the crate `oncepay-protocol`, re-exported here as [`protocol`].
//!
//! - **One key per logical operation.** Every POST takes an [`IdempotencyKey`]; each
//!   retry of the call sends that same key, so the server processes the operation at most
//!   once and answers the retry of a processed request with the stored answer
//!   ([`Reply::replayed`]). A new operation takes a new key ([`IdempotencyKey::generate`]);
//!   to resume an operation whose outcome is unknown ([`ClientError::outcome_unknown`]),
//!   call again with the same key.
//! - **The retry table** is in [`policy`]: transport failures, 500/502/503/504, any 5xx
//!   oncepay did not answer itself (a gateway's 524), 429 and 409 `request_in_progress` are
//!   retried; every other error is returned at once. Once an attempt's outcome is unknown,
//!   only oncepay's own answer ends the operation as anything but unknown.
//! - **Waits**: exponential backoff with full jitter, never shorter than the server's
//!   `Retry-After`; at most `max_attempts` attempts within an overall `deadline`
//!   ([`ClientConfig`]).
//! - **The retry budget** ([`BudgetConfig`]): a token bucket shared by every operation of the
//!   client (and of its clones) that caps the rate of retries, so a brownout of the server
//!   does not turn into a retry storm.

mod budget;
mod calls;
/// The client commands of the `oncepay` binary (feature `cli`).
#[cfg(feature = "cli")]
pub mod cli;
mod config;
mod error;
mod key;
mod keys;
mod lists;
pub mod policy;
mod recovery;
mod retry;
mod time;
mod tls;
mod top_ups;
mod transfers;
pub mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use reqwest::header::HeaderValue;
use reqwest::Url;

pub use calls::{Account, AccountCreated, Deposit, Payment, PaymentState, Refund};
pub use config::{Backoff, BudgetConfig, ClientConfig};
pub use error::{ClientError, Problem};
pub use key::IdempotencyKey;
pub use keys::{KeyInfo, KeyResource};
pub use lists::{
    Attempt, AttemptListParams, EventListParams, List, ListParams, ListRequest, Listed, Lists, PaymentListParams,
    TopUpListParams, TransferListParams,
};
pub use recovery::{Recovery, Resent};
pub use top_ups::{TopUp, TopUpRefund, TopUpState};
pub use transfers::{Transfer, TransferState};

use budget::RetryBudget;

/// The rules shared with the server (key syntax, header names, problem codes): the crate
/// `oncepay-protocol`, under the name client code has always used.
pub use oncepay_protocol as protocol;

/// A successful answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply<T> {
    pub value: T,
    pub status: u16,
    /// The server had already processed this key: this is the stored answer of the first
    /// request (`Idempotency-Replayed: true`), not a second effect.
    pub replayed: bool,
    /// Attempts sent for this operation, this one included.
    pub attempts: u32,
}

/// What an observer hears before each retry (the CLI prints it).
#[derive(Debug)]
pub struct RetryNote<'a> {
    /// The attempt that failed (1-based).
    pub attempt: u32,
    pub error: &'a ClientError,
    /// The backoff before the next attempt (a wait for a budget token may follow).
    pub wait: Duration,
    pub key: Option<&'a IdempotencyKey>,
}

type Observer = Box<dyn Fn(&RetryNote<'_>) + Send + Sync>;

/// The client: cheap to clone; clones share connections and the retry budget.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    base: Url,
    authorization: HeaderValue,
    config: ClientConfig,
    budget: RetryBudget,
    observer: Option<Observer>,
}

/// The environment variable naming a PEM file of extra trusted roots for `https://` URLs.
pub const CA_CERT_ENV: &str = "ONCEPAY_CA_CERT";

impl Client {
    /// A client of the server at `base_url` (for example `http://127.0.0.1:8130` or
    /// `https://pay.example.com`).
    pub fn builder(base_url: &str, api_key: &str) -> ClientBuilder {
        ClientBuilder {
            base_url: base_url.to_owned(),
            api_key: api_key.to_owned(),
            config: ClientConfig::default(),
            observer: None,
            extra_roots: Vec::new(),
        }
    }
}

pub struct ClientBuilder {
    base_url: String,
    api_key: String,
    config: ClientConfig,
    observer: Option<Observer>,
    /// PEM bundles of roots trusted on top of the system's.
    extra_roots: Vec<Vec<u8>>,
}

impl ClientBuilder {
    pub fn config(mut self, config: ClientConfig) -> Self {
        self.config = config;
        self
    }

    /// Calls `observer` before every retry, for logs or metrics.
    pub fn on_retry(mut self, observer: impl Fn(&RetryNote<'_>) + Send + Sync + 'static) -> Self {
        self.observer = Some(Box::new(observer));
        self
    }

    /// Trusts the certificates of this PEM bundle as roots, on top of the system's and those
    /// of the file named by `ONCEPAY_CA_CERT` (read by [`ClientBuilder::build`]).
    pub fn add_root_certificates_pem(mut self, pem: &[u8]) -> Self {
        self.extra_roots.push(pem.to_vec());
        self
    }

    pub fn build(self) -> Result<Client, ClientError> {
        let invalid = |what: String| ClientError::InvalidArgument(what);
        let base = Url::parse(&self.base_url).map_err(|e| invalid(format!("invalid URL {:?}: {e}", self.base_url)))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(invalid(format!(
                "the URL must be http(s)://host[:port][/prefix], got {:?}",
                self.base_url
            )));
        }
        let mut authorization = HeaderValue::from_str(&format!("Bearer {}", self.api_key))
            .map_err(|_| invalid("the API key contains characters a header cannot carry".to_owned()))?;
        authorization.set_sensitive(true);
        if self.config.max_attempts == 0 || self.config.attempt_timeout.is_zero() || self.config.deadline.is_zero() {
            return Err(invalid(
                "max_attempts, the attempt timeout and the deadline must be positive".to_owned(),
            ));
        }
        let mut http = reqwest::Client::builder()
            .connect_timeout(self.config.connect_timeout)
            // A redirected POST would become a GET: the API has no redirects.
            .redirect(reqwest::redirect::Policy::none())
            .min_tls_version(reqwest::tls::Version::TLS_1_2);
        for root in tls::extra_roots(self.extra_roots)? {
            http = http.add_root_certificate(root);
        }
        let http = http
            .build()
            .map_err(|e| invalid(format!("cannot build the HTTP client: {e}")))?;
        Ok(Client {
            inner: Arc::new(Inner {
                http,
                base,
                authorization,
                budget: RetryBudget::new(self.config.budget),
                config: self.config,
                observer: self.observer,
            }),
        })
    }
}
