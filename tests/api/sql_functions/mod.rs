//! The SQL functions of migrations/V4 (and the top-ups' phases of V23), called directly on real connections, one test per
//! function and outcome: `oncepay_claim` and `oncepay_decline` (raw SQL), each operation's
//! function (through its `oncepay::ledger` effect), the CHECK constraints and the enum types.
//!
//! "Nothing changed" is checked on the rows themselves: every row of the tenant with its
//! `xmin` (a rewritten row gets a new one), and, where a call must not write at all, the
//! transaction it ran in never got a transaction id (`pg_current_xact_id_if_assigned()`).
//!
//! This file holds the fixture and the outcome assertions every operation shares; each subject
//! has a file of its own.

use std::fmt::Debug;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use oncepay::domain::{AccountId, Amount, OpeningBalance, PaymentId, TenantId};
use oncepay::idempotency::{fingerprint, Claim, Fingerprint};
use oncepay::ledger::{ClaimArgs, Deposit, Effect, OpenAccount, Outcome, Pay, Refusal, Reply, Transfer};
use oncepay::operation::{ClaimOutcome, Decline, Operation};
use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool};

use crate::support::helpers::{database_url, new_key, spawn_app};

mod claim;
mod decline;
mod deposit;
mod ids;
mod open_account;
mod pay;
mod pay_batch;
mod refund;
mod schema;
mod top_ups;
mod transfer;

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

/// `err` is the lock timeout (55P03) of a 200 ms in-flight wait for another's key, which
/// `who` waited out, and not much more.
fn assert_gave_up_after_200_ms(err: &sqlx::Error, waited: Duration, who: &str) {
    assert_eq!(sqlstate(err).as_deref(), Some("55P03"), "{err}");
    assert!(waited >= Duration::from_millis(200), "{who} waited only {waited:?}");
    assert!(
        waited < Duration::from_millis(1500),
        "{who} waited {waited:?}, far past 200 ms"
    );
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
    args_waiting(effect, path, key, WAIT)
}

/// [`args`] with an in-flight wait of `wait`.
fn args_waiting<E: Effect + Debug>(effect: &E, path: &str, key: &str, wait: Duration) -> ClaimArgs {
    let claim = client_claim(key, fingerprint("POST", path, &json!(format!("{effect:?}"))));
    claim_args(E::OPERATION, path, &claim, wait)
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
