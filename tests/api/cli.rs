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
    assert!(run.stderr.contains("with the same key"), "{}", run.stderr);
    assert!(run.stderr.contains("replayed"), "{}", run.stderr);
    let seen = proxy.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].key, seen[1].key);
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
        balance.json(),
        serde_json::json!({ "id": "main", "balance": MAIN_BALANCE + 500 })
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
    assert_eq!(balance.json(), serde_json::json!({ "id": "u1", "balance": 500 }));
}

#[tokio::test]
async fn no_server_exits_4_with_transport_error_and_the_key_to_resume_with() {
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
