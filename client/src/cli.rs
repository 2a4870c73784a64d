//! The client commands of the `oncepay` binary: `pay`, `refund`, `deposit`, `transfer`,
//! `top-up`, `refund-top-up`, `account create`, `balance`, `get-payment`, `get-transfer`,
//! `get-top-up`, `get-idempotency-key`, and the lists and repairs of `lists` (`payments list`,
//! `transfers list`, `top-ups list`, `account list`, `events list`,
//! `webhooks attempts|resend|recover|enable`). The answer's JSON goes to stdout (a list: one
//! item a line); retries, replays and errors to stderr. Every read takes the id of what it
//! reads as its argument (`balance u1`, `get-payment ID`, `get-transfer ID`), like
//! `account create ID`.
//!
//! Exit status: 0 success; 1 the answer could not be written to standard output (the operation
//! was done: stderr names its key); 2 bad usage; 3 the server refused the request (oncepay's
//! own final problem; never an answer oncepay did not give, which may come after a proxy
//! passed the request on) or the client refused the server's TLS certificate;
//! 4 the outcome is unknown (no final answer within the attempts, the deadline or the budget,
//! a success whose body could not be read, or `refund-top-up`'s 202 `refund_pending`): run the
//! command again with the same `--key` (stderr says when nothing was sent); 5 a read had no
//! answer it could read, a proxy's page included (a read has no outcome to be unknown); 130 or
//! 143 interrupted by SIGINT or SIGTERM, the key named on stderr.

// The answer and the notes on stdout and stderr are what these commands are for.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::Duration;

use clap::{Args, Subcommand};
use serde::Serialize;
use uuid::Uuid;

use crate::protocol::ProblemCode;
use crate::{Client, ClientConfig, ClientError, IdempotencyKey, Reply, RetryNote};

mod lists;

use lists::{EventsCommand, ListArgs, PaymentsCommand, TopUpsCommand, TransfersCommand, WebhooksCommand};

pub const EXIT_OUTPUT: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_REFUSED: i32 = 3;
pub const EXIT_OUTCOME_UNKNOWN: i32 = 4;
pub const EXIT_INVALID_RESPONSE: i32 = 5;

#[derive(Subcommand)]
pub enum ClientCommand {
    /// Pay: POST /payments with an Idempotency-Key, retried safely; prints the payment.
    Pay {
        #[command(flatten)]
        server: ServerArgs,
        /// Amount in minor units (1 ..= 10^12).
        #[arg(long)]
        amount: i64,
        /// Account to charge (default: main). Always sent, so that a run with `--account main`
        /// and one without are the same request under one key (found from outside: resuming
        /// with it spelled out was refused 422, another body).
        #[arg(long, default_value = "main", hide_default_value = true)]
        account: String,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Refund a whole payment: POST /payments/{id}/refund.
    Refund {
        #[command(flatten)]
        server: ServerArgs,
        /// The payment's id.
        #[arg(long)]
        payment: Uuid,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Deposit: POST /accounts/{id}/deposits.
    Deposit {
        #[command(flatten)]
        server: ServerArgs,
        /// Amount in minor units (1 ..= 10^12).
        #[arg(long)]
        amount: i64,
        /// Account to credit (default: main).
        #[arg(long, default_value = "main", hide_default_value = true)]
        account: String,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Transfer between two accounts of the tenant: POST /transfers.
    Transfer {
        #[command(flatten)]
        server: ServerArgs,
        /// The account debited.
        #[arg(long)]
        from: String,
        /// The account credited.
        #[arg(long)]
        to: String,
        /// Amount in minor units (1 ..= 10^12).
        #[arg(long)]
        amount: i64,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Top up an account from a card: POST /accounts/{id}/top-ups. The card is charged at the
    /// processor at most once, however often this is retried with the same --key.
    TopUp {
        #[command(flatten)]
        server: ServerArgs,
        /// Amount in minor units (1 ..= 10^12).
        #[arg(long)]
        amount: i64,
        /// The processor's payment method (`pm_...`).
        #[arg(long)]
        payment_method: String,
        /// Account to credit (default: main).
        #[arg(long)]
        account: Option<String>,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Refund a whole top-up (debited first, then refunded to the card): POST /top-ups/{id}/refund.
    RefundTopUp {
        #[command(flatten)]
        server: ServerArgs,
        /// The top-up's id.
        #[arg(long)]
        top_up: Uuid,
        #[command(flatten)]
        key: KeyArg,
    },
    /// A top-up's current state: GET /top-ups/{id}.
    GetTopUp {
        #[command(flatten)]
        server: ServerArgs,
        /// The top-up's id.
        id: Uuid,
    },
    /// Accounts of the tenant.
    #[command(subcommand)]
    Account(AccountCommand),
    /// An account's balance: GET /accounts/{id}.
    Balance {
        #[command(flatten)]
        server: ServerArgs,
        /// The account (default: main).
        #[arg(value_name = "ACCOUNT", conflicts_with = "account_flag")]
        account: Option<String>,
        /// The same as the ACCOUNT argument (the form before it existed).
        #[arg(long = "account", value_name = "ACCOUNT", hide = true)]
        account_flag: Option<String>,
    },
    /// A payment's current state: GET /payments/{id}.
    // The id is required unless the hidden --id gives it, which clap's usage line cannot say.
    #[command(override_usage = "oncepay get-payment [OPTIONS] --url <URL> --api-key <API_KEY> <ID>")]
    GetPayment {
        #[command(flatten)]
        server: ServerArgs,
        /// The payment's id.
        #[arg(value_name = "ID", required_unless_present = "id_flag", conflicts_with = "id_flag")]
        id: Option<Uuid>,
        /// The same as the ID argument (the form before it existed).
        #[arg(long = "id", value_name = "ID", hide = true)]
        id_flag: Option<Uuid>,
    },
    /// A transfer: GET /transfers/{id}.
    GetTransfer {
        #[command(flatten)]
        server: ServerArgs,
        /// The transfer's id.
        id: Uuid,
    },
    /// What the requests with an Idempotency-Key did: GET /idempotency-keys/{key}.
    GetIdempotencyKey {
        #[command(flatten)]
        server: ServerArgs,
        /// The key.
        key: String,
    },
    /// Payments of the tenant.
    #[command(subcommand)]
    Payments(PaymentsCommand),
    /// Transfers of the tenant.
    #[command(subcommand)]
    Transfers(TransfersCommand),
    /// Top-ups of the tenant.
    #[command(subcommand)]
    TopUps(TopUpsCommand),
    /// The tenant's event log: the events of the types its webhook endpoints subscribed to
    /// when they happened (no endpoint, no event), kept ONCEPAY_EVENT_RETENTION_DAYS.
    #[command(subcommand)]
    Events(EventsCommand),
    /// Webhook deliveries: attempts, resend, recover, enable.
    #[command(subcommand)]
    Webhooks(WebhooksCommand),
}

#[derive(Subcommand)]
pub enum AccountCommand {
    /// Open an account: POST /accounts with an Idempotency-Key; prints the account.
    Create {
        #[command(flatten)]
        server: ServerArgs,
        /// The account's id: 1..64 of [A-Za-z0-9_.:-].
        id: String,
        /// Its opening balance in minor units (0 ..= 10^12) [default: 0].
        #[arg(long)]
        balance: Option<i64>,
        #[command(flatten)]
        key: KeyArg,
    },
    /// The tenant's accounts, newest first: GET /accounts, every page.
    List {
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        list: ListArgs,
    },
}

#[derive(Args)]
pub struct ServerArgs {
    /// The server's base URL, e.g. http://127.0.0.1:8130 or https://pay.example.com (trusting
    /// the system's roots and those of the PEM file named by ONCEPAY_CA_CERT).
    #[arg(long, env = "ONCEPAY_URL")]
    url: String,
    /// The tenant's API key.
    #[arg(long, env = "ONCEPAY_API_KEY", hide_env_values = true)]
    api_key: String,
    /// Timeout of each attempt, in milliseconds [default: 10000].
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Attempts at most, the first included [default: 6].
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Deadline of the whole operation, all retries included, in milliseconds [default: 30000].
    #[arg(long)]
    deadline_ms: Option<u64>,
}

#[derive(Args)]
pub struct KeyArg {
    /// The operation's Idempotency-Key (default: a new UUID). Reuse it only to resume this
    /// same operation.
    #[arg(long)]
    key: Option<String>,
}

/// Runs a client command; returns the process exit status.
pub async fn run(command: ClientCommand) -> i32 {
    // Listening before anything is sent: a signal that comes while a request may be on its way
    // must find the key (found from outside: Ctrl-C during the first attempt printed nothing,
    // and the payment made under a generated key could be neither looked up nor resumed).
    let interrupted = Interrupted::listen();
    let outcome = tokio::select! {
        outcome = execute(command) => outcome,
        status = interrupted.wait() => return interrupted_with_key(status),
    };
    match outcome {
        Ok(status) => status,
        Err(Failed {
            error: Failure::Client(error),
            key,
        }) => fail(&error, key.as_ref()),
        Err(Failed {
            error: Failure::Output(error),
            key,
        }) => output_failed(&error, key.as_ref()),
    }
}

/// The key of this run's operation, once resolved: what a signal's note names.
static OPERATION_KEY: std::sync::OnceLock<IdempotencyKey> = std::sync::OnceLock::new();

/// SIGINT (Ctrl-C) and SIGTERM, listened for from the start of a run.
struct Interrupted {
    signals: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Interrupted {
    fn listen() -> Self {
        use tokio::signal::unix::{signal, SignalKind};
        let signals = signal(SignalKind::interrupt()).and_then(|int| Ok((int, signal(SignalKind::terminate())?)));
        Self { signals: signals.ok() }
    }

    /// The exit status of the first signal: 128 + its number, as a shell reports a process it
    /// ended (130, 143).
    async fn wait(mut self) -> i32 {
        match &mut self.signals {
            Some((int, term)) => tokio::select! {
                _ = int.recv() => 130,
                _ = term.recv() => 143,
            },
            None => std::future::pending().await,
        }
    }
}

/// A run stopped by a signal: the request may have been sent, so the key is named, as for an
/// unknown outcome.
fn interrupted_with_key(status: i32) -> i32 {
    match OPERATION_KEY.get() {
        Some(key) => eprintln!(
            "oncepay: interrupted; the operation may have been done with key {key}: `oncepay get-idempotency-key {key}` shows what it did; to resume it safely, run the same command with --key {key}"
        ),
        None => eprintln!("oncepay: interrupted"),
    }
    status
}

/// `refund-top-up`: a 202 (`refund_pending`: debited, the processor's refund not finished) is
/// printed as any answer but is not final: stderr says how to look again, and the exit status
/// is 4, as for any operation without a final answer, so that a script never takes a pending
/// refund for a done one.
async fn refund_top_up(server: &ServerArgs, top_up: Uuid, key: &KeyArg) -> Result<i32, Failed> {
    let key = key.resolve()?;
    let reply = client(server)?
        .refund_top_up(top_up, &key)
        .await
        .map_err(|error| Failed {
            error: Failure::Client(Box::new(error)),
            key: Some(key.clone()),
        })?;
    let pending = reply.status == 202;
    print(reply, Some(&key))?;
    if !pending {
        return Ok(0);
    }
    eprintln!(
        "oncepay: not final: the amount is debited and the processor's refund is pending; `oncepay get-top-up {top_up}` shows how it ends, and the same command with --key {key} looks again"
    );
    Ok(EXIT_OUTCOME_UNKNOWN)
}

/// A failure, with the key of the operation it concerns.
struct Failed {
    error: Failure,
    key: Option<IdempotencyKey>,
}

enum Failure {
    /// The operation failed, or its outcome is unknown (boxed: every command's result
    /// carries it).
    Client(Box<ClientError>),
    /// The answer was had, but standard output refused it (a full disk, not a reader gone).
    Output(std::io::Error),
}

impl From<ClientError> for Failed {
    fn from(error: ClientError) -> Self {
        Self {
            error: Failure::Client(Box::new(error)),
            key: None,
        }
    }
}

impl KeyArg {
    /// The operation's key, given or new; the first one a run resolves is the one a signal's
    /// note names (a run has one operation).
    fn resolve(&self) -> Result<IdempotencyKey, ClientError> {
        let key = self
            .key
            .as_deref()
            .map_or_else(|| Ok(IdempotencyKey::generate()), IdempotencyKey::parse)?;
        let _ = OPERATION_KEY.set(key.clone());
        Ok(key)
    }
}

/// Prints the answer of a keyed operation; a failure carries the key to resume it with.
fn print_keyed<T: Serialize>(reply: Result<Reply<T>, ClientError>, key: &IdempotencyKey) -> Result<(), Failed> {
    let reply = reply.map_err(|error| Failed {
        error: Failure::Client(Box::new(error)),
        key: Some(key.clone()),
    })?;
    print(reply, Some(key))
}

/// Runs a command; the exit status of an answered one (0, or 4 for an answer that is not final).
async fn execute(command: ClientCommand) -> Result<i32, Failed> {
    let answered = match command {
        ClientCommand::Pay {
            server,
            amount,
            account,
            key,
        } => {
            let key = key.resolve()?;
            print_keyed(client(&server)?.pay(amount, Some(&account), &key).await, &key)
        }
        ClientCommand::Refund { server, payment, key } => {
            let key = key.resolve()?;
            print_keyed(client(&server)?.refund(payment, &key).await, &key)
        }
        ClientCommand::Deposit {
            server,
            amount,
            account,
            key,
        } => {
            let key = key.resolve()?;
            print_keyed(client(&server)?.deposit(&account, amount, &key).await, &key)
        }
        ClientCommand::Transfer {
            server,
            from,
            to,
            amount,
            key,
        } => {
            let key = key.resolve()?;
            print_keyed(client(&server)?.transfer(&from, &to, amount, &key).await, &key)
        }
        ClientCommand::Account(AccountCommand::Create {
            server,
            id,
            balance,
            key,
        }) => {
            let key = key.resolve()?;
            print_keyed(client(&server)?.open_account(&id, balance, &key).await, &key)
        }
        ClientCommand::Balance {
            server,
            account,
            account_flag,
        } => {
            let account = account.or(account_flag).unwrap_or_else(|| "main".to_owned());
            print(client(&server)?.account(&account).await?, None)
        }
        ClientCommand::GetPayment { server, id, id_flag } => {
            let id = id
                .or(id_flag)
                .ok_or_else(|| ClientError::InvalidArgument("the payment's id is missing".to_owned()))?;
            print(client(&server)?.payment(id).await?, None)
        }
        ClientCommand::GetTransfer { server, id } => print(client(&server)?.get_transfer(id).await?, None),
        ClientCommand::TopUp {
            server,
            amount,
            payment_method,
            account,
            key,
        } => {
            let key = key.resolve()?;
            let reply = client(&server)?
                .top_up(amount, &payment_method, account.as_deref(), &key)
                .await;
            print_keyed(reply, &key)
        }
        ClientCommand::RefundTopUp { server, top_up, key } => return refund_top_up(&server, top_up, &key).await,
        ClientCommand::GetTopUp { server, id } => print(client(&server)?.get_top_up(id).await?, None),
        ClientCommand::GetIdempotencyKey { server, key } => lists::idempotency_key(&server, &key).await,
        ClientCommand::Account(AccountCommand::List { server, list }) => lists::accounts(&server, &list).await,
        ClientCommand::Payments(command) => lists::payments(command).await,
        ClientCommand::Transfers(command) => lists::transfers(command).await,
        ClientCommand::TopUps(command) => lists::top_ups(command).await,
        ClientCommand::Events(command) => lists::events(command).await,
        ClientCommand::Webhooks(command) => lists::webhooks(command).await,
    };
    answered.map(|()| 0)
}

fn client(server: &ServerArgs) -> Result<Client, ClientError> {
    let defaults = ClientConfig::default();
    let config = ClientConfig {
        attempt_timeout: server
            .timeout_ms
            .map_or(defaults.attempt_timeout, Duration::from_millis),
        max_attempts: server.max_attempts.unwrap_or(defaults.max_attempts),
        deadline: server.deadline_ms.map_or(defaults.deadline, Duration::from_millis),
        ..defaults
    };
    Client::builder(&server.url, &server.api_key)
        .config(config)
        .on_retry(note_retry)
        .build()
}

fn note_retry(note: &RetryNote<'_>) {
    eprintln!(
        "oncepay: attempt {} failed ({}): {}; retrying in {} ms{}",
        note.attempt,
        note.error.code(),
        printable(&chain(note.error)),
        note.wait.as_millis(),
        // Named: a run interrupted now is resumed with it.
        note.key
            .map(|key| format!(" with the same key {key}"))
            .unwrap_or_default()
    );
}

/// Writes one line to standard output: `Ok(false)` once its reader has gone (`... | head`),
/// and the command then stops quietly with status 0, as Unix tools do (`println!` panicked:
/// status 101).
fn line_out(line: &str) -> Result<bool, Failed> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(err) => Err(Failed {
            error: Failure::Output(err),
            key: None,
        }),
    }
}

fn print<T: Serialize>(reply: Reply<T>, key: Option<&IdempotencyKey>) -> Result<(), Failed> {
    // With the key: an answer of an operation that was done.
    let json = serde_json::to_string(&reply.value).map_err(|source| Failed {
        error: Failure::Client(Box::new(ClientError::InvalidResponse {
            status: reply.status,
            source,
        })),
        key: key.cloned(),
    })?;
    let written = line_out(&json).map_err(|failed| Failed {
        key: key.cloned(),
        ..failed
    })?;
    if !written {
        return Ok(());
    }
    if reply.attempts > 1 {
        eprintln!("oncepay: answered {} after {} attempts", reply.status, reply.attempts);
    }
    if let (true, Some(key)) = (reply.replayed, key) {
        eprintln!("oncepay: replayed: the server had already processed key {key}; this is its stored answer, nothing was done again");
    }
    Ok(())
}

fn fail(err: &ClientError, key: Option<&IdempotencyKey>) -> i32 {
    let status = err.status().map(|s| format!(" status={s}")).unwrap_or_default();
    // A problem's status and code are on the line already: its detail says the rest.
    let what = match err {
        ClientError::Problem(problem) if problem.detail.is_empty() => "(the answer said nothing more)".to_owned(),
        ClientError::Problem(problem) => problem.detail.clone(),
        _ => chain(err),
    };
    eprintln!(
        "oncepay: error code={}{status}: {}",
        printable(err.code()),
        printable(&what)
    );
    if let ClientError::Problem(problem) = err {
        if let Some(decline_code) = &problem.decline_code {
            eprintln!(
                "oncepay: decline_code={} (the card processor's own reason)",
                printable(decline_code)
            );
        }
        if problem.replayed {
            eprintln!("oncepay: replayed: this failure was stored with the key on its first request");
        }
    }
    let reused = matches!(err, ClientError::Problem(p) if p.oncepay_code() == Some(ProblemCode::IdempotencyKeyReused));
    if let (true, Some(key)) = (reused, key) {
        // The server's detail says to take a new key; for a key that resumes an operation whose
        // outcome was unknown, that would do it twice.
        eprintln!(
            "oncepay: key {key} was first used for a request with another body; if an earlier run with it ended with an unknown outcome, that request may have been done: `oncepay get-idempotency-key {key}` shows what it did, before you take a new key"
        );
    }
    // A read (no key) changes nothing: it has no outcome to be unknown, only an answer that
    // could not be had (found from outside: exit 4, and 5 was never used), and a page that
    // did not come from oncepay is no answer of its (found from outside: a proxy's 404 page
    // to `get-idempotency-key` was "refused", exit 3).
    if key.is_none() && (err.outcome_unknown() || err.answered_in_oncepays_place()) {
        eprintln!("oncepay: no answer could be read; a read changes nothing, so running it again is safe");
        return EXIT_INVALID_RESPONSE;
    }
    if let (true, Some(key)) = (err.outcome_unknown(), key) {
        if err.nothing_sent() {
            // Found from outside: "the outcome is unknown" for a server that refused every
            // connection, when nothing can have been sent.
            eprintln!("oncepay: nothing was sent: no attempt could connect to the server, so the operation was not done; run the same command again (with --key {key}, or without) once it can");
        } else {
            eprintln!("oncepay: the outcome is unknown; to resume this operation safely, run the same command with --key {key}");
        }
        return EXIT_OUTCOME_UNKNOWN;
    }
    match err {
        ClientError::InvalidArgument(_) => EXIT_USAGE,
        ClientError::InvalidResponse { .. } => EXIT_INVALID_RESPONSE,
        _ => EXIT_REFUSED,
    }
}

/// The answer was had but could not be written out: the operation was done, and its key is
/// how to see it again.
fn output_failed(err: &std::io::Error, key: Option<&IdempotencyKey>) -> i32 {
    eprintln!("oncepay: the answer could not be written to standard output: {err}");
    if let Some(key) = key {
        eprintln!(
            "oncepay: the operation was done with key {key}: `oncepay get-idempotency-key {key}` shows what it did, and the same command with --key {key} prints its answer again"
        );
    }
    EXIT_OUTPUT
}

/// Text from the server (or from whatever answered in its place) as it may reach a terminal:
/// control characters written `\u{..}`, so that an answer cannot move the cursor, retitle
/// the window or start a line that looks like one of ours.
fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_unicode().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

/// The error and its causes, so that "connection refused" is not hidden behind reqwest's summary.
fn chain(err: &ClientError) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests;
