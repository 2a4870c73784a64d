//! `oncepay_pay_batch` (migrations/V28): a batch of six or more independent payments (no
//! account, no key twice, no derived key) claims, debits and writes for the whole batch in a
//! few statements; any other batch runs item by item. Either way every item must answer, and
//! leave the rows, as `oncepay_pay` alone would in the batch's order. So batches of every
//! shape run twice, on two tenants set up alike: once as the server's batch statement
//! (`Pay::run_batch`) and once item by item in one transaction (`Pay::run`, the function a
//! payment alone calls), and the answers and the rows of the two are compared.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use oncepay::domain::TenantId;
use oncepay::ledger::{Batched, ClaimArgs, Effect, Outcome, Pay, PaymentRow, Refusal, Reply};
use oncepay::operation::Operation;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::{
    args, args_waiting, assert_gave_up_after_200_ms, backend_pid, claim_args, derived_claim, fp, pay,
    wait_until_blocked, Fx, WAIT,
};
use crate::support::helpers::new_key;

/// Accounts a batch takes its items' accounts from, each opened with [`BALANCE`].
const ACCOUNTS: usize = 16;
const BALANCE: i64 = 1_000;
/// Keys made before the batches (replayed, reused); as many again made and then put past
/// their window.
const MADE: usize = 12;

/// One item of a batch, as the test chose it.
#[derive(Clone, Debug)]
struct Item {
    pay: Pay,
    args: ClaimArgs,
}

/// A small deterministic generator (xorshift): the same batches on every run.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn acct(i: usize) -> String {
    format!("acct-{i:02}")
}

/// The payment the made key `j` (and the key `old-j`) was made with, each on an account of
/// its own, so that a batch replaying several stays independent.
fn made_pay(j: usize) -> Pay {
    pay(&made_account(j), 10 + j as i64)
}

fn made_account(j: usize) -> String {
    format!("made-{j:02}")
}

async fn new_tenant(pool: &PgPool) -> TenantId {
    let tenant = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO tenants (tenant_id, name, api_key_hash) VALUES ($1, 'batch twin', sha256($1::text::bytea))",
    )
    .bind(tenant)
    .execute(pool)
    .await
    .unwrap();
    TenantId::from_uuid(tenant)
}

/// A tenant with the accounts, a subscribed endpoint (so created payments write events), the
/// made keys and the keys past their window.
async fn twin(pool: &PgPool) -> TenantId {
    let tenant = new_tenant(pool).await;
    let t = tenant.get();
    sqlx::query(
        "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance)
         SELECT $1, a, $2, $2 FROM unnest($3::text[]) AS a",
    )
    .bind(t)
    .bind(BALANCE)
    .bind(
        (0..ACCOUNTS)
            .map(acct)
            .chain((0..MADE).map(made_account))
            .collect::<Vec<_>>(),
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO webhook_endpoints (tenant_id, endpoint_id, url, secret_encrypted, created_at)
         VALUES ($1, gen_random_uuid(), 'https://example.com/hooks', '\\x00', now())",
    )
    .bind(t)
    .execute(pool)
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    for j in 0..MADE {
        for key in [format!("made-{j}"), format!("old-{j}")] {
            let effect = made_pay(j);
            let outcome = effect
                .run(&mut conn, tenant, &args(&effect, "/payments", &key))
                .await
                .unwrap();
            assert!(
                matches!(outcome.result, Ok(Reply::New(_))),
                "setup payment {key}: {:?}",
                outcome.result
            );
        }
    }
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '2 hours', expires_at = now() - interval '1 hour'
          WHERE tenant_id = $1 AND key LIKE 'old-%'",
    )
    .bind(t)
    .execute(pool)
    .await
    .unwrap();
    tenant
}

/// A batch of `n` items. Independent: each item another account and another key, kinds that
/// keep it so; otherwise any kind, a derived key, an account or a key twice included.
fn batch(dice: &mut Dice, number: usize, n: usize, independent: bool) -> Vec<Item> {
    let mut accounts: Vec<usize> = (0..ACCOUNTS).collect();
    let mut made: Vec<usize> = (0..MADE).collect();
    let mut items: Vec<Item> = Vec::new();
    for i in 0..n {
        let kinds = if independent { 7 } else { 10 };
        let fresh_account = accounts.remove(dice.below(accounts.len()));
        let fresh_made = made.remove(dice.below(made.len()));
        let key = format!("b{number}-i{i}");
        let item = match dice.below(kinds) {
            // New: created, most of the time.
            0..=1 => {
                let effect = pay(&acct(fresh_account), 1 + dice.below(300) as i64);
                Item {
                    args: args(&effect, "/payments", &key),
                    pay: effect,
                }
            }
            2 => {
                let effect = pay(&acct(fresh_account), BALANCE * 5);
                Item {
                    args: args(&effect, "/payments", &key),
                    pay: effect,
                }
            }
            3 => {
                let effect = pay(&format!("ghost-{number}-{i}"), 1);
                Item {
                    args: args(&effect, "/payments", &key),
                    pay: effect,
                }
            }
            4 => {
                // Keyless (policy `allow`).
                let effect = pay(&acct(fresh_account), 1 + dice.below(50) as i64);
                let args = ClaimArgs::new(Operation::Pay.spec(), "/payments".to_owned(), None, WAIT);
                Item { pay: effect, args }
            }
            5 => {
                // A made key: replayed with its own payment, refused with another.
                let key = format!("made-{fresh_made}");
                let effect = if dice.below(2) == 0 {
                    made_pay(fresh_made)
                } else {
                    pay(&acct(fresh_account), 7)
                };
                Item {
                    args: args(&effect, "/payments", &key),
                    pay: effect,
                }
            }
            6 => {
                let effect = made_pay(fresh_made);
                Item {
                    args: args(&effect, "/payments", &format!("old-{fresh_made}")),
                    pay: effect,
                }
            }
            7 => {
                let effect = pay(&acct(fresh_account), 3);
                let claim = derived_claim(fp(&format!("derived-{number}-{i}")));
                let args = claim_args(Operation::Pay, "/payments", &claim, WAIT);
                Item { pay: effect, args }
            }
            // An account twice, or a key twice (the second replays the first in the batch).
            _ if items.is_empty() => {
                let effect = pay(&acct(fresh_account), 5);
                Item {
                    args: args(&effect, "/payments", &key),
                    pay: effect,
                }
            }
            8 => {
                let twin = items[dice.below(items.len())].pay.clone();
                let effect = pay(twin.account.as_str(), 40);
                Item {
                    args: args(&effect, "/payments", &key),
                    pay: effect,
                }
            }
            _ => items[dice.below(items.len())].clone(),
        };
        items.push(item);
    }
    // The dispatcher's order: (tenant, account as bytes, key).
    items.sort_by(|a, b| {
        (a.pay.account.as_str().as_bytes(), a.args.key()).cmp(&(b.pay.account.as_str().as_bytes(), b.args.key()))
    });
    items
}

/// An answer with what differs between two runs taken out (the payment's id and times).
fn answer(outcome: &Outcome<PaymentRow>) -> String {
    let row = |r: &PaymentRow| {
        format!(
            "{} {:?} {:?} {:?} refunded={}",
            r.account_id,
            r.amount,
            r.balance_after,
            r.idempotency_key,
            r.refunded_at.is_some()
        )
    };
    let result = match &outcome.result {
        Ok(Reply::New(r)) => format!("new {}", row(r)),
        Ok(Reply::Replayed(r)) => format!("replayed {}", row(r)),
        Err(Refusal::Declined { decline, replayed }) => format!("declined {decline:?} replayed={replayed}"),
        Err(refusal) => format!("{refusal:?}"),
    };
    format!("{result} expires={}", outcome.expires_at.is_some())
}

/// The tenant's rows, ids and times taken out: balances, key rows, payments, events.
async fn rows(pool: &PgPool, tenant: TenantId) -> String {
    let t = tenant.get();
    let mut all = String::new();
    for (what, query) in [
        ("balances", "SELECT string_agg(account_id || '=' || balance, ' ' ORDER BY account_id) FROM accounts WHERE tenant_id = $1"),
        (
            "keys",
            "SELECT string_agg(concat_ws(',', key, encode(fingerprint, 'hex'), operation, status, error_code,
                                         resource_id IS NOT NULL, expires_at > now()), ' ' ORDER BY key)
               FROM idempotency_keys WHERE tenant_id = $1",
        ),
        (
            "payments",
            "SELECT string_agg(concat_ws(',', account_id, amount, balance_after, idempotency_key), ' '
                               ORDER BY account_id, balance_after)
               FROM payments WHERE tenant_id = $1",
        ),
        (
            "events",
            "SELECT count(*)::text FROM webhook_events e JOIN payments p
                 ON p.tenant_id = e.tenant_id AND p.payment_id = e.event_id
              WHERE e.tenant_id = $1 AND e.event_type = 'payment.succeeded'",
        ),
    ] {
        let text: Option<String> = sqlx::query_scalar(query).bind(t).fetch_one(pool).await.unwrap();
        writeln!(all, "{what}: {}", text.unwrap_or_default()).unwrap();
    }
    all
}

/// The command ids the key rows of `keys` were last written by: one for every row a single
/// statement wrote.
async fn commands(conn: &mut PgConnection, tenant: TenantId, keys: &[&str]) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT DISTINCT cmin::text FROM idempotency_keys WHERE tenant_id = $1 AND key = ANY($2) ORDER BY 1",
    )
    .bind(tenant.get())
    .bind(keys)
    .fetch_all(conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_batch_answers_and_writes_as_its_payments_one_by_one_whatever_its_shape() {
    let fx = Fx::new().await;
    let (batched, one_by_one) = (twin(&fx.pool).await, twin(&fx.pool).await);
    assert_eq!(
        rows(&fx.pool, batched).await,
        rows(&fx.pool, one_by_one).await,
        "set up alike"
    );
    let mut dice = Dice(0x9e37_79b9_7f4a_7c15);
    let mut set_batches = 0;
    for number in 0..40 {
        let independent = number % 2 == 0;
        let n = if independent {
            6 + dice.below(5)
        } else {
            2 + dice.below(9)
        };
        let items = batch(&mut dice, number, n, independent);

        let mut conn = fx.pool.acquire().await.unwrap();
        let refs: Vec<_> = items.iter().map(|i| (batched, &i.args, &i.pay)).collect();
        let answers_batched = Pay::run_batch(&mut conn, &refs).await.expect("the batch runs");

        let mut tx = fx.pool.begin().await.unwrap();
        let mut answers_alone = Vec::new();
        for item in &items {
            answers_alone.push(
                item.pay
                    .run(&mut tx, one_by_one, &item.args)
                    .await
                    .expect("the payment runs"),
            );
        }
        tx.commit().await.unwrap();

        // Each new payment's id is drawn as a UUIDv7 on both paths (migrations/V29).
        for outcome in answers_batched.iter().chain(&answers_alone) {
            if let Ok(Reply::New(row)) = &outcome.result {
                assert_eq!(
                    row.payment_id.get_version_num(),
                    7,
                    "batch {number}: {}",
                    row.payment_id
                );
            }
        }

        let shape: Vec<String> = items
            .iter()
            .map(|i| format!("{} {:?} {:?}", i.pay.account.as_str(), i.args.key(), i.pay.amount))
            .collect();
        assert_eq!(
            answers_batched.iter().map(answer).collect::<Vec<_>>(),
            answers_alone.iter().map(answer).collect::<Vec<_>>(),
            "batch {number}, items {shape:#?}"
        );
        assert_eq!(
            rows(&fx.pool, batched).await,
            rows(&fx.pool, one_by_one).await,
            "batch {number}, items {shape:#?}"
        );

        // The batches that may take the whole-batch path took it: every key they created
        // was written by one statement (item by item, a statement each).
        let created: Vec<&str> = items
            .iter()
            .zip(&answers_batched)
            .filter(|(_, a)| matches!(a.result, Ok(Reply::New(_))))
            .filter_map(|(i, _)| i.args.key())
            .collect();
        if independent && created.len() >= 2 {
            assert_eq!(
                commands(&mut conn, batched, &created).await.len(),
                1,
                "batch {number}: its new keys in one statement"
            );
            assert_eq!(
                commands(&mut conn, one_by_one, &created).await.len(),
                created.len(),
                "batch {number}: one by one, a statement each"
            );
            set_batches += 1;
        }
    }
    assert!(set_batches >= 15, "{set_batches} batches took the whole-batch path");
}

/// Six independent payments with an in-flight wait of `wait`, the first of them already made
/// by another transaction, `original`, still open: its key row and its debit written, not
/// committed. Returns the tenant, the items, the original and the payment it made.
async fn six_behind_an_original(
    fx: &Fx,
    wait: Duration,
) -> (
    TenantId,
    Vec<Item>,
    sqlx::Transaction<'static, sqlx::Postgres>,
    PaymentRow,
) {
    let tenant = twin(&fx.pool).await;
    let items: Vec<Item> = (0..6)
        .map(|i| {
            let effect = pay(&acct(i), 10);
            Item {
                args: args_waiting(&effect, "/payments", &new_key(), wait),
                pay: effect,
            }
        })
        .collect();
    let mut original = fx.pool.begin().await.unwrap();
    let first = items[0].pay.run(&mut original, tenant, &items[0].args).await.unwrap();
    let Ok(Reply::New(made)) = first.result else {
        panic!("the original was not created: {:?}", first.result);
    };
    (tenant, items, original, made)
}

/// In the whole-batch path a key in flight in another transaction is waited for as long as
/// the items may wait, then the statement fails with 55P03 (the dispatcher splits the batch)
/// and leaves nothing: no key, no debit, no payment.
#[tokio::test]
async fn a_batch_meeting_a_key_in_flight_fails_with_55p03_after_the_wait_and_writes_nothing() {
    let fx = Fx::new().await;
    let (tenant, items, original, _) = six_behind_an_original(&fx, Duration::from_millis(200)).await;
    let before = rows(&fx.pool, tenant).await;

    let mut conn = fx.pool.acquire().await.unwrap();
    let refs: Vec<_> = items.iter().map(|i| (tenant, &i.args, &i.pay)).collect();
    let started = Instant::now();
    let err = Pay::run_batch(&mut conn, &refs)
        .await
        .expect_err("the batch must not run past the original");
    let waited = started.elapsed();

    assert_gave_up_after_200_ms(&err, waited, "it");
    assert_eq!(rows(&fx.pool, tenant).await, before, "the batch left nothing");
    original.rollback().await.unwrap();
}

/// When the original commits within the wait, its key's item replays it and the others of
/// the batch are created, in the same statement.
#[tokio::test]
async fn a_batch_meeting_a_key_in_flight_replays_it_once_it_commits() {
    let fx = Fx::new().await;
    let (tenant, items, mut original, made) = six_behind_an_original(&fx, Duration::from_secs(10)).await;
    let original_pid = backend_pid(&mut original).await;
    let mut conn = fx.pool.acquire().await.unwrap();
    let batch_pid = backend_pid(&mut conn).await;

    let batch = tokio::spawn(async move {
        let refs: Vec<_> = items.iter().map(|i| (tenant, &i.args, &i.pay)).collect();
        Pay::run_batch(&mut conn, &refs).await
    });
    wait_until_blocked(&fx.pool, batch_pid, original_pid).await;
    original.commit().await.unwrap();

    let answers = batch.await.unwrap().expect("the batch runs");
    assert_eq!(
        answers[0].result,
        Ok(Reply::Replayed(made)),
        "the original's payment replayed"
    );
    for answer in &answers[1..] {
        assert!(matches!(answer.result, Ok(Reply::New(_))), "{:?}", answer.result);
    }
    // Each account debited once: the original's by the original, the others by the batch.
    for i in 0..6 {
        let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE tenant_id = $1 AND account_id = $2")
            .bind(tenant.get())
            .bind(acct(i))
            .fetch_one(&fx.pool)
            .await
            .unwrap();
        assert_eq!(balance, BALANCE - 10, "{}", acct(i));
    }
}
