//! Random requests against a real server (proptest strategies, a fixed seed and a bounded
//! number of cases so the suite stays fast): none gets a 5xx, and a malformed one (400,
//! 413, 415) changes nothing: no payment, no key row, no balance moved.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use reqwest::header::HeaderValue;
use serde_json::{json, Value};

use crate::support::helpers::{spawn_app, tenant_post_paths, Answer, TestApp};

const CASES: usize = 300;

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (-5i64..2_000).prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "[a-z0-9_.:-]{0,70}".prop_map(Value::String),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("amount|account|id|balance|[a-z]{1,4}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Bodies: mostly near-valid payments, deposits and transfers, some arbitrary JSON, some
/// arbitrary bytes.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let amount = prop_oneof![4 => (1i64..2_000).prop_map(|n| json!(n)), 1 => json_value()];
    let account = prop_oneof![
        3 => Just(None),
        2 => Just(Some(json!("main"))),
        1 => json_value().prop_map(Some),
    ];
    let extra = prop_oneof![4 => Just(None), 1 => json_value().prop_map(Some)];
    let transfer = prop_oneof![4 => (1i64..2_000).prop_map(|n| json!(n)), 1 => json_value()]
        .prop_map(|amount| serde_json::to_vec(&json!({ "from": "main", "to": "side", "amount": amount })).unwrap());
    prop_oneof![
        2 => transfer,
        5 => (amount, account, extra).prop_map(|(amount, account, extra)| {
            let mut body = json!({ "amount": amount });
            if let Some(account) = account {
                body["account"] = account;
            }
            if let Some(extra) = extra {
                body["extra"] = extra;
            }
            serde_json::to_vec(&body).unwrap()
        }),
        2 => json_value().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ]
}

/// Keys: absent, well-formed, or any bytes a header can carry.
fn key() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        1 => Just(None),
        4 => "[!-~]{1,40}".prop_map(|k| Some(k.into_bytes())),
        1 => "[!-~]{250,260}".prop_map(|k| Some(k.into_bytes())),
        1 => prop::collection::vec(any::<u8>(), 0..40).prop_map(Some),
    ]
}

/// Every documented tenant POST, its path parameter an existing account or a random id.
fn path() -> impl Strategy<Value = String> {
    prop::sample::select(tenant_post_paths())
}

fn content_type() -> impl Strategy<Value = Option<&'static str>> {
    prop::sample::select(vec![
        Some("application/json"),
        Some("application/json"),
        Some("application/json"),
        Some("application/merge-patch+json"),
        Some("text/plain"),
        None,
    ])
}

async fn state(app: &TestApp) -> (i64, i64, i64) {
    (
        app.payment_count().await,
        app.key_count().await,
        app.balance("main").await,
    )
}

#[tokio::test]
async fn random_requests_never_get_a_5xx_and_malformed_ones_change_nothing() {
    let app = spawn_app().await;
    app.open_account("side", 0).await;
    let strategy = (path(), body(), key(), content_type());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let mut statuses = std::collections::BTreeMap::new();

    for _ in 0..CASES {
        let (path, body, key, content_type) = strategy.new_tree(&mut runner).unwrap().current();
        let mut request = app
            .client
            .post(app.url(&path))
            .bearer_auth(&app.api_key)
            .body(body.clone());
        if let Some(key) = key.as_deref().and_then(|k| HeaderValue::from_bytes(k).ok()) {
            request = request.header("Idempotency-Key", key);
        }
        if let Some(content_type) = content_type {
            request = request.header("Content-Type", content_type);
        }
        let before = state(&app).await;

        let answer = Answer::from(request.send().await.unwrap()).await;

        let case = format!("POST {path} {:?} key {key:?}", String::from_utf8_lossy(&body));
        assert!(answer.status < 500, "{case}: {} {}", answer.status, answer.body);
        if matches!(answer.status, 400 | 413 | 415) {
            assert_eq!(
                answer.header("content-type"),
                Some("application/problem+json"),
                "{case}"
            );
            assert_eq!(
                state(&app).await,
                before,
                "{case}: a malformed request changed something"
            );
        }
        *statuses.entry(answer.status).or_insert(0) += 1;
    }
    assert!(
        statuses.get(&201).is_some_and(|n| *n >= 5),
        "some requests succeed: {statuses:?}"
    );
    assert!(
        statuses.get(&400).is_some_and(|n| *n > CASES / 4),
        "most are malformed: {statuses:?}"
    );
}
