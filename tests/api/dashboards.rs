//! Issue 12, part 3: the alerting and recording rules (`ops/prometheus/rules.yml`) and the
//! Grafana dashboard (`ops/grafana/oncepay.json`) read only series that the real server
//! exports, with labels and label values it really sets. A renamed metric, label or outcome
//! fails here instead of silently never paging.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::json;
use sqlx::{Connection, PgConnection};

use crate::concurrency::lock_accounts_at;
use crate::support::helpers::{database_url, direct_url, new_key, spawn_app_with, Answer, TestApp};
use crate::support::promql::{dashboard_queries, recorded_names, rule_exprs, selectors, SCRAPE_SERIES};

const RULES: &str = include_str!("../../ops/prometheus/rules.yml");
const DASHBOARD: &str = include_str!("../../ops/grafana/oncepay.json");

/// Labels that Prometheus attaches to every scraped series.
const TARGET_LABELS: &[&str] = &["job", "instance"];

#[tokio::test]
async fn every_series_the_rules_and_the_dashboard_read_is_exported() {
    // A card processor (localstripe; refunds pending for two looks) for the top-ups' outcomes.
    let crate::top_ups::Rig {
        stripe,
        proxy: _proxy,
        app,
    } = crate::top_ups::rig_with(
        crate::stripe_rules::StripeRules::with_refunds_pending_then(2, "succeeded"),
        |_: &crate::support::fault_proxy::Incoming| crate::support::fault_proxy::Action::Forward,
        |s| {
            s.inflight_wait = Duration::from_millis(300);
            s.db_pool_size = 2;
            // Two statements out at once, whatever the machine: the adaptive limit, lowered by a
            // loaded host's slow statements, would keep the second payment below from reaching
            // the database while the first one waits on its lock.
            s.db_batches_in_flight = Some(2);
            s.db_acquire_timeout = Duration::from_millis(300);
        },
    )
    .await;
    requests_of_every_kind(&app).await;
    top_ups_not_finished(&app, &stripe).await;

    let exported = Exposition::parse(&app.metrics().await);

    let recorded = recorded_names(RULES);
    let mut queries: Vec<String> = rule_exprs(RULES);
    let rule_queries = queries.len();
    dashboard_queries(
        &serde_json::from_str(DASHBOARD).expect("the dashboard is JSON"),
        &mut queries,
    );
    assert!(
        rule_queries >= 10,
        "the rules file was read: {rule_queries} expressions"
    );
    assert!(queries.len() > rule_queries + 15, "the dashboard was read");

    let problems: Vec<String> = queries
        .iter()
        .flat_map(|query| exported.problems(query, &recorded))
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The check above is not vacuous: a renamed metric, label or outcome is reported.
#[test]
fn a_renamed_metric_label_or_value_is_reported() {
    let exported = Exposition::parse(
        "# TYPE oncepay_requests_total counter\n\
         oncepay_requests_total{outcome=\"replayed\",route=\"/payments\"} 3\n\
         oncepay_request_duration_seconds_bucket{route=\"/payments\",le=\"0.5\"} 1\n",
    );
    let recorded = BTreeSet::from(["job:oncepay_replay_ratio:rate5m".to_owned()]);
    let fine = r#"sum(rate(oncepay_requests_total{job=~"$job",outcome=~"replayed"}[5m]))
        / on (job) job:oncepay_replay_ratio:rate5m
        + histogram_quantile(0.99, sum by (le) (rate(oncepay_request_duration_seconds_bucket[5m]))) + up"#;
    assert_eq!(exported.problems(fine, &recorded), Vec::<String>::new());

    for broken in [
        "rate(oncepay_request_total[5m])",
        "oncepay_request_duration_seconds",
        r#"oncepay_requests_total{outcom="replayed"}"#,
        r#"oncepay_requests_total{outcome="replay"}"#,
        r#"oncepay_requests_total{outcome=~"created|replayed"}"#,
        "job:oncepay_replays:rate5m",
        r#"job:oncepay_replay_ratio:rate5m{outcome="replay"}"#,
    ] {
        assert_eq!(exported.problems(broken, &recorded).len(), 1, "{broken}");
    }
}

/// The gauges the purge and readiness alerts read: the oldest key row's age against the
/// retention, and whether the database answered the scrape.
#[tokio::test]
async fn the_oldest_key_age_the_retention_and_readiness_are_exported() {
    let app = spawn_app_with(|s| s.retention = Duration::from_secs(3 * 86_400)).await;
    assert_eq!(app.pay(Some(&new_key()), 1).await.status, 201);
    // The key row as if written eight days ago (and never purged).
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = created_at - interval '8 days', \
         expires_at = expires_at - interval '8 days' WHERE tenant_id = $1",
    )
    .bind(app.tenant_id)
    .execute(&app.pool)
    .await
    .unwrap();

    let text = app.metrics().await;

    assert_eq!(sample(&text, "oncepay_idempotency_key_retention_seconds"), 259_200.0);
    let age = sample(&text, "oncepay_idempotency_key_oldest_age_seconds");
    assert!(age >= 8.0 * 86_400.0, "oldest key row is {age} s old");
    assert_eq!(sample(&text, "oncepay_ready"), 1.0);
}

#[tokio::test]
async fn readiness_is_0_when_the_database_does_not_answer() {
    let mut settings = crate::support::helpers::test_settings();
    // Nothing listens on port 1.
    settings.database_url = "postgres://oncepay@127.0.0.1:1/oncepay".to_owned();
    settings.db_acquire_timeout = Duration::from_millis(300);
    let db = oncepay::db::Db::new(&settings).unwrap();
    let lists = oncepay::db::Db::for_lists(&settings, &db).unwrap();
    let metrics = oncepay::metrics::Metrics::new();

    let text = metrics.render(&db, lists.status(), settings.retention, true).await;

    assert_eq!(sample(&text, "oncepay_ready"), 0.0);
    assert_eq!(sample(&text, "oncepay_idempotency_key_oldest_age_seconds"), 0.0);
}

/// The value of an unlabelled sample.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
        .parse()
        .unwrap()
}

/// Traffic that makes the server export every series and label value the rules read:
/// created, replayed, declined, key_reused, keyless, 409 in progress, 429 and 503.
async fn requests_of_every_kind(app: &TestApp) {
    // Before the first request: the tenant is not cached yet.
    app.set_policy("allow").await;
    assert_eq!(app.pay(None, 1).await.status, 201);
    let key = new_key();
    assert_eq!(app.pay(Some(&key), 100).await.status, 201);
    assert!(app.pay(Some(&key), 100).await.replayed());
    app.pay(Some(&key), 101)
        .await
        .assert_problem(422, "idempotency_key_reused");
    app.pay(Some(&new_key()), 1_000_000)
        .await
        .assert_problem(402, "insufficient_funds");

    // Two payments wait on locked accounts and hold both pooled connections (on two
    // accounts: a second payment on the same account would be held back in the server while
    // the first one's statement is out, not sent to wait in the database).
    app.open_account("other", 1_000).await;
    let mut lock = lock_accounts_at(
        &direct_url(&app.state),
        &[(app.tenant_id, "main"), (app.tenant_id, "other")],
    )
    .await;
    let mut observer = PgConnection::connect(&database_url()).await.unwrap();
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut lock)
        .await
        .unwrap();
    let in_flight_key = new_key();
    let original = spawn_payment(app, &in_flight_key, "main");
    let original_pid = blocked_by(&mut observer, holder, 1).await[0];
    app.pay(Some(&in_flight_key), 100)
        .await
        .assert_problem(409, "request_in_progress");
    let second = spawn_payment(app, &new_key(), "other");
    blocked_by(&mut observer, holder, 2).await;
    app.get("/accounts/main").await.assert_problem(429, "overloaded");
    // A busy pool is not a database that does not answer, and the scrape does not wait.
    let started = std::time::Instant::now();
    assert_eq!(sample(&app.metrics().await, "oncepay_ready"), 1.0);
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );

    // The original's connection dies: nothing committed, 503.
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(original_pid)
        .execute(&mut observer)
        .await
        .unwrap();
    Answer::from(original.await.unwrap())
        .await
        .assert_problem(503, "temporarily_unavailable");
    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();
    assert_eq!(Answer::from(second.await.unwrap()).await.status, 201);
}

/// A top-up waiting for 3-D Secure (503, outcome `waiting`) and a refund pending at the
/// processor (202, outcome `pending`): the keyed requests' recording rule names both.
async fn top_ups_not_finished(app: &TestApp, stripe: &crate::support::stripe::Localstripe) {
    let card = stripe.card("4000002760003184").await;
    let waiting = app.top_up(&new_key(), "main", 500, &card).await;
    waiting.assert_problem(503, "temporarily_unavailable");
    let made = app.top_up(&new_key(), "main", 500, "pm_card_visa").await;
    assert_eq!(made.status, 201, "{}", made.body);
    let refund = app.refund_top_up(&new_key(), made.body["id"].as_str().unwrap()).await;
    assert_eq!(refund.status, 202, "{}", refund.body);
}

fn spawn_payment(app: &TestApp, key: &str, account: &str) -> tokio::task::JoinHandle<reqwest::Response> {
    let request = app
        .client
        .post(app.url("/payments"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", key)
        .json(&json!({ "amount": 100, "account": account }));
    tokio::spawn(async move { request.send().await.unwrap() })
}

/// Waits (at most 5 s) until `n` payments wait for the lock of the backend `holder`; their
/// pids in the order they started. The second waiter for a row queues behind the first.
async fn blocked_by(observer: &mut PgConnection, holder: i32, n: usize) -> Vec<i32> {
    for _ in 0..200 {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT a.pid FROM pg_stat_activity a
              WHERE a.query LIKE '%oncepay_pay%'
                AND ($1 = ANY(pg_blocking_pids(a.pid))
                     OR EXISTS (SELECT 1 FROM pg_stat_activity b
                                 WHERE b.pid = ANY(pg_blocking_pids(a.pid)) AND $1 = ANY(pg_blocking_pids(b.pid))))
              ORDER BY a.query_start",
        )
        .bind(holder)
        .fetch_all(&mut *observer)
        .await
        .unwrap();
        if pids.len() >= n {
            return pids;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{n} payments not blocked on the account lock within 5 s");
}

/// The scraped samples: for each sample name, its labels and the values each one takes.
struct Exposition(BTreeMap<String, BTreeMap<String, BTreeSet<String>>>);

impl Exposition {
    fn parse(text: &str) -> Self {
        let mut series: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let labels = series.entry(line[..name_end].to_owned()).or_default();
            if line[name_end..].starts_with('{') {
                let body = &line[name_end + 1..line.rfind('}').expect("closed label set")];
                for pair in body.split("\",").filter(|p| !p.is_empty()) {
                    let (label, value) = pair.split_once("=\"").expect("label=\"value\"");
                    let value = value.trim_end_matches('"');
                    labels.entry(label.to_owned()).or_default().insert(value.to_owned());
                }
            }
        }
        Self(series)
    }

    /// What in `query` names a series, label or label value that is not exported (nor
    /// made by Prometheus, nor recorded by a rule).
    fn problems(&self, query: &str, recorded: &BTreeSet<String>) -> Vec<String> {
        let mut problems = Vec::new();
        for selector in selectors(query) {
            let name = &selector.name;
            if SCRAPE_SERIES.contains(&name.as_str()) {
                continue;
            }
            // A recorded series keeps labels of the series it aggregates: its matchers
            // are checked against every exported series.
            let labels = if name.contains(':') {
                if !recorded.contains(name) {
                    problems.push(format!("`{name}` is recorded by no rule, in: {query}"));
                    continue;
                }
                self.all_labels()
            } else if let Some(labels) = self.0.get(name) {
                labels.clone()
            } else {
                problems.push(format!("`{name}` is not exported, in: {query}"));
                continue;
            };
            for (label, op, value) in &selector.matchers {
                if TARGET_LABELS.contains(&label.as_str()) {
                    continue;
                }
                let Some(seen) = labels.get(label) else {
                    problems.push(format!("`{name}` has no label `{label}`, in: {query}"));
                    continue;
                };
                let wanted: Vec<&str> = match op.as_str() {
                    "=" => vec![value.as_str()],
                    // Alternatives of plain words; other patterns are not checked.
                    "=~" if value.split('|').all(is_word) => value.split('|').collect(),
                    _ => vec![],
                };
                for value in wanted.into_iter().filter(|v| !seen.contains(*v)) {
                    problems.push(format!("`{name}` never has {label}=\"{value}\", in: {query}"));
                }
            }
        }
        problems
    }
}

impl Exposition {
    /// Each label of any exported series, with every value it takes.
    fn all_labels(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut all: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (label, values) in self.0.values().flatten() {
            all.entry(label.clone()).or_default().extend(values.iter().cloned());
        }
        all
    }
}

fn is_word(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
}
