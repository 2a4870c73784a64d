//! The SQL functions of migrations/V4, called directly on real connections, one test per
//! function and outcome: `oncepay_claim` and `oncepay_decline` (raw SQL), each operation's
//! function (through its `oncepay::ledger` effect), the CHECK constraints and the enum types.
//!
//! "Nothing changed" is checked on the rows themselves: every row of the tenant with its
//! `xmin` (a rewritten row gets a new one), and, where a call must not write at all, the
//! transaction it ran in never got a transaction id (`pg_current_xact_id_if_assigned()`).

use std::fmt::Debug;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures_util::future::join_all;
use oncepay::domain::{AccountId, Amount, OpeningBalance, PaymentId, TenantId};
use oncepay::idempotency::{fingerprint, Claim, Fingerprint};
use oncepay::ledger::{ClaimArgs, Deposit, Effect, OpenAccount, Outcome, Pay, Refund, Refusal, Reply, Transfer};
use oncepay::operation::{ClaimOutcome, Decline, Operation};
use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

use crate::helpers::{database_url, new_key, spawn_app, MAIN_BALANCE};

/// The replay window of the keys the tests claim.
const WINDOW: Duration = Duration::from_secs(3600);
/// The in-flight wait of ordinary calls: long, so only the tests about it ever hit it.
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// Fixture
// ---------------------------------------------------------------------------------------

/// The harness's pool and a fresh tenant (account `main` holding `MAIN_BALANCE`).
struct Fx {
    pool: PgPool,
    tenant: TenantId,
}

/// What `oncepay_claim` and `oncepay_decline` return (`oncepay_claimed`).
#[derive(Debug, PartialEq, sqlx::FromRow)]
struct Claimed {
    outcome: ClaimOutcome,
    decline: Option<Decline>,
    resource_id: Option<String>,
    expires_at: Option<DateTime<Utc>>,
}

/// A key row as stored, with the `xmin` of its current version.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
struct KeyRow {
    xmin: String,
    fingerprint: Vec<u8>,
    operation: Operation,
    method: String,
    path: String,
    status: i16,
    resource_id: Option<String>,
    error_code: Option<Decline>,
    created_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

/// Every row of one tenant, table by table, each with its `xmin`.
#[derive(Debug, PartialEq)]
struct Snapshot {
    /// accounts, payments, deposits, transfers
    effects: Vec<Option<String>>,
    keys: Option<String>,
}

impl Fx {
    async fn new() -> Self {
        let app = spawn_app().await;
        Self {
            pool: app.pool.clone(),
            tenant: TenantId::from_uuid(app.tenant_id),
        }
    }

    async fn conn(&self) -> PgConnection {
        PgConnection::connect(&database_url()).await.expect("connection")
    }

    async fn claim(&self, args: &ClaimArgs, resource: &str) -> Result<Claimed, sqlx::Error> {
        let mut conn = self.pool.acquire().await.unwrap();
        claim_on(&mut conn, self.tenant, args, resource).await
    }

    async fn decline(&self, args: &ClaimArgs, decline: Decline) -> Claimed {
        sqlx::query_as("SELECT outcome, decline, resource_id, expires_at FROM oncepay_decline($1, $2, $3)")
            .bind(self.tenant.get())
            .bind(args)
            .bind(decline)
            .fetch_one(&self.pool)
            .await
            .expect("oncepay_decline")
    }

    /// A claim in a transaction that must end without a transaction id: it wrote nothing.
    async fn claim_writing_nothing(&self, args: &ClaimArgs, resource: &str) -> Claimed {
        let mut tx = self.pool.begin().await.unwrap();
        let claimed = claim_on(&mut tx, self.tenant, args, resource).await.unwrap();
        assert_wrote_nothing(&mut tx).await;
        tx.commit().await.unwrap();
        claimed
    }

    async fn run<E: Effect>(&self, effect: &E, args: &ClaimArgs) -> Outcome<E::Row> {
        let mut conn = self.pool.acquire().await.unwrap();
        effect
            .run(&mut conn, self.tenant, args)
            .await
            .expect("the function answers")
    }

    async fn run_keyed<E: Effect + Debug>(&self, effect: &E, path: &str, key: &str) -> Outcome<E::Row> {
        self.run(effect, &args(effect, path, key)).await
    }

    /// Runs an effect in a transaction that must end without a transaction id.
    async fn run_writing_nothing<E: Effect>(&self, effect: &E, args: &ClaimArgs) -> Outcome<E::Row> {
        let mut tx = self.pool.begin().await.unwrap();
        let outcome = effect
            .run(&mut tx, self.tenant, args)
            .await
            .expect("the function answers");
        assert_wrote_nothing(&mut tx).await;
        tx.commit().await.unwrap();
        outcome
    }

    async fn key_row(&self, key: &str) -> Option<KeyRow> {
        sqlx::query_as(
            "SELECT xmin::text AS xmin, fingerprint, operation, method, path, status, resource_id,
                    error_code, created_at, expires_at
               FROM idempotency_keys WHERE tenant_id = $1 AND key = $2",
        )
        .bind(self.tenant.get())
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
    }

    async fn key_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1")
            .bind(self.tenant.get())
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Moves a key's window into the past (an hour-long window that ended an hour ago).
    async fn backdate(&self, key: &str) {
        let done = sqlx::query(
            "UPDATE idempotency_keys SET created_at = now() - interval '2 hours',
                    expires_at = now() - interval '1 hour'
              WHERE tenant_id = $1 AND key = $2",
        )
        .bind(self.tenant.get())
        .bind(key)
        .execute(&self.pool)
        .await
        .unwrap();
        assert_eq!(done.rows_affected(), 1, "key {key} backdated");
    }

    async fn snapshot(&self) -> Snapshot {
        let mut tables = Vec::new();
        for table in ["accounts", "payments", "deposits", "transfers", "idempotency_keys"] {
            let rows: Option<String> = sqlx::query_scalar(&format!(
                "SELECT string_agg(t::text || '@' || t.xmin::text, ';' ORDER BY t::text)
                   FROM {table} t WHERE t.tenant_id = $1"
            ))
            .bind(self.tenant.get())
            .fetch_one(&self.pool)
            .await
            .unwrap();
            tables.push(rows);
        }
        let keys = tables.pop().unwrap();
        Snapshot { effects: tables, keys }
    }

    async fn balance(&self, account: &str) -> i64 {
        sqlx::query_scalar("SELECT balance FROM accounts WHERE tenant_id = $1 AND account_id = $2")
            .bind(self.tenant.get())
            .bind(account)
            .fetch_one(&self.pool)
            .await
            .expect("account exists")
    }

    async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE tenant_id = $1"))
            .bind(self.tenant.get())
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Opens an account directly (setup, not under test).
    async fn open(&self, account: &str, balance: i64) {
        sqlx::query("INSERT INTO accounts (tenant_id, account_id, balance, opening_balance) VALUES ($1, $2, $3, $3)")
            .bind(self.tenant.get())
            .bind(account)
            .bind(balance)
            .execute(&self.pool)
            .await
            .unwrap();
    }

    /// A payment of `amount` from `main`, made through its function (setup for refunds).
    async fn paid(&self, amount: i64) -> PaymentId {
        let effect = pay("main", amount);
        match self.run(&effect, &args(&effect, "/payments", &new_key())).await.result {
            Ok(Reply::New(row)) => PaymentId::from_uuid(row.payment_id),
            other => panic!("setup payment failed: {other:?}"),
        }
    }
}

async fn claim_on(
    conn: &mut PgConnection,
    tenant: TenantId,
    args: &ClaimArgs,
    resource: &str,
) -> Result<Claimed, sqlx::Error> {
    sqlx::query_as("SELECT outcome, decline, resource_id, expires_at FROM oncepay_claim($1, $2, $3)")
        .bind(tenant.get())
        .bind(args)
        .bind(resource)
        .fetch_one(conn)
        .await
}

async fn assert_wrote_nothing(conn: &mut PgConnection) {
    let xid: Option<String> = sqlx::query_scalar("SELECT pg_current_xact_id_if_assigned()::text")
        .fetch_one(conn)
        .await
        .unwrap();
    assert_eq!(xid, None, "the call wrote (its transaction was given an id)");
}

async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Waits (at most 10 s) until backend `pid` is blocked by backend `by`.
async fn wait_until_blocked(pool: &PgPool, pid: i32, by: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let blocked: bool = sqlx::query_scalar("SELECT $2 = ANY (pg_blocking_pids($1))")
            .bind(pid)
            .bind(by)
            .fetch_one(pool)
            .await
            .unwrap();
        if blocked {
            return;
        }
        assert!(Instant::now() < deadline, "backend {pid} was never blocked by {by}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn sqlstate(err: &sqlx::Error) -> Option<String> {
    err.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned())
}

fn fp(seed: &str) -> Fingerprint {
    fingerprint("POST", "/test", &json!(seed))
}

fn client_claim(key: &str, fingerprint: Fingerprint) -> Claim {
    Claim {
        key: key.to_owned(),
        derived: false,
        fingerprint,
        window: WINDOW,
    }
}

/// A server-derived key (`fp:<hex>`) and its claim.
fn derived_claim(fingerprint: Fingerprint) -> Claim {
    Claim {
        key: format!("fp:{}", hex::encode(fingerprint)),
        derived: true,
        fingerprint,
        window: WINDOW,
    }
}

fn claim_args(op: Operation, path: &str, claim: &Claim, wait: Duration) -> ClaimArgs {
    ClaimArgs::new(op.spec(), path.to_owned(), Some(claim), wait)
}

/// The claim of one request for `effect` with a client key; the fingerprint depends on the
/// effect's input, as a real request's depends on its body.
fn args<E: Effect + Debug>(effect: &E, path: &str, key: &str) -> ClaimArgs {
    let claim = client_claim(key, fingerprint("POST", path, &json!(format!("{effect:?}"))));
    claim_args(E::OPERATION, path, &claim, WAIT)
}

fn account(id: &str) -> AccountId {
    AccountId::parse(id).unwrap()
}

fn amount(n: i64) -> Amount {
    Amount::new(n).unwrap()
}

fn pay(from: &str, n: i64) -> Pay {
    Pay {
        account: account(from),
        amount: amount(n),
    }
}

fn deposit(to: &str, n: i64) -> Deposit {
    Deposit {
        account: account(to),
        amount: amount(n),
    }
}

fn open_account(id: &str, balance: i64) -> OpenAccount {
    OpenAccount {
        account: account(id),
        balance: OpeningBalance::new(balance).unwrap(),
    }
}

fn transfer(from: &str, to: &str, n: i64) -> Transfer {
    Transfer::new(account(from), account(to), amount(n)).unwrap()
}

fn refund_path(payment: PaymentId) -> String {
    Operation::Refund.spec().path_with(&payment.to_string())
}

// ---------------------------------------------------------------------------------------
// The outcomes every operation shares, checked once for any effect
// ---------------------------------------------------------------------------------------

/// A first call with a new key must create: its key row is the success the operation table
/// describes, naming the resource it answered with. Returns the row and the key.
async fn created<E: Effect + Debug>(fx: &Fx, effect: &E, path: &str) -> (E::Row, KeyRow) {
    let key = new_key();
    let outcome = fx.run(effect, &args(effect, path, &key)).await;
    let Ok(Reply::New(row)) = outcome.result else {
        panic!("{effect:?} was not created: {:?}", outcome.result.map(|_| ()));
    };
    let stored = fx.key_row(&key).await.expect("the key row is written");
    let spec = E::OPERATION.spec();
    assert_eq!(stored.operation, E::OPERATION);
    assert_eq!((stored.method.as_str(), stored.path.as_str()), (spec.method, path));
    assert_eq!(stored.status, spec.success_status as i16);
    assert_eq!(stored.error_code, None);
    assert_eq!(
        outcome.expires_at,
        Some(stored.expires_at),
        "the answer carries the key's expiry"
    );
    assert_eq!(
        (stored.expires_at - stored.created_at).to_std().unwrap(),
        WINDOW,
        "the window given"
    );
    (row, stored)
}

/// A success replayed: the same row, and the call writes nothing at all.
async fn assert_success_replayed<E>(fx: &Fx, effect: &E, path: &str)
where
    E: Effect + Debug,
    E::Row: PartialEq + Debug,
{
    let key = new_key();
    let args = args(effect, path, &key);
    let first = fx.run(effect, &args).await;
    let Ok(Reply::New(row)) = first.result else {
        panic!("{effect:?} was not created");
    };
    let before = fx.snapshot().await;

    let replay = fx.run_writing_nothing(effect, &args).await;

    assert_eq!(replay.result, Ok(Reply::Replayed(row)), "the same row answers");
    assert_eq!(replay.expires_at, first.expires_at);
    assert_eq!(fx.snapshot().await, before, "a replay changes no row");
}

/// A decline: stored with its status and code and no resource, no effect; then replayed
/// without writing anything.
async fn assert_declined<E>(fx: &Fx, effect: &E, path: &str, decline: Decline)
where
    E: Effect + Debug,
    E::Row: PartialEq + Debug,
{
    let before = fx.snapshot().await;
    let key = new_key();
    let args = args(effect, path, &key);

    let first = fx.run(effect, &args).await;

    assert_eq!(
        first.result,
        Err(Refusal::Declined {
            decline,
            replayed: false
        })
    );
    let stored = fx.key_row(&key).await.expect("the decline is stored");
    assert_eq!(
        (stored.status, stored.error_code, stored.resource_id),
        (decline.status() as i16, Some(decline), None),
        "stored with its status and code, naming no resource"
    );
    assert_eq!(first.expires_at, Some(stored.expires_at));
    let after = fx.snapshot().await;
    assert_eq!(
        after.effects, before.effects,
        "a decline changes no balance and writes no resource"
    );

    let replay = fx.run_writing_nothing(effect, &args).await;

    assert_eq!(
        replay.result,
        Err(Refusal::Declined {
            decline,
            replayed: true
        })
    );
    assert_eq!(replay.expires_at, first.expires_at);
    assert_eq!(fx.snapshot().await, after, "a replayed decline changes no row");
}

/// The key of `first`, sent again with `other`'s input (another fingerprint): refused
/// without writing, and the key row keeps `first`'s fingerprint and result.
async fn assert_key_reused<E>(fx: &Fx, first: &E, other: &E, path: &str)
where
    E: Effect + Debug,
    E::Row: PartialEq + Debug,
{
    let key = new_key();
    fx.run(first, &args(first, path, &key)).await;
    let before = fx.snapshot().await;

    let reused = fx.run_writing_nothing(other, &args(other, path, &key)).await;

    assert_eq!(
        reused,
        Outcome {
            result: Err(Refusal::KeyReused),
            expires_at: None
        }
    );
    assert_eq!(fx.snapshot().await, before, "key_reused changes no row");
}

/// A client key past its window: refused as expired, without writing, the effect not run
/// again.
async fn assert_expired<E>(fx: &Fx, effect: &E, path: &str)
where
    E: Effect + Debug,
    E::Row: PartialEq + Debug,
{
    let key = new_key();
    let args = args(effect, path, &key);
    fx.run(effect, &args).await;
    fx.backdate(&key).await;
    let before = fx.snapshot().await;

    let expired = fx.run_writing_nothing(effect, &args).await;

    assert_eq!(
        expired,
        Outcome {
            result: Err(Refusal::KeyExpired),
            expires_at: None
        }
    );
    assert_eq!(fx.snapshot().await, before, "an expired key changes no row");
}

// ---------------------------------------------------------------------------------------
// oncepay_claim
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn claim_of_a_new_key_is_created_and_writes_the_row_as_given() {
    let fx = Fx::new().await;
    let key = new_key();
    let path = format!("/payments/{}/refund", Uuid::new_v4());
    let args = claim_args(Operation::Refund, &path, &client_claim(&key, fp("new")), WAIT);

    let claimed = fx.claim(&args, "resource-1").await.unwrap();

    let row = fx.key_row(&key).await.expect("the key row is written");
    assert_eq!(claimed.outcome, ClaimOutcome::Created);
    assert_eq!(claimed.decline, None);
    assert_eq!(claimed.resource_id.as_deref(), Some("resource-1"));
    assert_eq!(claimed.expires_at, Some(row.expires_at));
    assert_eq!(row.fingerprint, fp("new").to_vec());
    assert_eq!(row.operation, Operation::Refund);
    assert_eq!((row.method.as_str(), row.path.as_str()), ("POST", path.as_str()));
    assert_eq!(row.status, 200, "the success status given (a refund's)");
    assert_eq!(row.resource_id.as_deref(), Some("resource-1"));
    assert_eq!(row.error_code, None);
    assert_eq!((row.expires_at - row.created_at).to_std().unwrap(), WINDOW);
}

#[tokio::test]
async fn claim_without_a_key_is_created_and_writes_nothing() {
    let fx = Fx::new().await;
    let args = ClaimArgs::new(Operation::Pay.spec(), "/payments".to_owned(), None, WAIT);

    let claimed = fx.claim_writing_nothing(&args, "resource-1").await;

    assert_eq!(
        claimed,
        Claimed {
            outcome: ClaimOutcome::Created,
            decline: None,
            resource_id: Some("resource-1".to_owned()),
            expires_at: None,
        }
    );
    assert_eq!(fx.key_count().await, 0, "no key row for a keyless request");
}

#[tokio::test]
async fn claim_replays_a_success_without_writing() {
    let fx = Fx::new().await;
    let key = new_key();
    let args = claim_args(Operation::Pay, "/payments", &client_claim(&key, fp("a")), WAIT);
    let first = fx.claim(&args, "resource-1").await.unwrap();
    let stored = fx.key_row(&key).await.unwrap();

    let replay = fx.claim_writing_nothing(&args, "resource-2").await;

    assert_eq!(
        replay,
        Claimed {
            outcome: ClaimOutcome::Replayed,
            decline: None,
            resource_id: Some("resource-1".to_owned()),
            expires_at: first.expires_at,
        },
        "the first claim's resource, not the one offered again"
    );
    assert_eq!(fx.key_row(&key).await.unwrap(), stored, "same row version (xmin)");
}

#[tokio::test]
async fn claim_replays_a_stored_decline_without_writing() {
    let fx = Fx::new().await;
    let key = new_key();
    let args = claim_args(Operation::Pay, "/payments", &client_claim(&key, fp("a")), WAIT);
    fx.claim(&args, "resource-1").await.unwrap();
    let declined = fx.decline(&args, Decline::InsufficientFunds).await;
    let stored = fx.key_row(&key).await.unwrap();

    let replay = fx.claim_writing_nothing(&args, "resource-2").await;

    assert_eq!(
        replay,
        Claimed {
            outcome: ClaimOutcome::Replayed,
            decline: Some(Decline::InsufficientFunds),
            resource_id: None,
            expires_at: declined.expires_at,
        }
    );
    assert_eq!(fx.key_row(&key).await.unwrap(), stored, "same row version (xmin)");
}

#[tokio::test]
async fn claim_with_another_fingerprint_is_key_reused_without_writing() {
    let fx = Fx::new().await;
    let key = new_key();
    let first = claim_args(Operation::Pay, "/payments", &client_claim(&key, fp("a")), WAIT);
    fx.claim(&first, "resource-1").await.unwrap();
    let stored = fx.key_row(&key).await.unwrap();
    let other = claim_args(Operation::Pay, "/payments", &client_claim(&key, fp("b")), WAIT);

    let reused = fx.claim_writing_nothing(&other, "resource-2").await;

    assert_eq!(
        reused,
        Claimed {
            outcome: ClaimOutcome::KeyReused,
            decline: None,
            resource_id: None,
            expires_at: None,
        }
    );
    assert_eq!(
        fx.key_row(&key).await.unwrap(),
        stored,
        "the first request's row, untouched"
    );
}

#[tokio::test]
async fn claim_of_a_client_key_past_its_window_is_expired_without_writing() {
    let fx = Fx::new().await;
    let key = new_key();
    let args = claim_args(Operation::Pay, "/payments", &client_claim(&key, fp("a")), WAIT);
    fx.claim(&args, "resource-1").await.unwrap();
    fx.backdate(&key).await;
    let stored = fx.key_row(&key).await.unwrap();

    let expired = fx.claim_writing_nothing(&args, "resource-2").await;

    assert_eq!(
        expired,
        Claimed {
            outcome: ClaimOutcome::Expired,
            decline: None,
            resource_id: None,
            expires_at: None,
        }
    );
    assert_eq!(
        fx.key_row(&key).await.unwrap(),
        stored,
        "an expired client key is never renewed"
    );
}

#[tokio::test]
async fn claim_renews_a_derived_key_past_its_window_in_place() {
    let fx = Fx::new().await;
    let claim = derived_claim(fp("derived"));
    let args = claim_args(Operation::Pay, "/payments", &claim, WAIT);
    fx.claim(&args, "resource-1").await.unwrap();
    // The stored result is a decline: the renewal must clear it.
    fx.decline(&args, Decline::InsufficientFunds).await;
    fx.backdate(&claim.key).await;
    let old = fx.key_row(&claim.key).await.unwrap();

    let renewed = fx.claim(&args, "resource-2").await.unwrap();

    let row = fx.key_row(&claim.key).await.unwrap();
    assert_eq!(renewed.outcome, ClaimOutcome::Created);
    assert_eq!(renewed.resource_id.as_deref(), Some("resource-2"), "the new resource");
    assert_eq!(renewed.expires_at, Some(row.expires_at));
    assert!(row.expires_at > Utc::now(), "a new window: {}", row.expires_at);
    assert!(row.created_at > old.created_at);
    assert_eq!((row.expires_at - row.created_at).to_std().unwrap(), WINDOW);
    assert_eq!(row.resource_id.as_deref(), Some("resource-2"));
    assert_eq!(
        (row.status, row.error_code),
        (201, None),
        "the success again, no stored decline"
    );
    assert_ne!(row.xmin, old.xmin, "rewritten");
    assert_eq!(fx.key_count().await, 1, "in place: still one row for the key");
}

/// A renews a derived key past its window and keeps its transaction open; B's claim of the
/// same key waits on the row lock, and when A commits, B replays A's renewal.
#[tokio::test]
async fn derived_key_renewal_race_the_waiting_claim_replays_the_winner() {
    let fx = Fx::new().await;
    let claim = derived_claim(fp("race"));
    let args = claim_args(Operation::Pay, "/payments", &claim, WAIT);
    fx.claim(&args, "first").await.unwrap();
    fx.backdate(&claim.key).await;

    let mut a = fx.conn().await;
    let a_pid = backend_pid(&mut a).await;
    sqlx::query("BEGIN").execute(&mut a).await.unwrap();
    let a_claim = claim_on(&mut a, fx.tenant, &args, "renewed-by-a").await.unwrap();
    assert_eq!(a_claim.outcome, ClaimOutcome::Created);

    let mut b = fx.conn().await;
    let b_pid = backend_pid(&mut b).await;
    let tenant = fx.tenant;
    let b_args = claim_args(Operation::Pay, "/payments", &claim, WAIT);
    let b_claim = tokio::spawn(async move { claim_on(&mut b, tenant, &b_args, "renewed-by-b").await });
    wait_until_blocked(&fx.pool, b_pid, a_pid).await;
    assert!(!b_claim.is_finished(), "B waits for A");

    sqlx::query("COMMIT").execute(&mut a).await.unwrap();
    let b_claim = b_claim.await.unwrap().expect("B's claim answers");

    assert_eq!(
        b_claim,
        Claimed {
            outcome: ClaimOutcome::Replayed,
            decline: None,
            resource_id: Some("renewed-by-a".to_owned()),
            expires_at: a_claim.expires_at,
        },
        "B replays A's renewal"
    );
    let row = fx.key_row(&claim.key).await.unwrap();
    assert_eq!(row.resource_id.as_deref(), Some("renewed-by-a"));
    assert_eq!(Some(row.expires_at), a_claim.expires_at);
}

/// A holds an uncommitted claim; B's claim of the same key waits `inflight_wait_ms` (200 ms)
/// and fails with SQLSTATE 55P03.
#[tokio::test]
async fn claim_of_an_in_flight_key_waits_inflight_wait_ms_then_fails_with_55p03() {
    let fx = Fx::new().await;
    let key = new_key();
    let args = claim_args(Operation::Pay, "/payments", &client_claim(&key, fp("a")), WAIT);
    let mut a = fx.pool.begin().await.unwrap();
    assert_eq!(
        claim_on(&mut a, fx.tenant, &args, "resource-a").await.unwrap().outcome,
        ClaimOutcome::Created
    );
    let short = claim_args(
        Operation::Pay,
        "/payments",
        &client_claim(&key, fp("a")),
        Duration::from_millis(200),
    );

    let started = Instant::now();
    let err = fx
        .claim(&short, "resource-b")
        .await
        .expect_err("B must not get the key");
    let waited = started.elapsed();

    assert_eq!(sqlstate(&err).as_deref(), Some("55P03"), "{err}");
    assert!(waited >= Duration::from_millis(200), "B waited only {waited:?}");
    assert!(
        waited < Duration::from_millis(1500),
        "B waited {waited:?}, far past 200 ms"
    );
    a.rollback().await.unwrap();
    assert_eq!(fx.key_row(&key).await, None, "neither claim left a row");
}

/// The claim loop reads the key at most three times; a row that changes under it each time
/// (here: a session that replaces the expired derived-key row by a new expired one, again and
/// again, holding each version's lock for a millisecond) exhausts it, and it raises 40001
/// rather than loop on. A race, so bounded: at most 20 s of claims, stopping at the first
/// 40001 (in trial runs the first or second claim raised it; a tight loop in psql on the same
/// busy machine saw about one claim in 25 raise it).
#[tokio::test]
async fn claim_raises_40001_when_the_key_changes_three_times_during_one_claim() {
    let fx = Fx::new().await;
    let claim = derived_claim(fp("churn"));
    let args = claim_args(Operation::Pay, "/payments", &claim, WAIT);
    fx.claim(&args, "first").await.unwrap();
    fx.backdate(&claim.key).await;

    let mut churn = fx.conn().await;
    let churn_pid = backend_pid(&mut churn).await;
    let script = format!(
        "DO $$
         DECLARE started timestamptz := clock_timestamp();
         BEGIN
           PERFORM set_config('synchronous_commit', 'off', false);
           WHILE clock_timestamp() < started + interval '25 seconds' LOOP
             DELETE FROM idempotency_keys WHERE tenant_id = '{tenant}' AND key = '{key}';
             INSERT INTO idempotency_keys (tenant_id, key, fingerprint, operation, method, path,
                                           status, resource_id, created_at, expires_at)
             VALUES ('{tenant}', '{key}', '\\x{fp}', 'pay', 'POST', '/payments', 201, 'churn',
                     now() - interval '2 hours', now() - interval '1 hour');
             PERFORM pg_sleep(0.001);
             COMMIT;
           END LOOP;
         END $$;",
        tenant = fx.tenant,
        key = claim.key,
        fp = hex::encode(claim.fingerprint),
    );
    let churning = sqlx::raw_sql(&script).execute(&mut churn);
    let claiming = async {
        wait_until_churning(&fx, &claim.key).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut answered = Vec::new();
        let mut exhausted = None;
        while Instant::now() < deadline {
            match fx.claim(&args, "mine").await {
                Ok(claimed) => answered.push(claimed.outcome),
                Err(err) => {
                    exhausted = Some(err);
                    break;
                }
            }
        }
        sqlx::query("SELECT pg_cancel_backend($1)")
            .bind(churn_pid)
            .execute(&fx.pool)
            .await
            .unwrap();
        (answered, exhausted)
    };
    let (stopped, (answered, exhausted)) = tokio::join!(churning, claiming);
    eprintln!("claims answered before the first 40001: {}", answered.len());
    assert!(stopped.is_err(), "the churn session was cancelled while still running");

    let err = exhausted.unwrap_or_else(|| {
        panic!(
            "no claim exhausted its three rounds in 20 s ({} claims answered)",
            answered.len()
        )
    });
    assert_eq!(sqlstate(&err).as_deref(), Some("40001"), "{err}");
    assert!(
        err.to_string()
            .contains("idempotency key changed three times during one claim"),
        "{err}"
    );
    assert!(
        answered
            .iter()
            .all(|o| matches!(o, ClaimOutcome::Created | ClaimOutcome::Replayed)),
        "under churn a claim still answers only created or replayed: {answered:?}"
    );
}

/// Waits (at most 10 s) until the churn session has replaced the key row at least once.
async fn wait_until_churning(fx: &Fx, key: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while fx.key_row(key).await.and_then(|r| r.resource_id).as_deref() != Some("churn") {
        assert!(Instant::now() < deadline, "the churn session never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------
// oncepay_decline
// ---------------------------------------------------------------------------------------

/// The status comes from the caller's `decline_statuses` (here deliberately not the
/// operation table's), the code is the decline, the resource is cleared.
#[tokio::test]
async fn decline_stores_the_status_from_decline_statuses_and_the_code_and_nulls_the_resource() {
    let fx = Fx::new().await;
    let key = new_key();
    let args = "ROW($2, false, $3, 'pay', 'POST', '/payments', 3600, 1000, 201,
                   '{\"insufficient_funds\": 422, \"account_not_found\": 410}')::oncepay_claim_args";
    let claimed: Claimed = sqlx::query_as(&format!(
        "SELECT outcome, decline, resource_id, expires_at FROM oncepay_claim($1, {args}, 'resource-1')"
    ))
    .bind(fx.tenant.get())
    .bind(&key)
    .bind(fp("a").to_vec())
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert_eq!(claimed.resource_id.as_deref(), Some("resource-1"));

    let declined: Claimed = sqlx::query_as(&format!(
        "SELECT outcome, decline, resource_id, expires_at FROM oncepay_decline($1, {args}, 'account_not_found')"
    ))
    .bind(fx.tenant.get())
    .bind(&key)
    .bind(fp("a").to_vec())
    .fetch_one(&fx.pool)
    .await
    .unwrap();

    let row = fx.key_row(&key).await.unwrap();
    assert_eq!(
        declined,
        Claimed {
            outcome: ClaimOutcome::Declined,
            decline: Some(Decline::AccountNotFound),
            resource_id: None,
            expires_at: Some(row.expires_at),
        }
    );
    assert_eq!(row.status, 410, "the status of the map given, not a literal");
    assert_eq!(row.error_code, Some(Decline::AccountNotFound));
    assert_eq!(row.resource_id, None);
}

#[tokio::test]
async fn decline_of_every_operation_stores_the_status_of_its_table_entry() {
    let fx = Fx::new().await;
    for op in Operation::ALL {
        for &decline in op.spec().declines {
            let key = new_key();
            let args = claim_args(op, op.spec().path, &client_claim(&key, fp("a")), WAIT);
            fx.claim(&args, "resource").await.unwrap();

            let declined = fx.decline(&args, decline).await;

            let row = fx.key_row(&key).await.unwrap();
            assert_eq!(
                (declined.outcome, declined.decline),
                (ClaimOutcome::Declined, Some(decline))
            );
            assert_eq!(
                (row.status, row.error_code, row.resource_id),
                (decline.status() as i16, Some(decline), None),
                "{op:?} {decline:?}"
            );
        }
    }
}

#[tokio::test]
async fn decline_without_a_key_answers_declined_and_writes_nothing() {
    let fx = Fx::new().await;
    let args = ClaimArgs::new(Operation::Pay.spec(), "/payments".to_owned(), None, WAIT);
    let mut tx = fx.pool.begin().await.unwrap();

    let declined: Claimed =
        sqlx::query_as("SELECT outcome, decline, resource_id, expires_at FROM oncepay_decline($1, $2, $3)")
            .bind(fx.tenant.get())
            .bind(&args)
            .bind(Decline::InsufficientFunds)
            .fetch_one(&mut *tx)
            .await
            .unwrap();

    assert_wrote_nothing(&mut tx).await;
    tx.commit().await.unwrap();
    assert_eq!(
        declined,
        Claimed {
            outcome: ClaimOutcome::Declined,
            decline: Some(Decline::InsufficientFunds),
            resource_id: None,
            expires_at: None,
        }
    );
}

// ---------------------------------------------------------------------------------------
// oncepay_pay
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn pay_created_debits_the_account_and_writes_the_payment() {
    let fx = Fx::new().await;

    let (row, key) = created(&fx, &pay("main", 300), "/payments").await;

    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300);
    assert_eq!((row.account_id.as_str(), *row.amount), ("main", 300));
    assert_eq!(row.balance_after, MAIN_BALANCE - 300);
    assert_eq!((row.refunded_at, row.balance_after_refund), (None, None));
    assert_eq!(key.resource_id, Some(row.payment_id.to_string()));
    assert_eq!(fx.count("payments").await, 1);
}

#[tokio::test]
async fn pay_declines_insufficient_funds_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    assert_declined(
        &fx,
        &pay("main", MAIN_BALANCE + 1),
        "/payments",
        Decline::InsufficientFunds,
    )
    .await;
}

#[tokio::test]
async fn pay_declines_account_not_found_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    assert_declined(&fx, &pay("nobody", 1), "/payments", Decline::AccountNotFound).await;
}

#[tokio::test]
async fn pay_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    assert_success_replayed(&fx, &pay("main", 300), "/payments").await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300, "debited once");
}

#[tokio::test]
async fn pay_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    assert_key_reused(&fx, &pay("main", 300), &pay("main", 301), "/payments").await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300);
}

#[tokio::test]
async fn pay_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    assert_expired(&fx, &pay("main", 300), "/payments").await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300);
}

// ---------------------------------------------------------------------------------------
// oncepay_refund
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn refund_created_credits_the_account_back_and_marks_the_payment() {
    let fx = Fx::new().await;
    let payment = fx.paid(300).await;

    let (row, key) = created(&fx, &Refund { payment }, &refund_path(payment)).await;

    assert_eq!(fx.balance("main").await, MAIN_BALANCE);
    assert_eq!(row.payment_id, payment.get());
    assert!(row.refunded_at.is_some());
    assert_eq!(row.balance_after_refund, Some(MAIN_BALANCE));
    assert_eq!(key.resource_id, Some(payment.to_string()));
    let refunded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE tenant_id = $1 AND refunded_at IS NOT NULL")
            .bind(fx.tenant.get())
            .fetch_one(&fx.pool)
            .await
            .unwrap();
    assert_eq!(refunded, 1);
}

#[tokio::test]
async fn refund_declines_not_found_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    let payment = PaymentId::new_random();
    assert_declined(&fx, &Refund { payment }, &refund_path(payment), Decline::NotFound).await;
}

#[tokio::test]
async fn refund_declines_already_refunded_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    let payment = fx.paid(300).await;
    let path = refund_path(payment);
    created(&fx, &Refund { payment }, &path).await;

    assert_declined(&fx, &Refund { payment }, &path, Decline::AlreadyRefunded).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE, "credited back once");
}

#[tokio::test]
async fn refund_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    let payment = fx.paid(300).await;
    assert_success_replayed(&fx, &Refund { payment }, &refund_path(payment)).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE);
}

#[tokio::test]
async fn refund_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    let (first, second) = (fx.paid(300).await, fx.paid(200).await);
    // The key of the first refund, sent again for another payment: another fingerprint.
    let path = refund_path(first);
    assert_key_reused(&fx, &Refund { payment: first }, &Refund { payment: second }, &path).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 200, "only the first refunded");
}

#[tokio::test]
async fn refund_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    let payment = fx.paid(300).await;
    assert_expired(&fx, &Refund { payment }, &refund_path(payment)).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE);
}

// ---------------------------------------------------------------------------------------
// oncepay_deposit
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn deposit_created_credits_the_account_and_writes_the_deposit() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("main");

    let (row, key) = created(&fx, &deposit("main", 250), &path).await;

    assert_eq!(fx.balance("main").await, MAIN_BALANCE + 250);
    assert_eq!((row.account_id.as_str(), *row.amount), ("main", 250));
    assert_eq!(row.balance_after, MAIN_BALANCE + 250);
    assert_eq!(key.resource_id, Some(row.deposit_id.to_string()));
    assert_eq!(fx.count("deposits").await, 1);
}

#[tokio::test]
async fn deposit_declines_account_not_found_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("nobody");
    assert_declined(&fx, &deposit("nobody", 250), &path, Decline::AccountNotFound).await;
}

#[tokio::test]
async fn deposit_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("main");
    assert_success_replayed(&fx, &deposit("main", 250), &path).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + 250, "credited once");
}

#[tokio::test]
async fn deposit_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("main");
    assert_key_reused(&fx, &deposit("main", 250), &deposit("main", 251), &path).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + 250);
}

#[tokio::test]
async fn deposit_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    let path = Operation::Deposit.spec().path_with("main");
    assert_expired(&fx, &deposit("main", 250), &path).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE + 250);
}

// ---------------------------------------------------------------------------------------
// oncepay_open_account
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn open_account_created_writes_the_account_with_its_opening_balance() {
    let fx = Fx::new().await;

    let (row, key) = created(&fx, &open_account("savings", 700), "/accounts").await;

    assert_eq!(
        (row.account_id.as_str(), *row.balance, *row.opening_balance),
        ("savings", 700, 700)
    );
    assert_eq!(fx.balance("savings").await, 700);
    assert_eq!(key.resource_id.as_deref(), Some("savings"));
    assert_eq!(fx.count("accounts").await, 2, "main and savings");
}

#[tokio::test]
async fn open_account_declines_account_exists_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    assert_declined(&fx, &open_account("main", 5), "/accounts", Decline::AccountExists).await;
    assert_eq!(fx.balance("main").await, MAIN_BALANCE, "the existing account untouched");
}

#[tokio::test]
async fn open_account_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    assert_success_replayed(&fx, &open_account("savings", 700), "/accounts").await;
}

#[tokio::test]
async fn open_account_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    assert_key_reused(
        &fx,
        &open_account("savings", 700),
        &open_account("other", 1),
        "/accounts",
    )
    .await;
    assert_eq!(fx.count("accounts").await, 2, "main and savings, no `other`");
}

#[tokio::test]
async fn open_account_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    assert_expired(&fx, &open_account("savings", 700), "/accounts").await;
    assert_eq!(fx.count("accounts").await, 2);
}

// ---------------------------------------------------------------------------------------
// oncepay_transfer
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn transfer_created_moves_the_amount_and_writes_the_transfer() {
    let fx = Fx::new().await;
    fx.open("u2", 50).await;

    let (row, key) = created(&fx, &transfer("main", "u2", 300), "/transfers").await;

    assert_eq!(fx.balance("main").await, MAIN_BALANCE - 300);
    assert_eq!(fx.balance("u2").await, 350);
    assert_eq!(
        (row.from_account_id.as_str(), row.to_account_id.as_str(), *row.amount),
        ("main", "u2", 300)
    );
    assert_eq!(
        (*row.from_balance_after, *row.to_balance_after),
        (MAIN_BALANCE - 300, 350)
    );
    assert_eq!(key.resource_id, Some(row.transfer_id.to_string()));
    assert_eq!(fx.count("transfers").await, 1);
}

#[tokio::test]
async fn transfer_declines_insufficient_funds_stores_and_replays_it_changing_nothing() {
    let fx = Fx::new().await;
    fx.open("u2", 50).await;
    let effect = transfer("main", "u2", MAIN_BALANCE + 1);
    assert_declined(&fx, &effect, "/transfers", Decline::InsufficientFunds).await;
}

#[tokio::test]
async fn transfer_declines_account_not_found_for_either_side_changing_nothing() {
    let fx = Fx::new().await;
    assert_declined(
        &fx,
        &transfer("main", "nobody", 1),
        "/transfers",
        Decline::AccountNotFound,
    )
    .await;
    assert_declined(
        &fx,
        &transfer("nobody", "main", 1),
        "/transfers",
        Decline::AccountNotFound,
    )
    .await;
}

#[tokio::test]
async fn transfer_replayed_answers_the_same_row_and_changes_nothing() {
    let fx = Fx::new().await;
    fx.open("u2", 0).await;
    assert_success_replayed(&fx, &transfer("main", "u2", 300), "/transfers").await;
    assert_eq!(
        (fx.balance("main").await, fx.balance("u2").await),
        (MAIN_BALANCE - 300, 300)
    );
}

#[tokio::test]
async fn transfer_key_reused_answers_without_effect() {
    let fx = Fx::new().await;
    fx.open("u2", 0).await;
    assert_key_reused(
        &fx,
        &transfer("main", "u2", 300),
        &transfer("u2", "main", 300),
        "/transfers",
    )
    .await;
    assert_eq!(
        (fx.balance("main").await, fx.balance("u2").await),
        (MAIN_BALANCE - 300, 300)
    );
}

#[tokio::test]
async fn transfer_expired_key_answers_without_effect() {
    let fx = Fx::new().await;
    fx.open("u2", 0).await;
    assert_expired(&fx, &transfer("main", "u2", 300), "/transfers").await;
    assert_eq!(
        (fx.balance("main").await, fx.balance("u2").await),
        (MAIN_BALANCE - 300, 300)
    );
}

/// With the lower account id locked elsewhere, a transfer waits for it holding no lock on
/// the higher one, whichever side the lower id is on: the two rows are locked in account-id
/// order, not in from/to order.
#[tokio::test]
async fn transfer_locks_its_two_accounts_in_account_id_order() {
    let fx = Fx::new().await;
    fx.open("acct-a", 1_000).await;
    fx.open("acct-z", 1_000).await;
    for (from, to) in [("acct-z", "acct-a"), ("acct-a", "acct-z")] {
        let mut holder = fx.pool.begin().await.unwrap();
        let holder_pid = backend_pid(&mut holder).await;
        sqlx::query("SELECT FROM accounts WHERE tenant_id = $1 AND account_id = 'acct-a' FOR UPDATE")
            .bind(fx.tenant.get())
            .execute(&mut *holder)
            .await
            .unwrap();

        let mut conn = fx.pool.acquire().await.unwrap();
        let pid = backend_pid(&mut conn).await;
        let (effect, tenant) = (transfer(from, to, 10), fx.tenant);
        let effect_args = args(&effect, "/transfers", &new_key());
        let running = tokio::spawn(async move { effect.run(&mut conn, tenant, &effect_args).await });
        wait_until_blocked(&fx.pool, pid, holder_pid).await;

        let mut probe = fx.pool.begin().await.unwrap();
        let free = sqlx::query("SELECT FROM accounts WHERE tenant_id = $1 AND account_id = 'acct-z' FOR UPDATE NOWAIT")
            .bind(fx.tenant.get())
            .execute(&mut *probe)
            .await;
        probe.rollback().await.unwrap();
        holder.rollback().await.unwrap();
        let outcome = running.await.unwrap().unwrap();

        assert!(
            free.is_ok(),
            "transfer {from} -> {to} holds acct-z while waiting for acct-a: {free:?}"
        );
        assert!(
            matches!(outcome.result, Ok(Reply::New(_))),
            "{from} -> {to}: {outcome:?}"
        );
    }
    assert_eq!((fx.balance("acct-a").await, fx.balance("acct-z").await), (1_000, 1_000));
}

/// One transfer in a transaction that keeps its locks 2 ms after the function returns, so
/// that concurrent transfers queue on both account rows.
async fn held_transfer(
    conn: &mut PgConnection,
    tenant: TenantId,
    effect: &Transfer,
) -> Result<Outcome<oncepay::ledger::TransferRow>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let outcome = effect
        .run(&mut tx, tenant, &args(effect, "/transfers", &new_key()))
        .await?;
    sqlx::query("SELECT pg_sleep(0.002)").execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// Opposite transfers between the same two accounts on four connections at once, each
/// holding its locks a little while: none deadlocks (40P01), each is applied once, the sum
/// of balances is unchanged. (A copy of the function locking `from` then `to` deadlocked 10
/// times in one run of this test.)
#[tokio::test]
async fn opposite_transfers_in_parallel_never_deadlock() {
    let fx = Fx::new().await;
    fx.open("p", 100_000).await;
    fx.open("q", 100_000).await;
    const PER_CONNECTION: usize = 100;

    // Connection i sends its n-th transfer (p -> q for even i, q -> p for odd i) of this amount.
    let amount_of = |i: i64, n: i64| 1 + i + 10 * n;

    let runs = (0..4).map(|i| {
        let (pool, tenant) = (fx.pool.clone(), fx.tenant);
        async move {
            let mut conn = pool.acquire().await.unwrap();
            let (from, to) = if i % 2 == 0 { ("p", "q") } else { ("q", "p") };
            let mut errors = Vec::new();
            for n in 0..PER_CONNECTION as i64 {
                let effect = transfer(from, to, amount_of(i, n));
                match held_transfer(&mut conn, tenant, &effect).await {
                    Ok(Outcome {
                        result: Ok(Reply::New(_)),
                        ..
                    }) => {}
                    Ok(other) => errors.push(format!("{other:?}")),
                    Err(err) => errors.push(format!("{:?}: {err}", sqlstate(&err))),
                }
            }
            errors
        }
    });
    let errors: Vec<String> = join_all(runs).await.into_iter().flatten().collect();

    assert!(errors.is_empty(), "{} failed, e.g. {:?}", errors.len(), errors.first());
    assert_eq!(fx.count("transfers").await, 4 * PER_CONNECTION as i64);
    let into_p: i64 = (0..4)
        .flat_map(|i| (0..PER_CONNECTION as i64).map(move |n| (i, n)))
        .map(|(i, n)| if i % 2 == 0 { -amount_of(i, n) } else { amount_of(i, n) })
        .sum();
    assert_eq!(fx.balance("p").await, 100_000 + into_p, "p: each transfer applied once");
    assert_eq!(
        fx.balance("p").await + fx.balance("q").await,
        200_000,
        "no money made or lost"
    );
}

/// The SQL function itself, given one account as both sides (Rust's `Transfer::new` refuses
/// it before): it refuses too, before claiming the key, and moves nothing.
#[tokio::test]
async fn transfer_from_an_account_to_itself_is_refused_in_sql() {
    let fx = Fx::new().await;
    let before = fx.snapshot().await;
    let key = new_key();
    let args = claim_args(Operation::Transfer, "/transfers", &client_claim(&key, fp("self")), WAIT);

    let refused = sqlx::query("SELECT * FROM oncepay_transfer($1, $2, 'main', 'main', 1)")
        .bind(fx.tenant.get())
        .bind(&args)
        .execute(&fx.pool)
        .await
        .unwrap_err();

    assert_eq!(sqlstate(&refused).as_deref(), Some("23514"), "{refused}");
    assert_eq!(fx.snapshot().await, before, "no key claimed, nothing moved");
}

// ---------------------------------------------------------------------------------------
// CHECK constraints
// ---------------------------------------------------------------------------------------

/// One column list with valid values per table; each case overrides one or two of them.
fn insert(table: &str, base: &[(&str, &str)], changes: &[(&str, &str)]) -> String {
    let values: Vec<&str> = base
        .iter()
        .map(|(column, value)| changes.iter().find(|(c, _)| c == column).map_or(*value, |(_, v)| *v))
        .collect();
    let columns: Vec<&str> = base.iter().map(|(c, _)| *c).collect();
    format!(
        "INSERT INTO {table} ({}) VALUES ({})",
        columns.join(", "),
        values.join(", ")
    )
}

#[tokio::test]
async fn every_check_constraint_and_domain_refuses_a_row_that_breaks_it() {
    let fx = Fx::new().await;
    fx.open("other", 0).await;
    let tenant = format!("'{}'", fx.tenant);
    let fp32 = "'\\x0000000000000000000000000000000000000000000000000000000000000000'::bytea";
    let key = [
        ("tenant_id", tenant.as_str()),
        ("key", "'k'"),
        ("fingerprint", fp32),
        ("operation", "'pay'"),
        ("method", "'POST'"),
        ("path", "'/payments'"),
        ("status", "201"),
        ("resource_id", "'r'"),
        ("error_code", "NULL"),
        ("created_at", "now()"),
        ("expires_at", "now() + interval '1 hour'"),
    ];
    let accounts = [
        ("tenant_id", tenant.as_str()),
        ("account_id", "'fresh'"),
        ("balance", "0"),
        ("opening_balance", "0"),
    ];
    let payments = [
        ("tenant_id", tenant.as_str()),
        ("payment_id", "gen_random_uuid()"),
        ("account_id", "'main'"),
        ("amount", "1"),
        ("balance_after", "0"),
        ("created_at", "now()"),
        ("refunded_at", "NULL"),
        ("balance_after_refund", "NULL"),
    ];
    let deposits = [
        ("tenant_id", tenant.as_str()),
        ("deposit_id", "gen_random_uuid()"),
        ("account_id", "'main'"),
        ("amount", "1"),
        ("balance_after", "1"),
        ("created_at", "now()"),
    ];
    let tenants = [
        ("tenant_id", "gen_random_uuid()"),
        ("name", "'shop'"),
        ("api_key_hash", "sha256(gen_random_uuid()::text::bytea)"),
    ];
    let transfers = [
        ("tenant_id", tenant.as_str()),
        ("transfer_id", "gen_random_uuid()"),
        ("from_account_id", "'main'"),
        ("to_account_id", "'other'"),
        ("amount", "1"),
        ("from_balance_after", "0"),
        ("to_balance_after", "1"),
        ("created_at", "now()"),
    ];
    let long_key = format!("'{}'", "k".repeat(256));
    let long_account = format!("'{}'", "a".repeat(65));
    let long_name = format!("'{}'", "n".repeat(201));
    let cases: Vec<(&str, String)> = vec![
        (
            "oncepay_idempotency_key_check",
            insert("idempotency_keys", &key, &[("key", &long_key)]),
        ),
        (
            "oncepay_idempotency_key_check",
            insert("idempotency_keys", &key, &[("key", "''")]),
        ),
        (
            "oncepay_fingerprint_check",
            insert("idempotency_keys", &key, &[("fingerprint", "'\\x00'::bytea")]),
        ),
        (
            "oncepay_http_method_check",
            insert("idempotency_keys", &key, &[("method", "'GET'")]),
        ),
        (
            "oncepay_key_status_check",
            insert(
                "idempotency_keys",
                &key,
                &[
                    ("status", "500"),
                    ("resource_id", "NULL"),
                    ("error_code", "'not_found'"),
                ],
            ),
        ),
        (
            "oncepay_key_status_check",
            insert("idempotency_keys", &key, &[("status", "199")]),
        ),
        (
            "oncepay_account_id_check",
            insert("accounts", &accounts, &[("account_id", "'a b'")]),
        ),
        (
            "oncepay_account_id_check",
            insert("accounts", &accounts, &[("account_id", &long_account)]),
        ),
        (
            "oncepay_opening_balance_check",
            insert("accounts", &accounts, &[("opening_balance", "-1")]),
        ),
        (
            "oncepay_opening_balance_check",
            insert("accounts", &accounts, &[("opening_balance", "1000000000001")]),
        ),
        (
            "oncepay_balance_check",
            insert("accounts", &accounts, &[("balance", "-1")]),
        ),
        (
            "oncepay_amount_check",
            insert("payments", &payments, &[("amount", "0")]),
        ),
        (
            "oncepay_amount_check",
            insert("payments", &payments, &[("amount", "1000000000001")]),
        ),
        (
            "oncepay_balance_check",
            insert("payments", &payments, &[("balance_after", "-1")]),
        ),
        (
            "payments_refund_check",
            insert("payments", &payments, &[("refunded_at", "now()")]),
        ),
        (
            "payments_refund_check",
            insert("payments", &payments, &[("balance_after_refund", "1")]),
        ),
        (
            "oncepay_amount_check",
            insert("deposits", &deposits, &[("amount", "0")]),
        ),
        ("tenants_name_check", insert("tenants", &tenants, &[("name", "''")])),
        (
            "tenants_name_check",
            insert("tenants", &tenants, &[("name", &long_name)]),
        ),
        (
            "tenants_name_check",
            insert("tenants", &tenants, &[("name", "E'shop\\n'")]),
        ),
        (
            "transfers_accounts_check",
            insert("transfers", &transfers, &[("to_account_id", "'main'")]),
        ),
        (
            "oncepay_amount_check",
            insert("transfers", &transfers, &[("amount", "0")]),
        ),
        (
            "oncepay_balance_check",
            insert("transfers", &transfers, &[("from_balance_after", "-1")]),
        ),
        (
            "oncepay_balance_check",
            insert("transfers", &transfers, &[("to_balance_after", "-1")]),
        ),
    ];

    // Each base row is valid: a refusal below is the case's doing.
    for (table, base) in [
        ("idempotency_keys", &key[..]),
        ("accounts", &accounts[..]),
        ("payments", &payments[..]),
        ("deposits", &deposits[..]),
        ("tenants", &tenants[..]),
        ("transfers", &transfers[..]),
    ] {
        let mut tx = fx.pool.begin().await.unwrap();
        let valid = sqlx::query(&insert(table, base, &[])).execute(&mut *tx).await;
        assert!(valid.is_ok(), "the base row of {table} is refused: {valid:?}");
        tx.rollback().await.unwrap();
    }
    for (constraint, sql) in &cases {
        let mut tx = fx.pool.begin().await.unwrap();
        let refused = sqlx::query(sql).execute(&mut *tx).await.expect_err(sql);
        tx.rollback().await.unwrap();
        let db = refused.as_database_error().expect("a database error");
        assert_eq!(db.code().as_deref(), Some("23514"), "{sql}: {refused}");
        assert_eq!(db.constraint(), Some(*constraint), "{sql}");
    }

    // Every CHECK constraint of these tables and of oncepay's domains has a case above.
    let mut added: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT conname::text FROM pg_constraint
          WHERE contype = 'c'
            AND (conrelid IN ('idempotency_keys'::regclass, 'accounts'::regclass, 'payments'::regclass,
                              'deposits'::regclass, 'tenants'::regclass, 'transfers'::regclass)
                 OR contypid IN (SELECT oid FROM pg_type WHERE typtype = 'd' AND typname LIKE 'oncepay\\_%'))
            AND conname <> 'tenants_missing_key_policy_check'",
    )
    .fetch_all(&fx.pool)
    .await
    .unwrap();
    added.sort();
    let mut tested: Vec<String> = cases.iter().map(|(c, _)| c.to_string()).collect();
    tested.sort();
    tested.dedup();
    assert_eq!(tested, added, "one case at least per CHECK constraint and domain");
}

/// The rules across a key row's columns are not CHECKs (V5: ~75k instructions per new key);
/// the two statements that write key rows keep them. Every outcome of every operation, then
/// the rows as stored: a success names its resource and no error, a stored failure the
/// reverse, and each row's window is positive.
#[tokio::test]
async fn key_rows_written_by_the_functions_keep_the_cross_column_rules() {
    let fx = Fx::new().await;
    fx.open("other", 0).await;
    let payment = fx.paid(300).await;
    let missing = PaymentId::new_random();
    let (refund, refund_missing) = (refund_path(payment), refund_path(missing));
    let mut n = 0;
    let mut key = || {
        n += 1;
        format!("rules-{n}")
    };
    fx.run_keyed(&pay("main", 1), "/payments", &key()).await;
    fx.run_keyed(&pay("main", MAIN_BALANCE * 2), "/payments", &key()).await;
    fx.run_keyed(&pay("nobody", 1), "/payments", &key()).await;
    fx.run_keyed(&Refund { payment }, &refund, &key()).await;
    fx.run_keyed(&Refund { payment }, &refund, &key()).await;
    fx.run_keyed(&Refund { payment: missing }, &refund_missing, &key())
        .await;
    fx.run_keyed(&deposit("main", 5), "/accounts/main/deposits", &key())
        .await;
    fx.run_keyed(&deposit("nobody", 5), "/accounts/nobody/deposits", &key())
        .await;
    fx.run_keyed(&open_account("fresh", 1), "/accounts", &key()).await;
    fx.run_keyed(&open_account("fresh", 1), "/accounts", &key()).await;
    fx.run_keyed(&transfer("main", "other", 1), "/transfers", &key()).await;
    fx.run_keyed(&transfer("main", "nobody", 1), "/transfers", &key()).await;

    let (rows, successes, failures, broken): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*),
                count(*) FILTER (WHERE status < 300),
                count(*) FILTER (WHERE status >= 400),
                count(*) FILTER (WHERE NOT (
                    expires_at > created_at
                    AND ((status < 300 AND error_code IS NULL AND resource_id IS NOT NULL)
                         OR (status >= 400 AND error_code IS NOT NULL AND resource_id IS NULL))))
           FROM idempotency_keys WHERE tenant_id = $1 AND key LIKE 'rules-%'",
    )
    .bind(fx.tenant.get())
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert_eq!((rows, successes, failures), (12, 5, 7), "every outcome was stored");
    assert_eq!(broken, 0, "a key row breaks the result or window rule");
}

// ---------------------------------------------------------------------------------------
// Enum types
// ---------------------------------------------------------------------------------------

async fn labels(pool: &PgPool, enum_type: &str) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "SELECT label::text FROM unnest(enum_range(NULL::{enum_type})) WITH ORDINALITY AS e (label, n) ORDER BY n"
    ))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Decodes every label of a PostgreSQL enum into its Rust type, in the type's order.
async fn decoded<T>(pool: &PgPool, enum_type: &str) -> Vec<T>
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    sqlx::query_scalar(&format!(
        "SELECT label FROM unnest(enum_range(NULL::{enum_type})) WITH ORDINALITY AS e (label, n) ORDER BY n"
    ))
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_operation_enum_lists_operation_all_in_order() {
    let fx = Fx::new().await;
    let decoded: Vec<Operation> = decoded(&fx.pool, "oncepay_operation").await;
    assert_eq!(decoded, Operation::ALL);
    assert_eq!(
        labels(&fx.pool, "oncepay_operation").await,
        ["pay", "refund", "deposit", "open_account", "transfer"]
    );
}

#[tokio::test]
async fn the_decline_enum_lists_the_codes_of_decline_all_in_order() {
    let fx = Fx::new().await;
    let codes: Vec<&str> = Decline::ALL.iter().map(|d| d.code().as_str()).collect();
    assert_eq!(labels(&fx.pool, "oncepay_decline").await, codes);
    let decoded: Vec<Decline> = decoded(&fx.pool, "oncepay_decline").await;
    assert_eq!(decoded, Decline::ALL);
}

#[tokio::test]
async fn the_outcome_enum_names_every_claim_outcome_in_order() {
    use ClaimOutcome::*;
    // Fails to compile when a variant is added, so the list below stays complete.
    let every = |o: ClaimOutcome| match o {
        Created | Replayed | Declined | KeyReused | Expired => o,
    };
    let fx = Fx::new().await;
    let decoded: Vec<ClaimOutcome> = decoded(&fx.pool, "oncepay_outcome").await;
    assert_eq!(decoded, [Created, Replayed, Declined, KeyReused, Expired].map(every));
    assert_eq!(
        labels(&fx.pool, "oncepay_outcome").await,
        ["created", "replayed", "declined", "key_reused", "expired"]
    );
}
