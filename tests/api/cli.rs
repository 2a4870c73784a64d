//! The client commands of the real `oncepay` binary against a real server: JSON on stdout,
//! retries, replays and error codes on stderr, the exit status. The child process gets no
//! DATABASE_URL: the client commands must not need one.

use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;

use crate::support::fault_proxy::{lose_the_first_answer, Action, FaultProxy};
use crate::support::helpers::{new_key, spawn_app, TestApp, MAIN_BALANCE};

pub struct Run {
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|_| panic!("stdout is not JSON: {:?}, stderr: {}", self.stdout, self.stderr))
    }
}

/// Runs `oncepay ARGS` with `env` (and no DATABASE_URL), bounded in time.
pub async fn oncepay(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut command = Command::new(env!("CARGO_BIN_EXE_oncepay"));
    command
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("ONCEPAY_URL")
        .env_remove("ONCEPAY_API_KEY")
        .envs(env.iter().copied())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("the command ends within 60 s")
        .expect("the binary runs");
    Run {
        status: output.status.code().expect("exited, not killed"),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Runs the same command twice, as a user retrying by hand, and expects both runs to succeed.
pub async fn run_twice(args: &[&str]) -> (Run, Run) {
    let first = oncepay(args, &[]).await;
    let second = oncepay(args, &[]).await;
    assert_eq!(
        (first.status, second.status),
        (0, 0),
        "{} {}",
        first.stderr,
        second.stderr
    );
    (first, second)
}

pub fn server_args<'a>(url: &'a str, app: &'a TestApp) -> Vec<&'a str> {
    vec!["--url", url, "--api-key", &app.api_key]
}

#[tokio::test]
async fn pay_prints_the_payment_json_and_exits_0() {
    let app = spawn_app().await;
    let mut args = vec!["pay"];
    args.extend(server_args(&app.address, &app));
    args.extend(["--amount", "250"]);

    let run = oncepay(&args, &[]).await;

    assert_eq!(run.status, 0, "stderr: {}", run.stderr);
    let payment = run.json();
    assert_eq!(
        (payment["charged"].as_i64(), payment["balance"].as_i64()),
        (Some(250), Some(MAIN_BALANCE - 250))
    );
    assert_eq!(payment["status"], "succeeded");
    assert!(run.stderr.is_empty(), "nothing to note: {}", run.stderr);
    assert_eq!(app.balance("main").await, MAIN_BALANCE - 250);
}

/// Found from outside: `oncepay payments list | head -1` panicked on the closed pipe (status
/// 101). A reader that has gone ends the command quietly, with status 0, as Unix tools do.
#[tokio::test]
async fn a_list_whose_reader_goes_away_stops_quietly_with_status_0() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let app = spawn_app().await;
    // More than a page (100): the second page is written after the reader has gone.
    for _ in 0..150 {
        assert_eq!(app.pay(Some(&new_key()), 1).await.status, 201);
    }
    let mut args = vec!["payments", "list"];
    args.extend(server_args(&app.address, &app));
    let mut child = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(&args)
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .await
        .unwrap();
    assert!(first.starts_with('{'), "{first}");
    // The reader (and with it the pipe's read end) is gone here.
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the command ends within 60 s")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[tokio::test]
async fn paying_again_with_the_same_key_reports_the_replay_and_charges_once() {
    let app = spawn_app().await;
    let key = new_key();
    let mut args = vec!["pay"];
    args.extend(server_args(&app.address, &app));
    args.extend(["--amount", "100", "--key", &key]);

    let (first, second) = run_twice(&args).await;

    assert_eq!(second.json(), first.json(), "the stored answer");
    assert!(!first.stderr.contains("replayed"), "{}", first.stderr);
    assert!(
        second.stderr.contains("replayed") && second.stderr.contains(&key),
        "{}",
        second.stderr
    );
    assert_eq!(app.payment_count().await, 1);
}

#[tokio::test]
async fn a_refusal_exits_3_with_the_problem_code_on_stderr_after_one_attempt() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |_| Action::Forward).await;
    let amount = (MAIN_BALANCE + 1).to_string();
    let mut args = vec!["pay"];
    args.extend(server_args(&proxy.url, &app));
    args.extend(["--amount", &amount]);

    let run = oncepay(&args, &[]).await;

    assert_eq!(run.status, 3, "stderr: {}", run.stderr);
    assert!(run.stdout.is_empty());
    assert!(
        run.stderr
            .contains("code=insufficient_funds status=402: the account's balance is lower than the amount"),
        "the status and code once, then the detail: {}",
        run.stderr
    );
    assert!(!run.stderr.contains("402 insufficient_funds"), "{}", run.stderr);
    assert_eq!(proxy.seen().len(), 1, "a 402 is not retried");
}

#[tokio::test]
async fn a_lost_answer_is_noted_on_stderr_and_the_retry_is_answered_by_a_replay() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, lose_the_first_answer).await;
    let mut args = vec!["pay"];
    args.extend(server_args(&proxy.url, &app));
    args.extend(["--amount", "100", "--timeout-ms", "2000", "--max-attempts", "3"]);

    let run = oncepay(&args, &[]).await;

    assert_eq!(run.status, 0, "stderr: {}", run.stderr);
    assert_eq!(run.json()["charged"], 100);
    assert!(
        run.stderr.contains("attempt 1 failed (transport_error)"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("replayed"), "{}", run.stderr);
    let seen = proxy.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].key, seen[1].key);
    // Named, so that a run interrupted during its wait can be resumed (found from outside:
    // the note said "with the same key" and never which).
    let key = seen[0].key.clone().expect("a keyed call");
    assert!(
        run.stderr.contains(&format!("with the same key {key}")),
        "{}",
        run.stderr
    );
    assert_eq!(app.payment_count().await, 1);
}

#[tokio::test]
async fn every_command_reads_the_url_and_api_key_from_the_environment() {
    let app = spawn_app().await;
    let env = [
        ("ONCEPAY_URL", app.address.as_str()),
        ("ONCEPAY_API_KEY", app.api_key.as_str()),
    ];

    let deposit = oncepay(&["deposit", "--amount", "500"], &env).await;
    let payment = oncepay(&["pay", "--amount", "300", "--account", "main"], &env).await;
    let id = payment.json()["id"].as_str().unwrap().to_owned();
    let refund = oncepay(&["refund", "--payment", &id], &env).await;
    let state = oncepay(&["get-payment", &id], &env).await;
    let balance = oncepay(&["balance"], &env).await;

    for run in [&deposit, &payment, &refund, &state, &balance] {
        assert_eq!(run.status, 0, "stderr: {}", run.stderr);
    }
    assert_eq!(deposit.json()["balance"], MAIN_BALANCE + 500);
    assert_eq!(refund.json()["refunded"], 300);
    assert_eq!(state.json()["status"], "refunded");
    assert_eq!(
        (&balance.json()["id"], &balance.json()["balance"]),
        (&"main".into(), &(MAIN_BALANCE + 500).into())
    );
}

#[tokio::test]
async fn account_create_opens_the_account_once_and_balance_reads_it_by_its_id() {
    let app = spawn_app().await;
    let env = [
        ("ONCEPAY_URL", app.address.as_str()),
        ("ONCEPAY_API_KEY", app.api_key.as_str()),
    ];
    let key = new_key();

    let created = oncepay(&["account", "create", "u1", "--balance", "500", "--key", &key], &env).await;
    let again = oncepay(&["account", "create", "u1", "--balance", "500", "--key", &key], &env).await;
    let other_key = oncepay(&["account", "create", "u1"], &env).await;
    let empty = oncepay(&["account", "create", "u2"], &env).await;
    let balance = oncepay(&["balance", "u1"], &env).await;

    for run in [&created, &again, &empty, &balance] {
        assert_eq!(run.status, 0, "stderr: {}", run.stderr);
    }
    assert_eq!(
        (&created.json()["id"], &created.json()["balance"]),
        (&"u1".into(), &500.into())
    );
    assert_eq!(again.json(), created.json(), "the stored answer");
    assert!(again.stderr.contains("replayed"), "{}", again.stderr);
    assert_eq!(other_key.status, 3, "stderr: {}", other_key.stderr);
    assert!(
        other_key.stderr.contains("code=account_exists status=409"),
        "{}",
        other_key.stderr
    );
    assert_eq!(empty.json()["balance"], 0);
    assert_eq!(
        balance.json(),
        serde_json::json!({ "id": "u1", "balance": 500, "created_at": created.json()["created_at"] })
    );
}

#[tokio::test]
async fn no_server_exits_4_saying_nothing_was_sent() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);

    let run = oncepay(
        &[
            "pay",
            "--url",
            &url,
            "--api-key",
            "k",
            "--amount",
            "1",
            "--key",
            "order-7",
            "--max-attempts",
            "2",
        ],
        &[],
    )
    .await;

    assert_eq!(run.status, 4, "stderr: {}", run.stderr);
    assert!(run.stderr.contains("code=transport_error"), "{}", run.stderr);
    assert!(run.stderr.contains("attempt 1 failed"), "{}", run.stderr);
    assert!(run.stderr.contains("--key order-7"), "how to resume: {}", run.stderr);
    // Found from outside: "the outcome is unknown", though every connection was refused.
    assert!(run.stderr.contains("nothing was sent"), "{}", run.stderr);
    assert!(!run.stderr.contains("outcome is unknown"), "{}", run.stderr);
}

#[tokio::test]
async fn a_bad_key_or_a_missing_url_is_a_usage_error() {
    let bad_key = oncepay(
        &[
            "pay",
            "--url",
            "http://127.0.0.1:1",
            "--api-key",
            "k",
            "--amount",
            "1",
            "--key",
            "a b",
        ],
        &[],
    )
    .await;
    let no_url = oncepay(&["balance", "--api-key", "k"], &[]).await;

    assert_eq!(bad_key.status, 2, "stderr: {}", bad_key.stderr);
    assert!(bad_key.stderr.contains("code=invalid_argument"), "{}", bad_key.stderr);
    assert_eq!(no_url.status, 2, "stderr: {}", no_url.stderr);
    assert!(no_url.stderr.contains("--url"), "{}", no_url.stderr);
}

/// `pay ARGS...` through `proxy` with retries allowed, as the tests of the client's edges
/// run it.
pub fn pay_args<'a>(proxy: &'a FaultProxy, app: &'a TestApp, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["pay"];
    args.extend(server_args(&proxy.url, app));
    args.extend(["--amount", "100", "--timeout-ms", "2000"]);
    args.extend(more);
    args
}

/// Asserts that `run` ended as an unknown outcome (exit 4) naming the key its first attempt
/// through `proxy` carried, to resume with; returns that key.
pub fn unknown_with_the_key(run: &Run, proxy: &FaultProxy) -> String {
    assert_eq!(run.status, 4, "stderr: {}", run.stderr);
    let key = proxy.seen()[0].key.clone().expect("a keyed call");
    assert!(run.stderr.contains(&format!("--key {key}")), "{}", run.stderr);
    key
}

/// Runs `pay` again through `proxy` with `key`, as the CLI told the user to resume: the
/// stored answer, and still `payments` payments in all.
pub async fn resuming_replays(proxy: &FaultProxy, app: &TestApp, key: &str, payments: i64) {
    let resumed = oncepay(&pay_args(proxy, app, &["--key", key]), &[]).await;
    assert_eq!(resumed.status, 0, "{}", resumed.stderr);
    assert!(resumed.stderr.contains("replayed"), "{}", resumed.stderr);
    assert_eq!(app.payment_count().await, payments);
}

/// Found from outside (2026-12-06): a lost answer, then a 503 whose `Retry-After` is
/// 2^64 - 1 seconds, panicked the CLI (exit 101, "overflow when adding duration to instant")
/// after the payment was made, and the key was never shown. Now the wait is compared with the
/// time left, not added to the clock: exit 4, the server's wait named, the key to resume with.
#[tokio::test]
async fn a_retry_after_of_u64_max_seconds_ends_with_the_key_and_no_panic() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |incoming| match incoming.index {
        0 => Action::DropAnswer,
        1 => Action::Problem {
            status: 503,
            code: "temporarily_unavailable",
            retry_after_secs: Some(u64::MAX),
        },
        _ => Action::Forward,
    })
    .await;

    let run = oncepay(&pay_args(&proxy, &app, &[]), &[]).await;

    let key = unknown_with_the_key(&run, &proxy);
    assert!(
        run.stderr.contains("the server asked to wait more than a year"),
        "{}",
        run.stderr
    );
    assert_eq!(app.payment_count().await, 1, "the first attempt paid");
    resuming_replays(&proxy, &app, &key, 1).await;
}

/// Found from outside: a 201 cut short by a proxy (no `Content-Length`, half the body, then
/// the close) ended the CLI with exit 5 and no key, though the payment was made. Now a
/// success that cannot be read is retried with the same key, and the retry's replay is read.
#[tokio::test]
async fn a_success_cut_short_is_retried_and_answered_by_its_replay() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |incoming| {
        if incoming.index == 0 {
            Action::ForwardThenCutBody
        } else {
            Action::Forward
        }
    })
    .await;

    let run = oncepay(&pay_args(&proxy, &app, &[]), &[]).await;

    assert_eq!(run.status, 0, "stderr: {}", run.stderr);
    assert!(run.stderr.contains("(invalid_response)"), "{}", run.stderr);
    assert!(run.stderr.contains("replayed"), "{}", run.stderr);
    assert_eq!(run.json()["charged"], 100);
    assert_eq!(app.payment_count().await, 1);
}

/// The same, when whatever answers in the server's place never gives JSON (a captive
/// portal's 200): after the last attempt the outcome is unknown, exit 4 with the key.
#[tokio::test]
async fn a_success_that_is_never_json_ends_as_an_unknown_outcome_with_the_key() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |_| Action::PlainBody {
        status: 200,
        body: "<html>portal</html>",
    })
    .await;

    let run = oncepay(&pay_args(&proxy, &app, &["--max-attempts", "2"]), &[]).await;

    unknown_with_the_key(&run, &proxy);
    assert_eq!(proxy.seen().len(), 2);
}

/// Found from outside: the docs call 408 `request_timeout` retryable with the same key, the
/// client called it refused (exit 3).
#[tokio::test]
async fn a_408_request_timeout_is_retried_with_the_same_key() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |incoming| {
        if incoming.index == 0 {
            Action::Problem {
                status: 408,
                code: "request_timeout",
                retry_after_secs: None,
            }
        } else {
            Action::Forward
        }
    })
    .await;

    let run = oncepay(&pay_args(&proxy, &app, &[]), &[]).await;

    assert_eq!(run.status, 0, "stderr: {}", run.stderr);
    let seen = proxy.seen();
    assert_eq!((seen.len(), &seen[0].key), (2, &seen[1].key));
    assert_eq!(app.payment_count().await, 1);
}

/// Found from outside: an error body's control characters reached the terminal as they were
/// (an escape sequence retitled it and cleared the screen; a newline could forge a line of
/// ours). They are written `\u{..}` now.
#[tokio::test]
async fn control_characters_of_an_error_answer_never_reach_the_terminal() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |_| Action::PlainBody {
        status: 502,
        body: "\u{1b}]0;pwned\u{7}\u{1b}[2J\noncepay: forged",
    })
    .await;

    let run = oncepay(&pay_args(&proxy, &app, &["--max-attempts", "1"]), &[]).await;

    assert_eq!(run.status, 4, "stderr: {}", run.stderr);
    assert!(
        !run.stderr.contains('\u{1b}') && !run.stderr.contains('\u{7}'),
        "{:?}",
        run.stderr
    );
    assert!(run.stderr.contains("\\u{1b}]0;pwned"), "{}", run.stderr);
    assert!(
        !run.stderr.lines().any(|l| l.starts_with("oncepay: forged")),
        "{}",
        run.stderr
    );
}

/// Found from outside: with standard output unwritable (`> /dev/full`) the CLI exited 2, "bad
/// usage", after the payment was made, and named no key. Now exit 1 and the key.
#[tokio::test]
async fn an_answer_standard_output_refuses_exits_1_and_names_the_key() {
    let app = spawn_app().await;
    let mut args = vec!["pay"];
    args.extend(server_args(&app.address, &app));
    args.extend(["--amount", "100"]);
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .args(&args)
            .env_remove("DATABASE_URL")
            .stdout(full)
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
            .wait_with_output(),
    )
    .await
    .unwrap()
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);

    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("could not be written to standard output"), "{stderr}");
    let key: String = sqlx::query_scalar("SELECT idempotency_key FROM payments WHERE tenant_id = $1")
        .bind(app.tenant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(stderr.contains(&format!("get-idempotency-key {key}")), "{stderr}");
}

/// Found from outside: `get-idempotency-key ..` asked for `GET /idempotency-keys` (a URL's
/// path drops dot segments, percent-encoded ones too) and reported the key unknown (404).
/// The accounts `.` and `..` are valid ids too, and reached other paths the same way:
/// `balance .` asked for `GET /accounts`, `deposit --account ..` posted to `/deposits`. Now
/// the client refuses any such segment, sending nothing, and says how to ask for it.
#[tokio::test]
async fn the_ids_dot_and_dot_dot_are_not_sent_to_another_path() {
    let app = spawn_app().await;
    let proxy = FaultProxy::start(&app.address, |_| Action::Forward).await;
    for dots in [".", ".."] {
        let encoded = dots.replace('.', "%2E");
        for (args, path) in [
            (
                vec!["get-idempotency-key", dots],
                format!("/idempotency-keys/{encoded}"),
            ),
            (vec!["balance", dots], format!("/accounts/{encoded}")),
            (
                vec!["deposit", "--amount", "1", "--account", dots, "--key", "k-dots"],
                format!("/accounts/{encoded}/deposits"),
            ),
        ] {
            let mut args = args;
            args.extend(server_args(&proxy.url, &app));
            let run = oncepay(&args, &[]).await;
            assert_eq!(run.status, 2, "{args:?}: {}", run.stderr);
            assert!(run.stderr.contains(&path), "{args:?}: {}", run.stderr);
        }
    }
    assert!(proxy.seen().is_empty(), "nothing sent: {:?}", proxy.seen());
}
