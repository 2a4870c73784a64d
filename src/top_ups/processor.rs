//! The card processor's client: the few calls of Stripe's API a top-up needs, over reqwest
//! (rustls). Every call pins [`STRIPE_VERSION`]. Every POST carries an `Idempotency-Key`
//! derived from oncepay's own operation (the top-up's id, the call, and the call's number in
//! its series: [`KeyedCall::key`]), never the client's key; nothing here relies on the
//! processor honouring it (localstripe does not).
//!
//! Each call's result is either the processor's object, a refusal the processor answered
//! (a 4xx with its error object: it decided, nothing happened, or the decline happened),
//! `Replayed`: a 5xx the processor answered again under the call's key (`Idempotent-Replayed:
//! true`; Stripe keeps a key's first answer, 500s included, for at least a day, so that key
//! will answer nothing else), or `Unknown`: a timeout, a connection that failed or broke, a
//! 5xx, an answer that could not be read. After `Unknown` or `Replayed` the call may or may
//! not have taken effect; only a look (GET) tells.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use prometheus::{HistogramVec, IntCounterVec};
use serde::Deserialize;

use crate::config::Processor;

/// The API version every call pins (`Stripe-Version`), so that the account's default version,
/// and every change Stripe makes to it, changes nothing here. From 2023-08-16 a PaymentIntent
/// created without `payment_method_types` takes the Dashboard's payment methods, some of
/// which redirect, and its confirmation then needs a `return_url`: oncepay names `card`.
pub const STRIPE_VERSION: &str = "2024-06-20";

/// Pages of 100 a search of a top-up's PaymentIntents reads at most (10,000 PaymentIntents
/// created since the top-up).
const MAX_SEARCH_PAGES: usize = 100;

/// The calls, as labelled in the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    CreateIntent,
    ConfirmIntent,
    CancelIntent,
    RetrieveIntent,
    ListIntents,
    CreateRefund,
    RetrieveRefund,
    ListRefunds,
}

impl Call {
    pub const fn label(self) -> &'static str {
        match self {
            Self::CreateIntent => "create_intent",
            Self::ConfirmIntent => "confirm_intent",
            Self::CancelIntent => "cancel_intent",
            Self::RetrieveIntent => "retrieve_intent",
            Self::ListIntents => "list_intents",
            Self::CreateRefund => "create_refund",
            Self::RetrieveRefund => "retrieve_refund",
            Self::ListRefunds => "list_refunds",
        }
    }
}

/// A call that changes something at the processor, with its own series of keys (the series'
/// number is in the top-up's row: migrations/V23).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyedCall {
    Create,
    Confirm,
    Cancel,
    Refund,
}

impl KeyedCall {
    /// Its name in the SQL (`oncepay_top_up_next_key`).
    pub const fn series_name(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Confirm => "confirm",
            Self::Cancel => "cancel",
            Self::Refund => "refund",
        }
    }

    /// The `Idempotency-Key` of the call's `series`-th key: the first (0) is the key of
    /// before the series existed (`oncepay-top-up-<id>-create-intent`), so that a top-up
    /// begun by the previous version continues under its key.
    pub fn key(self, top_up_id: &str, series: i32) -> String {
        let call = match self {
            Self::Create => "create-intent",
            Self::Confirm => "confirm",
            Self::Cancel => "cancel",
            Self::Refund => "refund",
        };
        match series {
            0 => format!("oncepay-top-up-{top_up_id}-{call}"),
            n => format!("oncepay-top-up-{top_up_id}-{call}-{n}"),
        }
    }
}

/// `oncepay_processor_calls_total{call,outcome}` and
/// `oncepay_processor_call_duration_seconds{call}` (registered by `crate::metrics`).
#[derive(Clone)]
pub struct CallCounters {
    pub calls: IntCounterVec,
    pub duration: HistogramVec,
}

/// Metadata key naming the top-up on its PaymentIntent.
pub const METADATA_TOP_UP: &str = "oncepay_top_up_id";

/// A PaymentIntent, as far as oncepay reads it.
#[derive(Clone, Debug, Deserialize)]
pub struct Intent {
    pub id: String,
    pub status: String,
    pub amount: i64,
    #[serde(default)]
    pub currency: String,
    #[serde(default)]
    pub metadata: HashMap<String, String>,
    #[serde(default)]
    pub last_payment_error: Option<ErrorObject>,
    /// Unix seconds.
    #[serde(default)]
    pub created: i64,
    #[serde(default)]
    pub cancellation_reason: Option<String>,
}

impl Intent {
    /// The top-up this PaymentIntent was created for, if oncepay created it.
    pub fn top_up_id(&self) -> Option<&str> {
        self.metadata.get(METADATA_TOP_UP).map(String::as_str)
    }
}

/// A refund: `pending`, `requires_action`, `succeeded`, `failed` or `canceled`.
#[derive(Clone, Debug, Deserialize)]
pub struct RefundObject {
    pub id: String,
    pub status: String,
    /// Why a failed refund failed (`lost_or_stolen_card`, `expired_or_canceled_card`, ...).
    #[serde(default)]
    pub failure_reason: Option<String>,
}

/// Stripe's `error` object.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ErrorObject {
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub code: Option<String>,
    #[serde(default)]
    pub decline_code: Option<String>,
    /// The parameter the error is about (`payment_method`, `amount`).
    #[serde(default)]
    pub param: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
    /// The PaymentIntent the refused call was about, as Stripe holds it after the refusal
    /// (Stripe sends it with errors of calls on a PaymentIntent: a declined confirmation's is
    /// back in `requires_payment_method`).
    #[serde(default)]
    pub payment_intent: Option<ErrorIntent>,
}

/// The part of an error's `payment_intent` that oncepay reads.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ErrorIntent {
    #[serde(default)]
    pub status: Option<String>,
}

#[derive(Deserialize)]
struct ErrorEnvelope {
    error: ErrorObject,
}

#[derive(Deserialize)]
struct ListOf<T> {
    data: Vec<T>,
    #[serde(default)]
    has_more: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The processor answered with a client error: it decided (a decline, an invalid
    /// payment method, a state that does not allow the call).
    #[error("the processor refused the call with {status}: {error:?}")]
    Refused { status: u16, error: ErrorObject },
    /// A 5xx answered again under the call's key (`Idempotent-Replayed: true`): every retry
    /// with that key answers the same; the call's effect is unknown until a look.
    #[error("the processor answered {status} again under the call's Idempotency-Key (a saved answer)")]
    Replayed { status: u16 },
    /// The call's effect is unknown: it may or may not have happened.
    #[error("the processor's outcome is unknown: {0}")]
    Unknown(String),
}

/// The processor client of one process.
#[derive(Clone)]
pub struct ProcessorClient {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
    counters: CallCounters,
}

impl std::fmt::Debug for ProcessorClient {
    /// The processor's URL; never its key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessorClient")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl ProcessorClient {
    pub fn new(settings: &Processor, counters: CallCounters) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(settings.timeout)
            .connect_timeout(settings.timeout.min(Duration::from_secs(5)))
            .pool_idle_timeout(Duration::from_secs(30))
            .build()?;
        Ok(Self {
            http,
            base: settings.url.clone(),
            api_key: settings.api_key.clone(),
            counters,
        })
    }

    /// The processor's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Creates a PaymentIntent, unconfirmed: it charges nothing until it is confirmed. Cards
    /// only, so that its confirmation never needs a redirect (nor a `return_url`).
    pub async fn create_intent(
        &self,
        top_up_id: &str,
        amount: i64,
        currency: &str,
        payment_method: &str,
        series: i32,
    ) -> Result<Intent, CallError> {
        let amount = amount.to_string();
        let form = [
            ("amount", amount.as_str()),
            ("currency", currency),
            ("payment_method", payment_method),
            ("payment_method_types[]", "card"),
            ("metadata[oncepay_top_up_id]", top_up_id),
        ];
        let key = KeyedCall::Create.key(top_up_id, series);
        self.post(Call::CreateIntent, "/v1/payment_intents", &form, &key).await
    }

    /// Confirms (charges) a PaymentIntent.
    pub async fn confirm_intent(&self, top_up_id: &str, intent: &str, series: i32) -> Result<Intent, CallError> {
        let key = KeyedCall::Confirm.key(top_up_id, series);
        self.post(
            Call::ConfirmIntent,
            &format!("/v1/payment_intents/{intent}/confirm"),
            &[],
            &key,
        )
        .await
    }

    /// Cancels a PaymentIntent that waits for an action (an authorisation held for capture
    /// is released).
    pub async fn cancel_intent(&self, top_up_id: &str, intent: &str, series: i32) -> Result<Intent, CallError> {
        let key = KeyedCall::Cancel.key(top_up_id, series);
        self.post(
            Call::CancelIntent,
            &format!("/v1/payment_intents/{intent}/cancel"),
            &[],
            &key,
        )
        .await
    }

    pub async fn retrieve_intent(&self, intent: &str) -> Result<Intent, CallError> {
        self.get(Call::RetrieveIntent, &format!("/v1/payment_intents/{intent}"), &[])
            .await
    }

    /// The PaymentIntents carrying `metadata[oncepay_top_up_id] = top_up_id`, among those
    /// created since `since` (Unix seconds): the list, filtered here. Stripe's search API would
    /// filter on the metadata, but it is eventually consistent: a PaymentIntent created a
    /// moment ago may be missing from it. `None`: more were created since than a search reads.
    pub async fn intents_of(&self, top_up_id: &str, since: i64) -> Result<Option<Vec<Intent>>, CallError> {
        let mut found = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..MAX_SEARCH_PAGES {
            let mut query = vec![("created[gte]", since.to_string()), ("limit", "100".to_owned())];
            if let Some(last) = &after {
                query.push(("starting_after", last.clone()));
            }
            let page: ListOf<Intent> = self.get(Call::ListIntents, "/v1/payment_intents", &query).await?;
            let done = !page.has_more || page.data.is_empty();
            after = page.data.last().map(|i| i.id.clone());
            found.extend(page.data.into_iter().filter(|i| i.top_up_id() == Some(top_up_id)));
            if done {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    /// Every PaymentIntent the processor holds (pages of 100), for the audit.
    pub async fn list_intents(&self) -> Result<Vec<Intent>, CallError> {
        let mut all: Vec<Intent> = Vec::new();
        for _ in 0..10_000 {
            let mut query = vec![("limit", "100".to_owned())];
            if let Some(last) = all.last() {
                query.push(("starting_after", last.id.clone()));
            }
            let page: ListOf<Intent> = self.get(Call::ListIntents, "/v1/payment_intents", &query).await?;
            let done = !page.has_more || page.data.is_empty();
            all.extend(page.data);
            if done {
                return Ok(all);
            }
        }
        Err(CallError::Unknown("more than a million PaymentIntents".to_owned()))
    }

    /// Refunds a PaymentIntent's charge, whole.
    pub async fn create_refund(&self, top_up_id: &str, intent: &str, series: i32) -> Result<RefundObject, CallError> {
        let form = [("payment_intent", intent), ("metadata[oncepay_top_up_id]", top_up_id)];
        let key = KeyedCall::Refund.key(top_up_id, series);
        self.post(Call::CreateRefund, "/v1/refunds", &form, &key).await
    }

    pub async fn retrieve_refund(&self, refund: &str) -> Result<RefundObject, CallError> {
        self.get(Call::RetrieveRefund, &format!("/v1/refunds/{refund}"), &[])
            .await
    }

    /// The refunds of a PaymentIntent.
    pub async fn list_refunds(&self, intent: &str) -> Result<Vec<RefundObject>, CallError> {
        let query = [("payment_intent", intent.to_owned()), ("limit", "100".to_owned())];
        let page: ListOf<RefundObject> = self.get(Call::ListRefunds, "/v1/refunds", &query).await?;
        Ok(page.data)
    }

    async fn post<T: for<'de> Deserialize<'de>>(
        &self,
        call: Call,
        path: &str,
        form: &[(&str, &str)],
        idempotency_key: &str,
    ) -> Result<T, CallError> {
        let request = self
            .authorized(self.http.post(format!("{}{path}", self.base)))
            .header("Idempotency-Key", idempotency_key)
            .form(form);
        self.send(call, request).await
    }

    async fn get<T: for<'de> Deserialize<'de>>(
        &self,
        call: Call,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T, CallError> {
        let request = self
            .authorized(self.http.get(format!("{}{path}", self.base)))
            .query(query);
        self.send(call, request).await
    }

    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let request = request.header("Stripe-Version", STRIPE_VERSION);
        match &self.api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    }

    async fn send<T: for<'de> Deserialize<'de>>(
        &self,
        call: Call,
        request: reqwest::RequestBuilder,
    ) -> Result<T, CallError> {
        let started = Instant::now();
        let result = Self::exchange(request).await;
        let outcome = match &result {
            Ok(_) => "ok",
            Err(CallError::Refused { status: 402, .. }) => "declined",
            Err(CallError::Refused { .. }) => "refused",
            Err(CallError::Replayed { .. }) => "replayed",
            Err(CallError::Unknown(_)) => "unknown",
        };
        self.counters.calls.with_label_values(&[call.label(), outcome]).inc();
        self.counters
            .duration
            .with_label_values(&[call.label()])
            .observe(started.elapsed().as_secs_f64());
        if let Err(err) = &result {
            tracing::warn!(call = call.label(), error = %err, "processor call failed");
        }
        result
    }

    async fn exchange<T: for<'de> Deserialize<'de>>(request: reqwest::RequestBuilder) -> Result<T, CallError> {
        let response = request.send().await.map_err(|e| CallError::Unknown(chain(&e)))?;
        let status = response.status();
        let replayed = response
            .headers()
            .get("Idempotent-Replayed")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        let body = response.bytes().await.map_err(|e| CallError::Unknown(chain(&e)))?;
        if status.is_success() {
            return serde_json::from_slice(&body)
                .map_err(|e| CallError::Unknown(format!("an answer of {status} that could not be read: {e}")));
        }
        // oncepay's own credentials refused (a revoked or mistyped ONCEPAY_PROCESSOR_API_KEY,
        // a restricted key): the request was not looked at, and it is the operator's to mend,
        // not the merchant's failure to store (found from outside: every top-up of such an
        // hour was stored as the merchant's 400 for good). Left unknown, it is sent again
        // under its key once mended; the completer's looks keep trying meanwhile.
        if matches!(status.as_u16(), 401 | 403) {
            return Err(CallError::Unknown(format!(
                "the processor refused oncepay's credentials ({status}): check ONCEPAY_PROCESSOR_API_KEY; nothing was done"
            )));
        }
        // 409 (an idempotency conflict, a lock) and 429 decided nothing; 5xx may have.
        if status.is_client_error() && status.as_u16() != 409 && status.as_u16() != 429 {
            let error = serde_json::from_slice::<ErrorEnvelope>(&body)
                .map(|e| e.error)
                .unwrap_or_default();
            return Err(CallError::Refused {
                status: status.as_u16(),
                error,
            });
        }
        if status.is_server_error() && replayed {
            return Err(CallError::Replayed {
                status: status.as_u16(),
            });
        }
        Err(CallError::Unknown(format!("the processor answered {status}")))
    }
}

/// An error with its causes (reqwest's own message names only the URL).
fn chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
