//! What the CLI reports when the answer does not settle the operation: a gateway's 5xx, a
//! proxy's page after an unknown outcome, an interrupted run, a resumed one. The rule: once an
//! attempt's outcome is unknown, only oncepay's own answer may say anything else, and the
//! key to resume with is always printed.

use std::time::Duration;

use tokio::process::Command;

use crate::cli::{oncepay, pay_args, resuming_replays, server_args, unknown_with_the_key};
use crate::support::fault_proxy::{first_then, Action, FaultProxy};
use crate::support::helpers::spawn_app;

/// Found from outside: a gateway's 524 (sent after the request reached the server, which
/// paid) was reported as refused, exit 3 and no key; the user ran it again and paid twice.
/// A 5xx that oncepay did not answer is retried with the same key, and when the attempts run
/// out the outcome is unknown: exit 4 with the key.
#[tokio::test]
async fn a_gateways_524_after_the_payment_is_retried_and_never_reported_as_refused() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |incoming| match incoming.index {
        0 | 1 => Action::ForwardThenStatus(524),
        _ => Action::Forward,
    })
    .await;

    let once = oncepay(&pay_args(&proxy, &app, &["--max-attempts", "1"]), &[]).await;
    let retried = oncepay(&pay_args(&proxy, &app, &[]), &[]).await;

    let key = unknown_with_the_key(&once, &proxy);
    assert_eq!(retried.status, 0, "stderr: {}", retried.stderr);
    assert!(
        retried.stderr.contains("attempt 1 failed (http_524)"),
        "{}",
        retried.stderr
    );
    assert!(retried.stderr.contains("replayed"), "{}", retried.stderr);
    // Two operations, each paid once, the first resumed by its key.
    resuming_replays(&proxy, &app, &key, 2).await;
}

/// After an answer lost in transit, a proxy's own 404 page tells nothing of what the first
/// attempt did: the outcome stays unknown (it was "refused", exit 3, though paid).
#[tokio::test]
async fn a_proxys_page_after_a_lost_answer_leaves_the_outcome_unknown() {
    let app = spawn_app().await;
    let page = Action::PlainError { status: 404 };
    let proxy = FaultProxy::start(&app.address, first_then(Action::DropAnswer, page)).await;

    let run = oncepay(&pay_args(&proxy, &app, &[]), &[]).await;

    unknown_with_the_key(&run, &proxy);
    assert!(run.stderr.contains("code=outcome_unknown"), "{}", run.stderr);
    assert_eq!(proxy.seen().len(), 2, "a 404 page is not retried");
    assert_eq!(app.payment_count().await, 1, "the first attempt paid");
}

/// Found from outside: a proxy that passed a payment on and then answered its own 403 page
/// (a firewall that inspects answers), or a 308 redirect, made the CLI report "refused", exit
/// 3, and the key the payment was made under was never printed. A first answer that is not
/// oncepay's does not say whether the request reached oncepay: the outcome is unknown, exit 4,
/// with the key (and where a redirect pointed); nothing retried, as the page would come back.
#[tokio::test]
async fn a_proxys_page_or_redirect_to_a_first_attempt_leaves_the_outcome_unknown() {
    let app = spawn_app().await;
    let pages = [
        Action::ForwardThenStatus(403),
        Action::ForwardThenRedirect("https://elsewhere.example/v2/payments"),
    ];
    for (n, page) in pages.into_iter().enumerate() {
        let proxy = FaultProxy::start(&app.address, first_then(page, Action::Forward)).await;

        let run = oncepay(&pay_args(&proxy, &app, &[]), &[]).await;

        let key = unknown_with_the_key(&run, &proxy);
        assert!(run.stderr.contains("code=outcome_unknown"), "{}", run.stderr);
        assert_eq!(proxy.seen().len(), 1, "a page is not retried: {}", run.stderr);
        if n == 1 {
            assert!(
                run.stderr
                    .contains("a redirect to https://elsewhere.example/v2/payments, not followed"),
                "{}",
                run.stderr
            );
        }
        resuming_replays(&proxy, &app, &key, n as i64 + 1).await;
    }
}

/// Found from outside: a proxy that cached a POST answered a new payment with another
/// payment's stored 201, and the CLI printed it as done (exit 0) while nothing was paid. An
/// answer whose account or amount is not what was asked is no answer of this operation's: the
/// outcome is unknown, exit 4 with the key, and resuming with it pays once.
#[tokio::test]
async fn another_operations_answer_is_not_taken_for_this_ones() {
    let app = spawn_app().await;
    let stale = r#"{"id":"01a25120-c006-7fda-977b-3a5ce6b1b025","account":"main","charged":231,"balance":992575,"status":"succeeded","created_at":"2026-12-07T15:30:30.532777Z"}"#;
    let proxy = FaultProxy::start(
        &app.address,
        first_then(
            Action::PlainBody {
                status: 201,
                body: stale,
            },
            Action::Forward,
        ),
    )
    .await;

    let run = oncepay(&pay_args(&proxy, &app, &[]), &[]).await;

    let key = unknown_with_the_key(&run, &proxy);
    assert!(run.stdout.is_empty(), "nothing printed as done: {}", run.stdout);
    assert!(
        run.stderr
            .contains("the answer is another operation's: amount 231 where 100 was asked"),
        "{}",
        run.stderr
    );
    assert_eq!(app.payment_count().await, 0);
    let resumed = oncepay(&pay_args(&proxy, &app, &["--key", &key]), &[]).await;
    assert_eq!(resumed.status, 0, "{}", resumed.stderr);
    assert_eq!(resumed.json()["charged"], 100);
    assert_eq!(app.payment_count().await, 1);
}

/// Found from outside: a proxy's 404 page to `get-idempotency-key`, or its 403 page to
/// `balance`, was "refused", exit 3, where the table promises 5 for a read answered by a
/// page that is not the JSON promised; oncepay's own 404 stays a refusal. And a list cut
/// part-way by such a page printed what it had and said nothing of where to go on from.
#[tokio::test]
async fn a_proxys_page_to_a_read_is_no_answer_and_a_cut_list_says_where_to_go_on() {
    let app = spawn_app().await;
    for _ in 0..12 {
        assert_eq!(app.pay(Some(&crate::support::helpers::new_key()), 1).await.status, 201);
    }
    let proxy = FaultProxy::start(&app.address, |incoming| match incoming.index {
        0 => Action::PlainError { status: 404 },
        1 => Action::PlainError { status: 403 },
        // The list: two pages, then a page of the proxy's.
        4 => Action::PlainError { status: 403 },
        _ => Action::Forward,
    })
    .await;
    let read = |args: &[&str], url: &str| {
        let mut args = args.to_vec();
        args.extend(server_args(url, &app));
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run =
        |args: Vec<String>| async move { oncepay(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]).await };

    let key_page = run(read(&["get-idempotency-key", "never-used"], &proxy.url)).await;
    let balance_page = run(read(&["balance", "main"], &proxy.url)).await;
    let own_404 = run(read(&["get-idempotency-key", "never-used"], &app.address)).await;
    let cut = run(read(&["payments", "list", "--limit", "5"], &proxy.url)).await;

    for page in [&key_page, &balance_page] {
        assert_eq!(page.status, 5, "stderr: {}", page.stderr);
        assert!(page.stderr.contains("no answer could be read"), "{}", page.stderr);
    }
    assert_eq!(own_404.status, 3, "oncepay's own 404: {}", own_404.stderr);
    assert!(own_404.stderr.contains("code=not_found"), "{}", own_404.stderr);
    assert_eq!(cut.status, 5, "stderr: {}", cut.stderr);
    let printed: Vec<serde_json::Value> = cut.stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(printed.len(), 10, "{}", cut.stdout);
    let last = printed[9]["id"].as_str().unwrap();
    assert!(
        cut.stderr.contains(&format!(
            "the list stopped after 10 item(s); to go on from there, run the same command with --starting-after {last}"
        )),
        "{}",
        cut.stderr
    );
    let rest = run(read(
        &["payments", "list", "--limit", "5", "--starting-after", last],
        &proxy.url,
    ))
    .await;
    assert_eq!(rest.status, 0, "stderr: {}", rest.stderr);
    assert_eq!(rest.stdout.lines().count(), 2, "{}", rest.stdout);
}

/// oncepay's own final 5xx keeps its word: a top-up without a card processor is 501
/// `processor_not_configured`, refused at once (exit 3), not retried as a gateway's 501 is.
#[tokio::test]
async fn oncepays_own_501_is_final_and_a_gateways_501_is_retried() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |incoming| match incoming.index {
        1 => Action::PlainError { status: 501 },
        _ => Action::Forward,
    })
    .await;
    let top_up = |more: &'static [&'static str]| {
        let mut args = vec!["top-up", "--amount", "100", "--payment-method", "pm_card_visa"];
        args.extend(server_args(&proxy.url, &app));
        args.extend(more);
        args
    };

    let refused = oncepay(&top_up(&[]), &[]).await;
    let gateway = oncepay(&pay_args(&proxy, &app, &[]), &[]).await;

    assert_eq!(refused.status, 3, "stderr: {}", refused.stderr);
    assert!(
        refused.stderr.contains("code=processor_not_configured status=501"),
        "{}",
        refused.stderr
    );
    assert_eq!(gateway.status, 0, "stderr: {}", gateway.stderr);
    assert!(
        gateway.stderr.contains("attempt 1 failed (http_501)"),
        "{}",
        gateway.stderr
    );
    let seen = proxy.seen();
    assert_eq!(seen.len(), 3, "one attempt for the top-up, two for the payment");
}

/// Found from outside: SIGINT (Ctrl-C) or SIGTERM during the first attempt of a run without
/// `--key` printed nothing, though the payment went through under the generated key, which
/// was then lost. Now the run names its key and how to resume, and exits 130 or 143.
#[tokio::test]
async fn a_run_interrupted_while_its_request_is_out_names_its_key() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |_| Action::DelayAnswer(Duration::from_secs(20))).await;
    let mut args = vec!["pay", "--amount", "100"];
    args.extend(server_args(&proxy.url, &app));
    for (n, (signal, status)) in [("-INT", 130), ("-TERM", 143)].into_iter().enumerate() {
        let child = Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .args(&args)
            .env_remove("DATABASE_URL")
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // The server has processed the request; its answer is held by the proxy.
        while proxy.seen().len() <= n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let pid = child.id().unwrap().to_string();
        assert!(Command::new("kill")
            .args([signal, &pid])
            .status()
            .await
            .unwrap()
            .success());
        let output = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
            .await
            .expect("the run ends on the signal")
            .unwrap();

        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(status), "{signal}: {stderr}");
        let key = proxy.seen()[n].key.clone().unwrap();
        assert!(stderr.contains(&format!("get-idempotency-key {key}")), "{stderr}");
        assert!(stderr.contains(&format!("--key {key}")), "{stderr}");
    }
    assert_eq!(app.payment_count().await, 2, "both runs paid, and named their keys");
}

/// Found from outside: a payment resumed with `--account main` spelled out, after a first run
/// without it, was refused 422 `idempotency_key_reused` ("use a new key for a new operation":
/// a second charge if followed). The CLI now sends the account it means every time, and a 422
/// on a key says to look the key up before taking a new one.
#[tokio::test]
async fn resuming_with_the_default_account_spelled_out_replays_the_payment() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, first_then(Action::DropAnswer, Action::Forward)).await;

    let first = oncepay(&pay_args(&proxy, &app, &["--max-attempts", "1"]), &[]).await;
    let key = unknown_with_the_key(&first, &proxy);
    let spelled = oncepay(&pay_args(&proxy, &app, &["--account", "main", "--key", &key]), &[]).await;
    let other = oncepay(&pay_args(&proxy, &app, &["--account", "u1", "--key", &key]), &[]).await;

    assert_eq!(spelled.status, 0, "stderr: {}", spelled.stderr);
    assert!(spelled.stderr.contains("replayed"), "{}", spelled.stderr);
    assert_eq!(other.status, 3, "stderr: {}", other.stderr);
    assert!(other.stderr.contains("code=idempotency_key_reused"), "{}", other.stderr);
    assert!(
        other.stderr.contains(&format!("`oncepay get-idempotency-key {key}`")),
        "{}",
        other.stderr
    );
    assert_eq!(app.payment_count().await, 1);
}

/// Found from outside: a read whose answer could not be read (a proxy's HTML 200, or every
/// answer lost) exited 4, "outcome unknown", which a read does not have; exit 5, "the
/// server's answer could not be read", was never used.
#[tokio::test]
async fn a_read_without_an_answer_it_can_read_exits_5() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |incoming| match incoming.index {
        0 | 1 => Action::PlainBody {
            status: 200,
            body: "<html>portal</html>",
        },
        _ => Action::DropAnswer,
    })
    .await;
    let mut args = vec!["balance", "--max-attempts", "2"];
    args.extend(server_args(&proxy.url, &app));

    let portal = oncepay(&args, &[]).await;
    let lost = oncepay(&args, &[]).await;

    for run in [&portal, &lost] {
        assert_eq!(run.status, 5, "stderr: {}", run.stderr);
        assert!(run.stderr.contains("no answer could be read"), "{}", run.stderr);
        assert!(!run.stderr.contains("--key"), "a read has no key: {}", run.stderr);
    }
    assert_eq!(proxy.seen().len(), 4);
}
