//! The books on the final leader against what the clients were told.
//!
//! - lost: an acknowledged operation whose effect or key row is not there, or whose key row
//!   names another resource than the answer did;
//! - charged_twice: a key with more than one effect (two payments, two transfers), or an
//!   effect whose key no client ever sent.
//!
//! The queries are plain runtime SQL (no `.sqlx/` entry): they read the schema of
//! migrations/V1 (payments.idempotency_key, idempotency_keys.resource_id).

use std::collections::{HashMap, HashSet};

use anyhow::{ensure, Context};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Row};
use uuid::Uuid;

use crate::load::{Journal, Kind};

pub struct Verdict {
    pub lost: u64,
    pub charged_twice: u64,
}

pub async fn check(database_url: &str, tenant: Uuid, journal: &Journal) -> anyhow::Result<Verdict> {
    let options: PgConnectOptions = database_url.parse().context("DATABASE_URL")?;
    let mut db = options.connect().await.context("cannot connect to the final leader")?;
    let primary: (bool, Option<String>) = sqlx::query_as("SELECT NOT pg_is_in_recovery(), host(inet_server_addr())")
        .fetch_one(&mut db)
        .await?;
    ensure!(primary.0, "the verification connection did not reach a primary");
    println!("verifying on the final leader at {}", primary.1.unwrap_or_default());

    // key -> resource id of every key row of the tenant.
    let keys: HashMap<String, Option<String>> =
        sqlx::query("SELECT key, resource_id FROM idempotency_keys WHERE tenant_id = $1")
            .bind(tenant)
            .fetch_all(&mut db)
            .await?
            .into_iter()
            .map(|r| (r.get("key"), r.get("resource_id")))
            .collect();
    // payment id -> (key, refunded)
    let mut payments: HashMap<String, (Option<String>, bool)> = HashMap::new();
    let mut payment_keys: HashMap<Option<String>, u64> = HashMap::new();
    for r in sqlx::query(
        "SELECT payment_id::text AS id, idempotency_key, refunded_at IS NOT NULL AS refunded
           FROM payments WHERE tenant_id = $1",
    )
    .bind(tenant)
    .fetch_all(&mut db)
    .await?
    {
        let key: Option<String> = r.get("idempotency_key");
        *payment_keys.entry(key.clone()).or_default() += 1;
        payments.insert(r.get("id"), (key, r.get("refunded")));
    }
    let accounts: HashSet<String> = sqlx::query_scalar("SELECT account_id FROM accounts WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_all(&mut db)
        .await?
        .into_iter()
        .collect();
    let transfers = transfer_keys(&mut db, tenant).await?;

    let acks = journal.acks();
    let mut lost = 0u64;
    for ack in &acks {
        let key_names = keys.get(&ack.key).map(|r| r.as_deref() == Some(ack.resource.as_str()));
        let effect = match ack.kind {
            Kind::Open => accounts.contains(&ack.resource),
            Kind::Pay => payments
                .get(&ack.resource)
                .is_some_and(|(key, _)| key.as_deref() == Some(ack.key.as_str())),
            Kind::Refund => payments.get(&ack.resource).is_some_and(|(_, refunded)| *refunded),
            Kind::Transfer => transfers
                .get(&ack.resource)
                .is_some_and(|key| key.as_deref() == Some(ack.key.as_str())),
        };
        if !(effect && key_names == Some(true)) {
            lost += 1;
            if lost <= 10 {
                println!(
                    "LOST: {:?} key {} resource {} (effect found: {effect}, key row: {key_names:?})",
                    ack.kind, ack.key, ack.resource
                );
            }
        }
    }

    // Every effect must come from one key that a client sent.
    let sent: HashSet<&str> = acks.iter().map(|a| a.key.as_str()).collect();
    let mut charged_twice = 0u64;
    let mut transfer_keys: HashMap<Option<String>, u64> = HashMap::new();
    for key in transfers.values() {
        *transfer_keys.entry(key.clone()).or_default() += 1;
    }
    for (key, count) in payment_keys.iter().chain(transfer_keys.iter()) {
        let extra = match key {
            Some(k) if sent.contains(k.as_str()) || keys.contains_key(k) => count - 1,
            _ => *count, // keyless, or a key no client sent
        };
        if extra > 0 {
            println!("CHARGED TWICE: key {key:?} has {count} effects");
        }
        charged_twice += extra;
    }
    println!(
        "books: {} payments ({} refunded), {} transfers, {} key rows, {} accounts",
        payments.len(),
        payments.values().filter(|(_, r)| *r).count(),
        transfers.len(),
        keys.len(),
        accounts.len()
    );
    Ok(Verdict { lost, charged_twice })
}

/// transfer id -> key, where the schema has transfers (the lead's V4+); empty otherwise.
async fn transfer_keys(db: &mut sqlx::PgConnection, tenant: Uuid) -> anyhow::Result<HashMap<String, Option<String>>> {
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns
                         WHERE table_name = 'transfers' AND column_name = 'idempotency_key')",
    )
    .fetch_one(&mut *db)
    .await?;
    if !exists {
        return Ok(HashMap::new());
    }
    Ok(
        sqlx::query("SELECT transfer_id::text AS id, idempotency_key FROM transfers WHERE tenant_id = $1")
            .bind(tenant)
            .fetch_all(&mut *db)
            .await?
            .into_iter()
            .map(|r| (r.get("id"), r.get("idempotency_key")))
            .collect(),
    )
}
