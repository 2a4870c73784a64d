//! The oncepay side: scenarios over HTTP against one or several instances.

use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use oncepay_bench::{histogram, percentiles_ms, Batches, Record};
use rand::Rng;
use serde::Deserialize;
use serde_json::json;

use crate::cpu::{Client, Meter};
use crate::Step;

/// Keys of the replay scenario are these numbers (as text) plus 0..replay_keys: digits only,
/// so that pgbench's replay script can name the same keys with `\set`.
pub const REPLAY_KEY_BASE: u64 = 1_000_000_000;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    step: Step,
    /// Instances, comma-separated; worker i talks to instance i mod n.
    #[arg(long, value_delimiter = ',')]
    urls: Vec<String>,
    #[arg(long)]
    api_key: String,
    /// Server pids whose CPU time is charged to the requests.
    #[arg(long, value_delimiter = ',')]
    pids: Vec<u32>,
    #[arg(long, default_value_t = 10_000)]
    accounts: u32,
    #[arg(long, default_value_t = 10_000)]
    replay_keys: u64,
    /// Keep going while this process lives (the purge), at most `duration_secs`.
    #[arg(long)]
    while_pid: Option<u32>,
    #[arg(long, default_value = "oncepay")]
    side: String,
    /// Stop after this many requests in all (or at `duration_secs`, whichever comes first).
    #[arg(long)]
    requests: Option<u64>,
    /// At most this many requests per second in all, each worker sending on a fixed schedule
    /// (an open load below the server's capacity: what a latency, not a throughput, is
    /// measured under). Unset: as fast as the answers come.
    #[arg(long)]
    rate: Option<f64>,
    /// Storm: how many times every one of the `replay_keys` keys is replayed.
    #[arg(long, default_value_t = 1)]
    passes: u64,
    /// Prefix of the storm's keys (`storm-seed` and `storm` must agree), so that every storm
    /// replays keys no earlier step has touched.
    #[arg(long, default_value = "")]
    key_prefix: String,
    /// Storm: replay each key on the instance that made it, as a balancer that hashes the
    /// `Idempotency-Key` header sends every retry of a key to one instance.
    #[arg(long)]
    affinity: bool,
    /// New and hot payments: each key a time-ordered UUIDv7 (as oncepay's client crate makes
    /// them) instead of a random UUIDv4 (what many clients send).
    #[arg(long)]
    time_ordered_keys: bool,
    /// Where each instance's `/metrics` is: its operations listener (`ONCEPAY_METRICS_BIND`),
    /// on its API port plus this (the bench scripts start them so).
    #[arg(long, default_value_t = 1000)]
    metrics_port_offset: u16,
    /// The card processor's pid (localstripe), whose CPU per request the record carries
    /// (the top-up steps, on both sides).
    #[arg(long)]
    processor_pid: Option<u32>,
    /// `top-up`: drive the processor at `urls` directly, as oncepay drives it per top-up
    /// (create + confirm), instead of oncepay's `POST /accounts/{id}/top-ups`.
    #[arg(long)]
    processor_direct: bool,
    /// The payment method of the `top-up` scenario, on both sides.
    #[arg(long, default_value = "pm_card_visa")]
    payment_method: String,
    /// `--processor-direct`: the currency oncepay sends (`ONCEPAY_CURRENCY`, default usd).
    #[arg(long, default_value = "usd")]
    currency: String,
    /// Exit with an error, after the step, when fewer requests were answered as expected
    /// than not (e.g. the processor behind oncepay cannot be reached).
    #[arg(long)]
    fail_if_mostly_errors: bool,
    /// `list-deep`: the id of the payment whose page (the items after it) every request reads.
    #[arg(long)]
    cursor: Option<String>,
    /// `page-lists`: pages a worker reads of one list before it turns to the next.
    #[arg(long, default_value_t = 50)]
    pages_per_list: u32,
}

/// Items per page of the list scenarios: the most a page holds.
const PAGE_LIMIT: u32 = 100;

/// The lists `page-lists` walks, in turn (docs/api.md, lists).
const LISTS: [&str; 5] = ["/payments", "/transfers", "/top-ups", "/accounts", "/events"];

/// The amount of every top-up (cents), through oncepay and at the processor directly.
const TOP_UP_AMOUNT: u64 = 5_000;

impl Args {
    /// Requests the step sends at most: the key sets are fixed in size.
    fn quota(&self) -> Option<u64> {
        match self.step.scenario.as_str() {
            "seed" | "warm" | "storm-seed" => Some(self.replay_keys),
            "storm" => Some(self.replay_keys * self.passes),
            _ => self.requests,
        }
    }
}

/// What one request of a scenario sends and expects back.
struct Request {
    /// A GET (a list's page, answered 200) rather than a keyed POST (answered 201).
    get: bool,
    key: Option<String>,
    /// `/payments`, or an account's `/accounts/{id}/top-ups`.
    path: String,
    body: serde_json::Value,
    /// The answer must carry `Idempotency-Replayed: true` (replays) or `false` (new keys).
    replayed: Option<bool>,
    /// The instance (index into `urls`) to send it to; `None`: the worker's own.
    instance: Option<usize>,
}

fn request(scenario: &str, worker: u64, seq: u64, args: &Args) -> anyhow::Result<Request> {
    let mut rng = rand::thread_rng();
    let account = |rng: &mut rand::rngs::ThreadRng| rng.gen_range(0..args.accounts).to_string();
    // The storm's n-th request: key n mod replay_keys, pass n / replay_keys. A key's body
    // names account key mod accounts, so that seeding spreads over the accounts.
    let index = seq * u64::from(args.step.concurrency) + worker;
    let storm_key = index % args.replay_keys.max(1);
    let storm_body = json!({"amount": 1, "account": (storm_key % u64::from(args.accounts.max(1))).to_string()});
    let n = args.urls.len() as u64;
    let new_key = || {
        if args.time_ordered_keys {
            uuid::Uuid::now_v7()
        } else {
            uuid::Uuid::new_v4()
        }
        .to_string()
    };
    Ok(match scenario {
        // Made by real payments, key k on instance k mod n ...
        "storm-seed" => Request {
            get: false,
            key: Some(format!("{}{}", args.key_prefix, REPLAY_KEY_BASE + storm_key)),
            path: PAYMENTS.to_owned(),
            body: storm_body,
            replayed: Some(false),
            instance: Some((storm_key % n) as usize),
        },
        // ... and replayed on another instance in every pass, as retries after a brownout
        // land wherever the balancer sends them; or, with `--affinity`, on its maker.
        "storm" => Request {
            get: false,
            key: Some(format!("{}{}", args.key_prefix, REPLAY_KEY_BASE + storm_key)),
            path: PAYMENTS.to_owned(),
            body: storm_body,
            replayed: Some(true),
            instance: Some(if args.affinity {
                (storm_key % n) as usize
            } else {
                ((storm_key + 1 + index / args.replay_keys.max(1)) % n) as usize
            }),
        },
        "new" => Request {
            get: false,
            key: Some(new_key()),
            path: PAYMENTS.to_owned(),
            body: json!({"amount": 1, "account": account(&mut rng)}),
            replayed: Some(false),
            instance: None,
        },
        "hot" => Request {
            get: false,
            key: Some(new_key()),
            path: PAYMENTS.to_owned(),
            body: json!({"amount": 1, "account": "0"}),
            replayed: Some(false),
            instance: None,
        },
        "replay" => Request {
            get: false,
            key: Some((REPLAY_KEY_BASE + rng.gen_range(0..args.replay_keys)).to_string()),
            path: PAYMENTS.to_owned(),
            body: json!({"amount": 1, "account": "0"}),
            replayed: Some(true),
            instance: None,
        },
        // Keys the replay scenario replays, each sent once: worker w takes w, w + n, ...;
        // made by `seed`, replayed once each by `warm` (which fills a replay cache).
        "seed" | "warm" => Request {
            get: false,
            key: Some((REPLAY_KEY_BASE + seq * u64::from(args.step.concurrency) + worker).to_string()),
            path: PAYMENTS.to_owned(),
            body: json!({"amount": 1, "account": "0"}),
            replayed: Some(scenario == "warm"),
            instance: None,
        },
        // No key, policy `fingerprint`: a unique amount keeps every body (and so its derived key) new.
        "keyless" => Request {
            get: false,
            key: None,
            path: PAYMENTS.to_owned(),
            body: json!({"amount": worker * 10_000_000 + seq + 1, "account": account(&mut rng)}),
            replayed: Some(false),
            instance: None,
        },
        // A card top-up of a random account through oncepay (create + confirm at its processor).
        "top-up" => Request {
            get: false,
            key: Some(uuid::Uuid::new_v4().to_string()),
            path: format!("/accounts/{}/top-ups", account(&mut rng)),
            body: json!({"amount": TOP_UP_AMOUNT, "payment_method": args.payment_method}),
            replayed: Some(false),
            instance: None,
        },
        // A page of the tenant's payments (GET /payments, the list's largest page): the first,
        // or the one after `--cursor`, deep in the list.
        "list-first" => Request {
            get: true,
            key: None,
            path: format!("{PAYMENTS}?limit={PAGE_LIMIT}"),
            body: serde_json::Value::Null,
            replayed: None,
            instance: None,
        },
        "list-deep" => Request {
            get: true,
            key: None,
            path: format!(
                "{PAYMENTS}?limit={PAGE_LIMIT}&starting_after={}",
                args.cursor.as_deref().context("list-deep needs --cursor")?
            ),
            body: serde_json::Value::Null,
            replayed: None,
            instance: None,
        },
        other => {
            bail!(
                "unknown scenario {other:?} (new, hot, replay, seed, warm, keyless, one-key, storm-seed, storm, \
                 top-up, list-first, list-deep, page-lists)"
            )
        }
    })
}

struct Tally {
    latencies: Histogram<u64>,
    ok: u64,
    errors: u64,
    /// First answers (`Idempotency-Replayed: false`), for the one-key scenario.
    created: u64,
}

impl Tally {
    fn new() -> Self {
        Self {
            latencies: histogram(),
            ok: 0,
            errors: 0,
            created: 0,
        }
    }

    fn add(&mut self, other: &Tally) {
        self.latencies.add(&other.latencies).expect("same bounds");
        self.ok += other.ok;
        self.errors += other.errors;
        self.created += other.created;
    }
}

struct Shared {
    /// `host:port` of each instance, as `urls` names them.
    hosts: Vec<HeaderValue>,
    auth: HeaderValue,
}

const PAYMENTS: &str = "/payments";
const JSON: &str = "application/json";
const FORM: &str = "application/x-www-form-urlencoded";

/// How long one request may take before it counts as an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// One worker's keep-alive connections, one per instance, opened on first use and again after
/// a failure. hyper's connection API rather than reqwest: the load generator shares the two
/// cores with what it measures, and through reqwest it spent 0.048 ms of CPU per new payment,
/// this way 0.029 (make bench, 2026-12-01 07:14 and 08:05).
struct Conns {
    senders: Vec<Option<SendRequest<Full<Bytes>>>>,
}

impl Conns {
    fn new(instances: usize) -> Self {
        Self {
            senders: (0..instances).map(|_| None).collect(),
        }
    }

    /// The keep-alive connection to instance `i`, opened if there is none (or it closed).
    async fn sender(&mut self, shared: &Shared, i: usize) -> anyhow::Result<&mut SendRequest<Full<Bytes>>> {
        if self.senders[i].as_ref().is_none_or(SendRequest::is_closed) {
            let host = shared.hosts[i].to_str()?;
            let stream = tokio::net::TcpStream::connect(host).await?;
            stream.set_nodelay(true)?;
            let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::task::spawn_local(connection);
            self.senders[i] = Some(sender);
        }
        self.senders[i].as_mut().context("no connection to the instance")
    }

    /// Sends one GET to instance `i`: its status and its body.
    async fn get(&mut self, shared: &Shared, i: usize, path: &str) -> anyhow::Result<(u16, Bytes)> {
        let request = hyper::Request::get(path)
            .header(HOST, shared.hosts[i].clone())
            .header(AUTHORIZATION, shared.auth.clone())
            .body(Full::new(Bytes::new()))?;
        let sender = self.sender(shared, i).await?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }

    /// Sends one POST to instance `i`: its status, whether it was a replay, its body.
    async fn post(
        &mut self,
        shared: &Shared,
        i: usize,
        path: &str,
        content_type: &'static str,
        key: Option<&str>,
        body: Bytes,
    ) -> anyhow::Result<(u16, bool, Bytes)> {
        let mut request = hyper::Request::post(path)
            .header(HOST, shared.hosts[i].clone())
            .header(AUTHORIZATION, shared.auth.clone())
            .header(CONTENT_TYPE, content_type);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let request = request.body(Full::new(body))?;
        let sender = self.sender(shared, i).await?;
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get("idempotency-replayed")
            .is_some_and(|v| v.as_bytes() == b"true");
        let body = response.into_body().collect().await?.to_bytes();
        Ok((status, replayed, body))
    }
}

/// Sends one request and counts its answer: 201 with the expected replay header is ok. A
/// failed or timed-out request drops its connection (the next one opens a new one).
async fn send(shared: &Shared, conns: &mut Conns, i: usize, req: &Request, tally: &mut Tally) {
    let started = Instant::now();
    let answer = if req.get {
        tokio::time::timeout(REQUEST_TIMEOUT, conns.get(shared, i, &req.path))
            .await
            .map(|r| r.map(|(status, _)| (status, false)))
    } else {
        let body = Bytes::from(req.body.to_string());
        tokio::time::timeout(
            REQUEST_TIMEOUT,
            conns.post(shared, i, &req.path, JSON, req.key.as_deref(), body),
        )
        .await
        .map(|r| r.map(|(status, replayed, _)| (status, replayed)))
    };
    let answer = match answer {
        Ok(Ok(answer)) => Some(answer),
        _ => {
            conns.senders[i] = None;
            None
        }
    };
    let micros = started.elapsed().as_micros().max(1) as u64;
    tally.latencies.saturating_record(micros);
    let expected = if req.get { 200 } else { 201 };
    match answer {
        Some((status, replayed)) if status == expected && req.replayed.is_none_or(|want| want == replayed) => {
            tally.ok += 1;
            tally.created += u64::from(!replayed);
        }
        _ => tally.errors += 1,
    }
}

/// A page as `page-lists` reads it: the last item's id and whether more follow.
#[derive(Deserialize)]
struct Page {
    data: Vec<Item>,
    has_more: bool,
}

#[derive(Deserialize)]
struct Item {
    id: String,
}

/// `page-lists`: one worker reading every list in turn, page after page by `starting_after`
/// (at most `pages_per_list` pages of each before the next list, then from the top again),
/// as a client reconciling the tenant's books would; each page is one request of the step.
async fn page_lists(shared: &Shared, conns: &mut Conns, i: usize, args: &Args, deadline: Instant, tally: &mut Tally) {
    for list in LISTS.iter().cycle() {
        let mut cursor: Option<String> = None;
        for _ in 0..args.pages_per_list {
            if Instant::now() >= deadline {
                return;
            }
            let path = match &cursor {
                Some(after) => format!("{list}?limit={PAGE_LIMIT}&starting_after={after}"),
                None => format!("{list}?limit={PAGE_LIMIT}"),
            };
            let started = Instant::now();
            let page = match tokio::time::timeout(REQUEST_TIMEOUT, conns.get(shared, i, &path)).await {
                Ok(Ok((200, body))) => serde_json::from_slice::<Page>(&body).ok(),
                _ => {
                    conns.senders[i] = None;
                    None
                }
            };
            tally
                .latencies
                .saturating_record(started.elapsed().as_micros().max(1) as u64);
            let Some(page) = page else {
                tally.errors += 1;
                break;
            };
            tally.ok += 1;
            match page.data.last() {
                Some(last) if page.has_more => cursor = Some(last.id.clone()),
                _ => break,
            }
        }
    }
}

/// A PaymentIntent, as far as the direct side reads it.
#[derive(Deserialize)]
struct Intent {
    id: String,
    status: String,
}

/// One top-up's work at the processor, driven directly (`--processor-direct`): the two calls
/// oncepay makes per top-up (src/top_ups/processor.rs), with the same form, headers and
/// connection reuse (keep-alive): create the PaymentIntent unconfirmed, then confirm it. One
/// operation is both calls; it is ok when both answer 200 and the intent `succeeded`.
async fn processor_direct(shared: &Shared, conns: &mut Conns, i: usize, args: &Args, tally: &mut Tally) {
    let started = Instant::now();
    let ok = matches!(
        tokio::time::timeout(REQUEST_TIMEOUT, direct_top_up(shared, conns, i, args)).await,
        Ok(Ok(true))
    );
    if !ok {
        conns.senders[i] = None;
    }
    tally
        .latencies
        .saturating_record(started.elapsed().as_micros().max(1) as u64);
    if ok {
        tally.ok += 1;
        tally.created += 1;
    } else {
        tally.errors += 1;
    }
}

async fn direct_top_up(shared: &Shared, conns: &mut Conns, i: usize, args: &Args) -> anyhow::Result<bool> {
    // What oncepay's top-up id is: a UUID, named in the metadata and both idempotency keys.
    let id = uuid::Uuid::new_v4();
    let form = format!(
        "amount={TOP_UP_AMOUNT}&currency={}&payment_method={}&metadata%5Boncepay_top_up_id%5D={id}",
        args.currency, args.payment_method
    );
    let key = format!("oncepay-top-up-{id}-create-intent");
    let (status, _, body) = conns
        .post(shared, i, "/v1/payment_intents", FORM, Some(&key), Bytes::from(form))
        .await?;
    if status != 200 {
        return Ok(false);
    }
    let created: Intent = serde_json::from_slice(&body)?;
    let path = format!("/v1/payment_intents/{}/confirm", created.id);
    let key = format!("oncepay-top-up-{id}-confirm");
    let (status, _, body) = conns.post(shared, i, &path, FORM, Some(&key), Bytes::new()).await?;
    if status != 200 {
        return Ok(false);
    }
    let confirmed: Intent = serde_json::from_slice(&body)?;
    Ok(confirmed.status == "succeeded")
}

fn alive(pid: Option<u32>) -> bool {
    pid.is_none_or(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
}

pub async fn run(args: Args) -> anyhow::Result<Record> {
    if args.urls.is_empty() {
        bail!("--urls names no instance");
    }
    if args.processor_direct && args.step.scenario != "top-up" {
        bail!("--processor-direct drives the top-up scenario only");
    }
    let hosts = args
        .urls
        .iter()
        .map(|url| {
            let host = url.strip_prefix("http://").context("--urls: http:// URLs only")?;
            HeaderValue::from_str(host.trim_end_matches('/')).context("--urls: a bad host")
        })
        .collect::<anyhow::Result<_>>()?;
    let shared = Rc::new(Shared {
        hosts,
        auth: HeaderValue::from_str(&format!("Bearer {}", args.api_key)).context("bad API key")?,
    });
    let metrics_client = reqwest::Client::new();
    let args = Rc::new(args);
    let metrics_urls: Vec<String> = args
        .urls
        .iter()
        .map(|u| metrics_url(u, args.metrics_port_offset))
        .collect::<anyhow::Result<_>>()?;
    let before = metrics_texts(&metrics_client, &metrics_urls).await;
    let cache_before = before.as_deref().and_then(cache_counters);
    let batches_before = before.as_deref().and_then(batch_counters);
    let meter = Meter::start_with_processor(
        &args.pids,
        args.step.pg_pid,
        args.step.clock_ticks,
        Client::Me,
        args.processor_pid,
    )?;
    let started = Instant::now();
    let tally = if args.step.scenario == "one-key" {
        one_key_rounds(&shared, &args).await
    } else {
        closed_loop(&shared, &args).await?
    };
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = meter.stop(tally.ok)?;
    let after = metrics_texts(&metrics_client, &metrics_urls).await;
    let cache_after = after.as_deref().and_then(cache_counters);
    let batch_limit = after
        .as_deref()
        .and_then(|texts| mean_gauge(texts, "oncepay_db_batches_in_flight_limit"));
    let batches = after
        .as_deref()
        .and_then(batch_counters)
        .zip(batches_before)
        .map(|(after, before)| after.since(before));
    let cache = cache_before
        .zip(cache_after)
        .map(|(b, a)| (a.0.saturating_sub(b.0), a.1.saturating_sub(b.1)));
    if args.fail_if_mostly_errors && tally.errors >= tally.ok {
        bail!(
            "{}: {} of {} requests failed (is the processor reachable? see the servers' log)",
            args.step.scenario,
            tally.errors,
            tally.ok + tally.errors
        );
    }
    let (p50_ms, p99_ms, p999_ms) = percentiles_ms(&tally.latencies);
    let step = &args.step;
    Ok(Record {
        side: args.side.clone(),
        scenario: step.scenario.clone(),
        concurrency: step.concurrency,
        key_rows: step.key_rows,
        round: step.round,
        duration_secs: elapsed,
        requests: tally.ok,
        errors: tally.errors,
        throughput: tally.ok as f64 / elapsed,
        p50_ms,
        p99_ms,
        p999_ms,
        cpu_secs_per_request: cpu.server,
        pg_cpu_secs_per_request: cpu.postgres,
        client_cpu_secs_per_request: cpu.client,
        processor_cpu_secs_per_request: cpu.processor,
        cache_hits: cache.map(|c| c.0),
        cache_misses: cache.map(|c| c.1),
        note: step.note.clone(),
        host_steal: cpu.host_steal,
        batch_limit,
        batches,
    })
}

/// The operations listener of the instance at `url` (`http://host:port`): its port plus `offset`.
fn metrics_url(url: &str, offset: u16) -> anyhow::Result<String> {
    let (base, port) = url.rsplit_once(':').with_context(|| format!("{url}: no port"))?;
    let port: u16 = port
        .trim_end_matches('/')
        .parse()
        .with_context(|| format!("{url}: a bad port"))?;
    Ok(format!("{base}:{}", port + offset))
}

/// An instance's `/metrics` text (`url`: its operations listener).
async fn metrics_text(client: &reqwest::Client, url: &str) -> Option<String> {
    client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()
}

/// Every instance's `/metrics` text, read once for all the figures taken from it; `None` if
/// one could not be read.
async fn metrics_texts(client: &reqwest::Client, urls: &[String]) -> Option<Vec<String>> {
    let mut texts = Vec::with_capacity(urls.len());
    for url in urls {
        texts.push(metrics_text(client, url).await?);
    }
    Some(texts)
}

/// The replay cache's hits and misses summed over the instances; `None` if an instance does
/// not export them (a server without the cache).
fn cache_counters(texts: &[String]) -> Option<(u64, u64)> {
    let (mut hits, mut misses) = (0u64, 0u64);
    for text in texts {
        hits += metric(text, "oncepay_replay_cache_hits_total")?;
        misses += metric(text, "oncepay_replay_cache_misses_total")?;
    }
    Some((hits, misses))
}

/// The payments' batch statements summed over the instances (`oncepay_db_batch_size`: its
/// count, its sum and its bucket of one); `None` if an instance does not export them.
fn batch_counters(texts: &[String]) -> Option<Batches> {
    let mut total = Batches::default();
    for text in texts {
        total = total.plus(Batches {
            statements: metric(text, "oncepay_db_batch_size_count")?,
            payments: metric(text, "oncepay_db_batch_size_sum")?,
            singles: series(text, "oncepay_db_batch_size_bucket{le=\"1\"}")? as u64,
        });
    }
    Some(total)
}

/// The value of one series, named with its labels as the text format writes them.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        (series == name).then(|| value.parse::<f64>().ok())?
    })
}

/// A gauge's mean over the instances; `None` if one does not export it.
fn mean_gauge(texts: &[String], name: &str) -> Option<f64> {
    let values = texts
        .iter()
        .map(|text| series(text, name))
        .collect::<Option<Vec<f64>>>()?;
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// The sum of a counter's samples (all label sets) in Prometheus' text format.
fn metric(text: &str, name: &str) -> Option<u64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let metric_name = series.split('{').next()?;
            (metric_name == name).then(|| value.parse::<f64>().ok())?
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum::<f64>() as u64)
}

/// `concurrency` workers, each sending its next request as soon as the last one answered.
async fn closed_loop(shared: &Rc<Shared>, args: &Rc<Args>) -> anyhow::Result<Tally> {
    let deadline = Instant::now() + args.step.duration();
    let quota = args.quota();
    let local = tokio::task::LocalSet::new();
    let mut handles = Vec::new();
    for worker in 0..u64::from(args.step.concurrency) {
        let (shared, args) = (shared.clone(), args.clone());
        handles.push(local.spawn_local(async move {
            let own = worker as usize % args.urls.len();
            let mut conns = Conns::new(args.urls.len());
            let mut tally = Tally::new();
            // With a rate, worker w sends at start + (seq + w / concurrency) x the interval.
            let interval = args
                .rate
                .filter(|r| *r > 0.0)
                .map(|r| std::time::Duration::from_secs_f64(f64::from(args.step.concurrency) / r));
            let start = Instant::now();
            for seq in 0.. {
                if let Some(interval) = interval {
                    let offset = interval.mul_f64(seq as f64 + worker as f64 / f64::from(args.step.concurrency));
                    tokio::time::sleep_until((start + offset).into()).await;
                }
                if Instant::now() >= deadline || !alive(args.while_pid) {
                    break;
                }
                if quota.is_some_and(|q| seq * u64::from(args.step.concurrency) + worker >= q) {
                    break;
                }
                if args.processor_direct {
                    processor_direct(&shared, &mut conns, own, &args, &mut tally).await;
                    continue;
                }
                if args.step.scenario == "page-lists" {
                    page_lists(&shared, &mut conns, own, &args, deadline, &mut tally).await;
                    break;
                }
                let req = request(&args.step.scenario, worker, seq, &args)?;
                send(&shared, &mut conns, req.instance.unwrap_or(own), &req, &mut tally).await;
            }
            Ok::<_, anyhow::Error>(tally)
        }));
    }
    let mut total = Tally::new();
    local
        .run_until(async {
            for handle in handles {
                total.add(&handle.await??);
            }
            Ok::<_, anyhow::Error>(())
        })
        .await?;
    Ok(total)
}

/// Rounds of `concurrency` simultaneous requests with one fresh key and one body, spread
/// over the instances, until the time is up. Each round must charge once: exactly one
/// first answer; a round with any other count adds its requests to the errors.
async fn one_key_rounds(shared: &Rc<Shared>, args: &Rc<Args>) -> Tally {
    let deadline = Instant::now() + args.step.duration();
    let mut total = Tally::new();
    let local = tokio::task::LocalSet::new();
    let workers = args.step.concurrency as usize;
    let mut idle: Vec<Conns> = (0..workers).map(|_| Conns::new(args.urls.len())).collect();
    while Instant::now() < deadline {
        let key = uuid::Uuid::new_v4().to_string();
        let mut handles = Vec::new();
        for (worker, mut conns) in idle.drain(..).enumerate() {
            let (shared, args, key) = (shared.clone(), args.clone(), key.clone());
            handles.push(local.spawn_local(async move {
                let req = Request {
                    get: false,
                    key: Some(key),
                    path: PAYMENTS.to_owned(),
                    body: json!({"amount": 1, "account": "1"}),
                    replayed: None,
                    instance: None,
                };
                let mut tally = Tally::new();
                send(&shared, &mut conns, worker % args.urls.len(), &req, &mut tally).await;
                (tally, conns)
            }));
        }
        let mut round = Tally::new();
        local
            .run_until(async {
                for handle in handles {
                    let (t, conns) = handle.await.expect("a worker of the round panicked");
                    round.add(&t);
                    idle.push(conns);
                }
            })
            .await;
        if round.created != 1 {
            round.errors += round.ok;
            round.ok = 0;
        }
        total.add(&round);
    }
    total
}
