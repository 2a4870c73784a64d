//! Stripe's rules that localstripe lacks, applied by the fault proxy in front of it
//! (`FaultProxy::start_stripe`), so that the top-up tests meet the processor Stripe documents
//! and not only its emulator. Each rule is Stripe's documented behaviour (docs/top-ups.md,
//! "What the tests emulate"); each has a test in `top_ups_stripe.rs` that fails on the code
//! before V23.
//!
//! Always on:
//! - **A saved 5xx**: a POST whose `Idempotency-Key` was first answered with a 5xx after
//!   Stripe began to execute it (`Action::ForwardThenStatus`, `Action::ServerError`) is
//!   answered the same to every later request with that key, with `Idempotent-Replayed:
//!   true`, without reaching localstripe (Stripe keeps it for at least 24 hours).
//! - **Automatic payment methods**: a PaymentIntent created without `payment_method_types` and
//!   without `automatic_payment_methods[allow_redirects]=never`, on an API version from
//!   2023-08-16 (or none pinned), cannot be confirmed without a `return_url`: 400.
//! - **Minimum amounts**: a PaymentIntent of less than 50 in `usd` is refused with
//!   `amount_too_small` (400).
//! - **Error objects carry a code**: localstripe answers an unknown payment method with a bare
//!   404 `Not Found`; Stripe with 400 `resource_missing` and `param: payment_method`.
//! - **`created[gte]`**: localstripe refuses the list filter; the proxy lists every
//!   PaymentIntent and answers the filtered page itself, newest first as Stripe does.
//! - **A declined confirmation names its PaymentIntent**: Stripe's 402 error object carries the
//!   `payment_intent`, back in `requires_payment_method` after the failed attempt; localstripe's
//!   carries none.
//!
//! On request (`StripeRules` fields):
//! - `refunds_pending_then`: a refund is answered `pending`, and looked at (retrieved, listed)
//!   `pending` the given number of times, then with the given end (`failed` with a
//!   `failure_reason`, or `succeeded`).
//! - `processing_looks`: a confirmed PaymentIntent is answered `processing`, and looked at
//!   `processing` that many times before what localstripe holds (it settles asynchronously).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use serde_json::{json, Value};

use crate::support::fault_proxy::{forward, Action, Request};

/// The API version from which a PaymentIntent takes automatic payment methods by default.
const AUTOMATIC_PAYMENT_METHODS_FROM: &str = "2023-08-16";

#[derive(Default)]
pub struct StripeRules {
    /// A refund's looks answered `pending` before its end (`"failed"` or `"succeeded"`).
    pub refunds_pending_then: Option<(usize, &'static str)>,
    /// Looks at a confirmed PaymentIntent answered `processing` before its real status.
    pub processing_looks: Option<usize>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The saved 5xx answers by key.
    saved: HashMap<String, Vec<u8>>,
    /// Keys already answered with anything else (Stripe saves a key's first answer only).
    answered: HashSet<String>,
    /// PaymentIntents whose confirmation needs a `return_url`.
    redirecting: HashSet<String>,
    /// Refunds held `pending`, with their looks so far.
    refunds: HashMap<String, usize>,
    /// PaymentIntents held `processing`, with their looks so far.
    processing: HashMap<String, usize>,
}

impl StripeRules {
    pub fn with_refunds_pending_then(looks: usize, end: &'static str) -> Self {
        Self {
            refunds_pending_then: Some((looks, end)),
            ..Self::default()
        }
    }

    pub fn with_processing_looks(looks: usize) -> Self {
        Self {
            processing_looks: Some(looks),
            ..Self::default()
        }
    }

    /// Stripe's own answer to a request, before any fault and without localstripe (the rule's
    /// name for the log, and the answer); `None`: the request goes on.
    pub async fn before(&self, request: &Request, upstream: &str) -> Option<(&'static str, Vec<u8>)> {
        let path = request.path.split('?').next().unwrap_or_default();
        if request.method == "POST" {
            if let Some(key) = &request.key {
                if let Some(saved) = self.state.lock().unwrap().saved.get(key) {
                    return Some(("saved_5xx_replayed", replayed(saved)));
                }
            }
            let form = form(&request.body);
            if path == "/v1/payment_intents" {
                let small = form.get("currency").map(String::as_str) == Some("usd")
                    && form
                        .get("amount")
                        .and_then(|a| a.parse::<i64>().ok())
                        .is_some_and(|a| a < 50);
                if small {
                    let error = json!({"error": {
                        "type": "invalid_request_error", "code": "amount_too_small", "param": "amount",
                        "message": "Amount must be at least $0.50 usd"}});
                    return Some(("amount_too_small", stripe_answer(400, &error)));
                }
            }
            if let Some(intent) = confirmed_intent(path) {
                let needs_return_url = self.state.lock().unwrap().redirecting.contains(intent)
                    && !form.contains_key("return_url")
                    && form.get("off_session").map(String::as_str) != Some("true");
                if needs_return_url {
                    let error = json!({"error": {
                        "type": "invalid_request_error", "param": "return_url",
                        "message": "A `return_url` must be specified because this Payment Intent is configured to \
                                    automatically accept the payment methods enabled in the Dashboard, some of which \
                                    may require a full page redirect to succeed. If you do not want to accept \
                                    redirect-based payment methods, set `automatic_payment_methods[enabled]` to `true` \
                                    and `automatic_payment_methods[allow_redirects]` to `never` when creating Setup \
                                    Intents and Payment Intents."}});
                    return Some(("return_url_required", stripe_answer(400, &error)));
                }
            }
        }
        let filtered = request.path.contains("created%5B") || request.path.contains("created[");
        if request.method == "GET" && path == "/v1/payment_intents" && filtered {
            return Some(("created_filter", list_created_since(request, upstream).await));
        }
        None
    }

    /// localstripe's answer as Stripe would have given it (its error objects, the scripted
    /// statuses of refunds and PaymentIntents).
    pub fn observe(&self, request: &Request, answer: Vec<u8>) -> Vec<u8> {
        let path = request.path.split('?').next().unwrap_or_default();
        let Some((status, mut body)) = split(&answer) else {
            return answer;
        };
        let mut state = self.state.lock().unwrap();
        match (request.method.as_str(), path) {
            ("POST", "/v1/payment_intents") if status == 404 && body["error"]["code"].is_null() => {
                let form = form(&request.body);
                let method = form.get("payment_method").cloned().unwrap_or_default();
                let error = json!({"error": {
                    "type": "invalid_request_error", "code": "resource_missing", "param": "payment_method",
                    "message": format!("No such PaymentMethod: '{method}'")}});
                return stripe_answer(400, &error);
            }
            ("POST", "/v1/payment_intents") if status == 200 => {
                let form = form(&request.body);
                let named = form.keys().any(|k| k.starts_with("payment_method_types"));
                let no_redirects = form
                    .get("automatic_payment_methods[allow_redirects]")
                    .map(String::as_str)
                    == Some("never");
                let version = request.header("stripe-version");
                let automatic = version.as_deref().is_none_or(|v| v >= AUTOMATIC_PAYMENT_METHODS_FROM);
                if !named && !no_redirects && automatic {
                    if let Some(id) = body["id"].as_str() {
                        state.redirecting.insert(id.to_owned());
                    }
                }
                return answer;
            }
            ("POST", p)
                if status == 402 && body["error"]["payment_intent"].is_null() && confirmed_intent(p).is_some() =>
            {
                let intent = confirmed_intent(p).unwrap_or_default();
                body["error"]["payment_intent"] =
                    json!({"id": intent, "object": "payment_intent", "status": "requires_payment_method"});
                return stripe_answer(402, &body);
            }
            ("POST", p) if p.ends_with("/confirm") && status == 200 && body["status"] == "succeeded" => {
                if self.processing_looks.is_some() {
                    if let Some(id) = body["id"].as_str() {
                        state.processing.insert(id.to_owned(), 0);
                    }
                    body["status"] = json!("processing");
                    return stripe_answer(200, &body);
                }
                return answer;
            }
            ("GET", p) if p.starts_with("/v1/payment_intents/") && status == 200 => {
                let id = body["id"].as_str().unwrap_or_default().to_owned();
                if let (Some(looks), Some(seen)) = (self.processing_looks, state.processing.get_mut(&id)) {
                    *seen += 1;
                    if *seen <= looks {
                        body["status"] = json!("processing");
                        return stripe_answer(200, &body);
                    }
                }
                return answer;
            }
            _ => {}
        }
        let Some((looks, end)) = self.refunds_pending_then else {
            return answer;
        };
        if status != 200 || !path.starts_with("/v1/refunds") {
            return answer;
        }
        let mut held = |refund: &mut Value, created: bool| {
            let Some(id) = refund["id"].as_str().map(str::to_owned) else {
                return;
            };
            if created {
                state.refunds.insert(id.clone(), 0);
            }
            let Some(seen) = state.refunds.get_mut(&id) else {
                return;
            };
            if !created {
                *seen += 1;
            }
            if created || *seen <= looks {
                refund["status"] = json!("pending");
            } else {
                refund["status"] = json!(end);
                if end == "failed" {
                    refund["failure_reason"] = json!("expired_or_canceled_card");
                }
            }
        };
        match request.method.as_str() {
            "POST" if path == "/v1/refunds" => held(&mut body, true),
            "GET" if path == "/v1/refunds" => {
                if let Some(refunds) = body["data"].as_array_mut() {
                    refunds.iter_mut().for_each(|r| held(r, false));
                }
            }
            "GET" => held(&mut body, false),
            _ => return answer,
        }
        stripe_answer(200, &body)
    }

    /// The answer the client got: a 5xx after Stripe began to act is saved under its key.
    pub fn settle(&self, request: &Request, action: &Action, status: Option<u16>, answer: &[u8]) {
        let Some(key) = &request.key else {
            return;
        };
        if request.method != "POST" {
            return;
        }
        let mut state = self.state.lock().unwrap();
        let began = matches!(action, Action::ForwardThenStatus(_) | Action::ServerError);
        if began && status.is_some_and(|s| s >= 500) && !state.answered.contains(key) {
            state.saved.insert(key.clone(), answer.to_vec());
        } else if status.is_some() {
            state.answered.insert(key.clone());
        }
    }
}

/// The PaymentIntent a `POST /v1/payment_intents/{id}/confirm` confirms.
fn confirmed_intent(path: &str) -> Option<&str> {
    path.strip_prefix("/v1/payment_intents/")
        .and_then(|p| p.strip_suffix("/confirm"))
}

/// The request's form (a POST's body).
fn form(body: &[u8]) -> HashMap<String, String> {
    let query = String::from_utf8_lossy(body);
    reqwest::Url::parse(&format!("http://form/?{query}"))
        .map(|u| u.query_pairs().into_owned().collect())
        .unwrap_or_default()
}

/// A JSON answer as Stripe's (`Request-Id` aside), closing the connection.
pub fn stripe_answer(status: u16, body: &Value) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "HTTP/1.1 {status} Stripe\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A saved answer, marked as replayed.
fn replayed(saved: &[u8]) -> Vec<u8> {
    let Some(end) = saved.windows(2).position(|w| w == b"\r\n") else {
        return saved.to_vec();
    };
    let mut out = saved[..end + 2].to_vec();
    out.extend_from_slice(b"Idempotent-Replayed: true\r\n");
    out.extend_from_slice(&saved[end + 2..]);
    out
}

/// An answer's status and JSON body.
fn split(answer: &[u8]) -> Option<(u16, Value)> {
    let end = answer.windows(4).position(|w| w == b"\r\n\r\n")?;
    let status = std::str::from_utf8(&answer[..end])
        .ok()?
        .split(' ')
        .nth(1)?
        .parse()
        .ok()?;
    let body = serde_json::from_slice(&answer[end + 4..]).ok()?;
    Some((status, body))
}

/// `GET /v1/payment_intents?created[gte]=…`: every PaymentIntent localstripe holds, those
/// created since, newest first, paged by `limit` and `starting_after`.
async fn list_created_since(request: &Request, upstream: &str) -> Vec<u8> {
    let query: HashMap<String, String> = reqwest::Url::parse(&format!("http://list{}", request.path))
        .map(|u| u.query_pairs().into_owned().collect())
        .unwrap_or_default();
    let since: i64 = query.get("created[gte]").and_then(|v| v.parse().ok()).unwrap_or(0);
    let limit: usize = query.get("limit").and_then(|v| v.parse().ok()).unwrap_or(10);
    let mut all: Vec<Value> = Vec::new();
    for _ in 0..1_000 {
        let mut path = "/v1/payment_intents?limit=100".to_owned();
        if let Some(last) = all.last().and_then(|i| i["id"].as_str()) {
            path.push_str(&format!("&starting_after={last}"));
        }
        let page = Request {
            method: "GET".to_owned(),
            path,
            key: None,
            headers: request.headers.clone(),
            body: Vec::new(),
        };
        let Some((200, body)) = forward(upstream, &page).await.ok().as_deref().and_then(split) else {
            return stripe_answer(
                502,
                &json!({"error": {"type": "api_error", "message": "the list failed"}}),
            );
        };
        let data = body["data"].as_array().cloned().unwrap_or_default();
        let more = body["has_more"].as_bool().unwrap_or(false) && !data.is_empty();
        all.extend(data);
        if !more {
            break;
        }
    }
    // localstripe lists oldest first; Stripe newest first.
    let mut since_then: Vec<Value> = all
        .into_iter()
        .filter(|i| i["created"].as_i64().unwrap_or(0) >= since)
        .collect();
    since_then.reverse();
    let start = match query.get("starting_after") {
        Some(after) => since_then
            .iter()
            .position(|i| i["id"] == after.as_str())
            .map_or(since_then.len(), |p| p + 1),
        None => 0,
    };
    let page: Vec<Value> = since_then.iter().skip(start).take(limit).cloned().collect();
    let has_more = since_then.len() > start + page.len();
    stripe_answer(
        200,
        &json!({"object": "list", "url": "/v1/payment_intents", "has_more": has_more, "data": page}),
    )
}
