//! The lists of docs/api.md: complete and stable while another client writes, newest
//! first, each filter, `created[...]`, both cursors, and a clear 400 for every bad parameter or
//! cursor (the plans are in `list_plans`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::TryStreamExt as _;
use oncepay_client::{Client, ListParams, PaymentListParams};
use serde_json::{json, Value};

use crate::client::{client_for, fast_config};
use oncepay::domain::MissingKeyPolicy;

use crate::support::helpers::{new_key, new_tenant, spawn_app, Answer, TestApp};

/// Every item of a list, paged by `starting_after` with `limit`; the ids, in answer order.
async fn page_through(app: &TestApp, list: &str, limit: u32) -> Vec<String> {
    let mut ids = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..10_000 {
        let separator = if list.contains('?') { '&' } else { '?' };
        let path = match &cursor {
            Some(after) => format!("{list}{separator}limit={limit}&starting_after={after}"),
            None => format!("{list}{separator}limit={limit}"),
        };
        let page = app.get(&path).await;
        assert_eq!(page.status, 200, "{path}: {}", page.body);
        let data = page.body["data"].as_array().unwrap();
        assert!(data.len() <= limit as usize);
        ids.extend(data.iter().map(|item| item["id"].as_str().unwrap().to_owned()));
        if !page.body["has_more"].as_bool().unwrap() {
            return ids;
        }
        cursor = ids.last().cloned();
    }
    panic!("{list} did not end within 10,000 pages");
}

fn ids(page: &Answer) -> Vec<String> {
    page.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item["id"].as_str().unwrap().to_owned())
        .collect()
}

async fn pay_from(app: &TestApp, account: &str, amount: i64) -> String {
    let paid = app
        .post(
            "/payments",
            Some(&new_key()),
            &json!({ "amount": amount, "account": account }),
        )
        .await;
    assert_eq!(paid.status, 201, "{}", paid.body);
    paid.body["id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_list_paged_while_another_client_pays_answers_every_earlier_payment_exactly_once() {
    let app = spawn_app().await;
    let mut before = HashSet::new();
    for _ in 0..45 {
        before.insert(pay_from(&app, "main", 1).await);
    }
    // Another client pays without pause until the paging is done (at most 400 payments).
    let paging = AtomicBool::new(true);
    let inserter = async {
        let mut made = 0;
        while paging.load(Ordering::Acquire) && made < 400 {
            pay_from(&app, "main", 1).await;
            made += 1;
        }
        made
    };
    let reader = async {
        let seen = page_through(&app, "/payments", 4).await;
        paging.store(false, Ordering::Release);
        seen
    };
    let (made, seen) = tokio::join!(inserter, reader);

    assert!(made > 0, "the other client paid while the list was paged");
    let mut counts: HashMap<&String, usize> = HashMap::new();
    for id in &seen {
        *counts.entry(id).or_default() += 1;
    }
    assert!(counts.values().all(|&n| n == 1), "an item answered twice: {counts:?}");
    for id in &before {
        assert_eq!(
            counts.get(id),
            Some(&1),
            "{id}, paid before the paging began, was not answered"
        );
    }
    // Newest first, as the database orders them.
    let stored: Vec<String> = sqlx::query_scalar(
        "SELECT payment_id::text FROM payments WHERE tenant_id = $1 AND payment_id::text = ANY ($2)
          ORDER BY created_at DESC, payment_id DESC",
    )
    .bind(app.tenant_id)
    .bind(&seen)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(seen, stored);
}

#[tokio::test]
async fn the_clients_stream_pages_through_every_payment_of_an_account_while_another_client_pays() {
    let app = spawn_app().await;
    app.open_account("u1", 1_000).await;
    let mut before = HashSet::new();
    for _ in 0..23 {
        before.insert(pay_from(&app, "u1", 1).await.parse::<uuid::Uuid>().unwrap());
        pay_from(&app, "main", 1).await;
    }
    let client: Client = client_for(&app.address, &app, fast_config());
    let paging = AtomicBool::new(true);
    let inserter = async {
        let mut made = 0;
        while paging.load(Ordering::Acquire) && made < 200 {
            pay_from(&app, "u1", 1).await;
            made += 1;
        }
    };
    let reader = async {
        let params = PaymentListParams {
            account: Some("u1".to_owned()),
            list: ListParams {
                limit: Some(5),
                ..ListParams::default()
            },
            ..PaymentListParams::default()
        };
        let seen: Vec<_> = client.payments().list(params).stream().try_collect().await.unwrap();
        paging.store(false, Ordering::Release);
        seen
    };
    let ((), seen) = tokio::join!(inserter, reader);

    assert!(seen.iter().all(|p| p.account == "u1"), "only u1's payments");
    let ids: Vec<_> = seen.iter().map(|p| p.id).collect();
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len(), "none twice");
    assert!(before.iter().all(|id| ids.contains(id)), "every earlier payment of u1");
    assert!(
        seen.windows(2).all(|w| w[0].created_at >= w[1].created_at),
        "newest first"
    );
}

#[tokio::test]
async fn payments_are_filtered_by_account_status_and_creation_time() {
    let app = spawn_app().await;
    app.open_account("u1", 1_000).await;
    let mut by_second = Vec::new();
    for (i, account) in ["main", "u1", "main", "u1"].into_iter().enumerate() {
        let id = pay_from(&app, account, 10).await;
        // Creation times a second apart, at known seconds.
        sqlx::query("UPDATE payments SET created_at = to_timestamp($3::float8 + 0.25) WHERE tenant_id = $1 AND payment_id = $2::uuid")
            .bind(app.tenant_id)
            .bind(&id)
            .bind(1_700_000_000.0 + i as f64)
            .execute(&app.pool)
            .await
            .unwrap();
        by_second.push(id);
    }
    let refunded = app.refund(Some(&new_key()), &by_second[1]).await;
    assert_eq!(refunded.status, 200);

    let all = app.get("/payments").await;
    assert_eq!(ids(&all), by_second.iter().rev().cloned().collect::<Vec<_>>());
    assert_eq!(all.body["object"], "list");
    assert_eq!(all.body["url"], "/payments");
    assert_eq!(all.body["has_more"], false);
    // Each item as GET /payments/{id} shows it.
    let single = app.get(&format!("/payments/{}", by_second[1])).await;
    assert_eq!(all.body["data"][2], single.body);

    let u1 = app.get("/payments?account=u1").await;
    assert_eq!(ids(&u1), [by_second[3].clone(), by_second[1].clone()]);
    let refunded = app.get("/payments?status=refunded").await;
    assert_eq!(ids(&refunded), [by_second[1].clone()]);
    let succeeded = app.get("/payments?status=succeeded&account=u1").await;
    assert_eq!(ids(&succeeded), [by_second[3].clone()]);
    // Whole seconds: lte includes its second (the payment at .25 past it), gt excludes it.
    let window = app
        .get("/payments?created[gte]=1700000001&created[lte]=1700000002")
        .await;
    assert_eq!(ids(&window), [by_second[2].clone(), by_second[1].clone()]);
    let window = app
        .get("/payments?created%5Bgt%5D=1700000001&created%5Blt%5D=1700000003")
        .await;
    assert_eq!(ids(&window), [by_second[2].clone()]);
    let none = app.get("/payments?created[lt]=1700000000").await;
    assert_eq!(ids(&none), Vec::<String>::new());
}

/// A page's items are read and written by code of their own (the page arrives as one row of
/// columns, `ledger::lists::columns`; the payments' `ListItem` writes them): each must read
/// as `GET /payments/{id}` answers it, whatever its times and its account's length, in
/// either direction and filtered by account.
#[tokio::test]
async fn each_listed_payment_reads_as_its_get_answers_it_at_any_time() {
    let app = spawn_app().await;
    let long = "L".repeat(64);
    let accounts = ["main", "a", long.as_str(), "main", long.as_str(), "a"];
    for account in ["a", long.as_str()] {
        app.open_account(account, 1_000).await;
    }
    let times = [
        "1999-12-31 23:59:59.999999+00", // just before PostgreSQL's epoch
        "2000-01-01 00:00:00+00",        // its epoch
        "2000-01-01 00:00:00.000001+00",
        "1970-01-01 00:00:00.5+00",
        "2024-02-29 12:34:56.789+00",
        "9999-12-31 23:59:59.123456+00",
    ];
    for (i, at) in times.iter().enumerate() {
        let id = pay_from(&app, accounts[i], 10 + i as i64).await;
        if i % 2 == 1 {
            assert_eq!(app.refund(Some(&new_key()), &id).await.status, 200);
        }
        sqlx::query(
            "UPDATE payments SET created_at = $3::timestamptz,
                    refunded_at = CASE WHEN refunded_at IS NULL THEN NULL ELSE $3::timestamptz + interval '1.000001 s' END
              WHERE tenant_id = $1 AND payment_id = $2::uuid",
        )
        .bind(app.tenant_id)
        .bind(&id)
        .bind(at)
        .execute(&app.pool)
        .await
        .unwrap();
    }
    let page = app.get("/payments").await;
    assert_eq!(page.status, 200, "{}", page.body);
    let items = page.body["data"].as_array().unwrap();
    assert_eq!(items.len(), times.len());
    for item in items {
        let single = app.get(&format!("/payments/{}", item["id"].as_str().unwrap())).await;
        assert_eq!(*item, single.body);
    }
    assert_eq!(items[0]["created_at"], "9999-12-31T23:59:59.123456Z");
    // Past the year 9999, chrono's own form (a sign before the year).
    assert_eq!(items[0]["refunded_at"], "+10000-01-01T00:00:00.123457Z");
    assert_eq!(items[3]["created_at"], "2000-01-01T00:00:00.000000Z");
    assert_eq!(items[3]["refunded_at"], "2000-01-01T00:00:01.000001Z");
    assert_eq!(items[4]["created_at"], "1999-12-31T23:59:59.999999Z");
    assert_eq!(items[4]["refunded_at"], Value::Null);
    assert_eq!(items[5]["account"], "main");
    // The same items read back from the oldest (newer than it) and by account.
    let oldest = items[5]["id"].as_str().unwrap();
    let newer = app.get(&format!("/payments?ending_before={oldest}")).await;
    assert_eq!(newer.status, 200, "{}", newer.body);
    assert_eq!(newer.body["data"].as_array().unwrap()[..], items[..5]);
    for account in ["a", long.as_str(), "main"] {
        let of_account = app.get(&format!("/payments?account={account}")).await;
        let expected: Vec<&Value> = items.iter().filter(|item| item["account"] == account).collect();
        let listed: Vec<&Value> = of_account.body["data"].as_array().unwrap().iter().collect();
        assert_eq!((listed.len(), listed), (2, expected), "{account}");
    }
}

#[tokio::test]
async fn a_page_before_its_cursor_holds_the_newer_items_newest_first() {
    let app = spawn_app().await;
    let mut made = Vec::new();
    for _ in 0..7 {
        made.push(pay_from(&app, "main", 1).await);
    }
    made.reverse(); // newest first, as listed
    let first = app.get("/payments?limit=3").await;
    assert_eq!(ids(&first), made[..3]);
    assert_eq!(first.body["has_more"], true);
    let second = app.get(&format!("/payments?limit=3&starting_after={}", made[2])).await;
    assert_eq!(ids(&second), made[3..6]);
    let last = app.get(&format!("/payments?limit=3&starting_after={}", made[5])).await;
    assert_eq!(
        (ids(&last), &last.body["has_more"]),
        (made[6..].to_vec(), &json!(false))
    );
    // Back from the last item: the three right before it, still newest first.
    let back = app.get(&format!("/payments?limit=3&ending_before={}", made[6])).await;
    assert_eq!(
        (ids(&back), &back.body["has_more"]),
        (made[3..6].to_vec(), &json!(true))
    );
    let front = app.get(&format!("/payments?limit=3&ending_before={}", made[3])).await;
    assert_eq!(
        (ids(&front), &front.body["has_more"]),
        (made[..3].to_vec(), &json!(false))
    );
}

#[tokio::test]
async fn transfers_of_an_account_on_either_side_accounts_top_ups_and_events_are_listed() {
    let app = spawn_app().await;
    for id in ["a", "b", "c"] {
        app.open_account(id, 100).await;
    }
    let mut transfers = Vec::new();
    for (from, to) in [("a", "b"), ("b", "c"), ("c", "a"), ("b", "a")] {
        let moved = app.transfer(Some(&new_key()), from, to, 1).await;
        assert_eq!(moved.status, 201, "{}", moved.body);
        transfers.push(moved.body["id"].as_str().unwrap().to_owned());
    }
    let of_c = app.get("/transfers?account=c").await;
    assert_eq!(ids(&of_c), [transfers[2].clone(), transfers[1].clone()]);
    let of_a: Vec<String> = page_through(&app, "/transfers?account=a", 1).await;
    assert_eq!(of_a, [transfers[3].clone(), transfers[2].clone(), transfers[0].clone()]);
    let single = app.get(&format!("/transfers/{}", transfers[0])).await;
    assert_eq!(app.get("/transfers").await.body["data"][3], single.body);

    let accounts = app.get("/accounts").await;
    assert_eq!(ids(&accounts), ["c", "b", "a", "main"]);
    assert_eq!(accounts.body["data"][0], app.get("/accounts/c").await.body);
    // Each account shows the time the list orders and windows it by.
    let opened: Vec<&str> = accounts.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["created_at"].as_str().expect("every listed account has created_at"))
        .collect();
    assert!(opened.windows(2).all(|w| w[0] >= w[1]), "newest first: {opened:?}");
    let (c_opened, main_opened) = (opened[0], opened[3]);
    let since_c = chrono::DateTime::parse_from_rfc3339(c_opened).unwrap().timestamp();
    let window = app.get(&format!("/accounts?created%5Bgte%5D={since_c}")).await;
    assert!(ids(&window).contains(&"c".to_owned()), "{}", window.body);
    assert_eq!(app.get("/accounts/main").await.body["created_at"], main_opened);
    let page = app.get("/accounts?limit=2&starting_after=b").await;
    assert_eq!(ids(&page), ["a", "main"]);

    // Top-ups, written as the processor's phases leave them (no processor needed to list).
    for (status, seconds) in [("succeeded", 1), ("failed", 2), ("processing", 3)] {
        sqlx::query(
            "INSERT INTO top_ups (tenant_id, top_up_id, account_id, amount, currency, payment_method, status,
                                  recovery_point, balance_after, created_at, updated_at, processor)
             VALUES ($1, gen_random_uuid(), 'main', 5, 'usd', 'pm_card_visa', $2,
                     CASE WHEN $2 = 'processing' THEN 'started' ELSE 'finished' END,
                     CASE WHEN $2 = 'succeeded' THEN 5 END, to_timestamp($3), to_timestamp($3), 'test')",
        )
        .bind(app.tenant_id)
        .bind(status)
        .bind(1_700_000_000.0 + f64::from(seconds))
        .execute(&app.pool)
        .await
        .unwrap();
    }
    let top_ups = app.get("/top-ups").await;
    let statuses: Vec<&Value> = top_ups.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["status"])
        .collect();
    assert_eq!(statuses, [&json!("processing"), &json!("failed"), &json!("succeeded")]);
    let first = top_ups.body["data"][0]["id"].as_str().unwrap();
    assert_eq!(
        top_ups.body["data"][0],
        app.get(&format!("/top-ups/{first}")).await.body
    );
    let failed = app.get("/top-ups?status=failed").await;
    assert_eq!(failed.body["data"].as_array().unwrap().len(), 1);
    assert_eq!(failed.body["data"][0]["status"], "failed");

    // Events exist while an endpoint subscribes: a payment and its refund.
    let hooked = app
        .post(
            "/webhook-endpoints",
            Some(&new_key()),
            &json!({ "url": "http://127.0.0.1:9/hooks" }),
        )
        .await;
    assert_eq!(hooked.status, 201);
    let payment = pay_from(&app, "main", 3).await;
    assert_eq!(app.refund(Some(&new_key()), &payment).await.status, 200);
    let events = app.get("/events").await;
    let types: Vec<&Value> = events.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["type"])
        .collect();
    assert_eq!(types, [&json!("payment.refunded"), &json!("payment.succeeded")]);
    let refunds = app.get("/events?type=payment.refunded").await;
    assert_eq!(refunds.body["data"].as_array().unwrap().len(), 1);
    let event = refunds.body["data"][0]["id"].as_str().unwrap();
    assert_eq!(refunds.body["data"][0], app.get(&format!("/events/{event}")).await.body);
}

#[tokio::test]
async fn a_cursor_that_is_malformed_unknown_or_another_tenants_and_bad_parameters_are_400() {
    let app = spawn_app().await;
    let (_, other) = new_tenant(&app.pool, MissingKeyPolicy::Reject).await;
    let mine = pay_from(&app, "main", 1).await;
    let theirs = app
        .post_as(&other, "/payments", Some(&new_key()), &json!({ "amount": 1 }))
        .await
        .body["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let unknown = uuid::Uuid::new_v4();
    for path in [
        "/payments?starting_after=not-a-uuid".to_owned(),
        format!("/payments?starting_after={unknown}"),
        format!("/payments?ending_before={theirs}"),
        format!("/payments?starting_after={theirs}"),
        format!("/payments?starting_after={mine}&ending_before={mine}"),
        "/payments?limit=0".to_owned(),
        "/payments?limit=101".to_owned(),
        "/payments?limit=".to_owned(),
        "/payments?status=pending".to_owned(),
        "/payments?account=a/b".to_owned(),
        "/payments?created[gte]=monday".to_owned(),
        // Before 1970: the schema's minimum is 0, and no item is that old.
        "/payments?created[lte]=-1".to_owned(),
        "/transfers?created%5Bgt%5D=-5".to_owned(),
        "/payments?sort=asc".to_owned(),
        "/payments?type=payment.succeeded".to_owned(),
        "/accounts?starting_after=no%20such%20id".to_owned(),
        "/accounts?starting_after=ghost".to_owned(),
        "/transfers?starting_after=x".to_owned(),
        "/top-ups?status=lost".to_owned(),
        "/events?type=payment.lost".to_owned(),
        format!("/events?starting_after={unknown}"),
    ] {
        let answer = app.get(&path).await;
        answer.assert_problem(400, "invalid_request");
        assert!(
            answer.body["detail"].as_str().unwrap().len() > 10,
            "{path}: {}",
            answer.body
        );
    }
    // A well-formed cursor that names no item says which parameter it is (found from
    // outside: both read "the cursor").
    for (param, path) in [
        ("starting_after", format!("/payments?starting_after={unknown}")),
        ("ending_before", format!("/payments?ending_before={theirs}")),
        ("ending_before", format!("/events?ending_before={unknown}")),
    ] {
        let detail = app.get(&path).await.body["detail"].as_str().unwrap().to_owned();
        assert!(detail.starts_with(&format!("`{param}`")), "{path}: {detail}");
    }
    // The tenant's own payment is a cursor; the list then ends after it.
    let page = app.get(&format!("/payments?starting_after={mine}")).await;
    assert_eq!((page.status, ids(&page).len()), (200, 0));
    let page = app.get("/payments?limit=100").await;
    assert_eq!(ids(&page), [mine]);
}
