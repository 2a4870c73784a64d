// Its results go to stdout and its one-line errors to stderr: the command line's interface.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use anyhow::Context;
use clap::{Parser, Subcommand};

use oncepay::config::Settings;
use oncepay::domain::{MissingKeyPolicy, OpeningBalance, TenantId};
use oncepay::startup::Application;
use oncepay::{audit, db, purge, telemetry, tenants};
use oncepay_client::cli::ClientCommand;

/// mimalloc, not glibc's malloc: every request allocates and frees a few dozen small buffers
/// (headers, rows, JSON), and glibc spent 7-9 % of the server's instructions on them, more on
/// a list page's freed 20 KB buffers (`malloc_consolidate`). `make callgrind` at eb565a8 and
/// with mimalloc: a new payment 139.5k -> 129.0k instructions, a replay 71.8k -> 65.5k, a list
/// page 695k -> 647k (docs/bench/README.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// oncepay: a payment API whose retried requests never charge twice.
#[derive(Parser)]
#[command(version = oncepay::VERSION, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(flatten)]
    Server(ServerCommand),
    #[command(flatten)]
    Client(ClientCommand),
    /// Print the OpenAPI document of the HTTP API (the one served at `/openapi.json`).
    Openapi,
}

/// The commands that work on the database (they need DATABASE_URL).
#[derive(Subcommand)]
enum ServerCommand {
    /// Run the HTTP API on the database at DATABASE_URL (waits for it, answering 503
    /// meanwhile; stops on a schema that is behind). Settings: ONCEPAY_* (README.md).
    Serve,
    /// Apply the embedded migrations to DATABASE_URL (safe to run twice or concurrently).
    Migrate,
    /// Delete, on DATABASE_URL, idempotency-key rows older than the key retention
    /// (ONCEPAY_RETENTION_SECS, or a server's longer one) and past their window (prints
    /// `deleted=N`), and webhook events older than ONCEPAY_EVENT_RETENTION_DAYS.
    Purge,
    /// Reconcile balances, key rows and effects on DATABASE_URL (docs/audit.md). Exit 0
    /// clean (warnings allowed), 3 when an invariant is broken, 1 when the audit could not
    /// run.
    Audit {
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
        /// Audit one tenant only.
        #[arg(long)]
        tenant: Option<uuid::Uuid>,
        /// Keyless payments this close (same tenant, account, amount) are suspected duplicates.
        #[arg(long, default_value_t = 5)]
        duplicate_window_secs: u64,
        /// Example rows listed per finding.
        #[arg(long, default_value_t = 20)]
        samples: i64,
    },
    /// Manage the tenants of the database at DATABASE_URL.
    #[command(subcommand)]
    Tenant(TenantCommand),
}

#[derive(Subcommand)]
enum TenantCommand {
    /// Create a tenant with its `main` account; prints its API key (shown only once).
    Create {
        /// The tenant's name, for people (its id, printed, is what identifies it).
        #[arg(long)]
        name: String,
        /// What a request without Idempotency-Key gets: reject (400), allow (processed,
        /// unprotected) or fingerprint (deduplicated by a key derived from the body).
        #[arg(long, value_enum, default_value = "reject")]
        missing_key_policy: PolicyArg,
        /// The opening balance of its `main` account, in minor units.
        #[arg(long, default_value_t = 0)]
        main_balance: i64,
    },
    /// A tenant's API keys: create one (shown once), list them, revoke one.
    #[command(subcommand)]
    Key(KeyCommand),
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Adds an API key to the tenant; prints it (shown only once). Its other keys stay valid.
    Create {
        /// The tenant's id.
        #[arg(long)]
        tenant: uuid::Uuid,
    },
    /// Prints the tenant's keys (ids, creation, last use, revocation; never a secret).
    List {
        /// The tenant's id.
        #[arg(long)]
        tenant: uuid::Uuid,
    },
    /// Revokes a key: every replica refuses it within one second.
    Revoke {
        /// The tenant's id.
        #[arg(long)]
        tenant: uuid::Uuid,
        /// The key's id (`tenant key list` shows it).
        key_id: uuid::Uuid,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PolicyArg {
    Reject,
    Allow,
    Fingerprint,
}

impl From<PolicyArg> for MissingKeyPolicy {
    fn from(p: PolicyArg) -> Self {
        match p {
            PolicyArg::Reject => Self::Reject,
            PolicyArg::Allow => Self::Allow,
            PolicyArg::Fingerprint => Self::Fingerprint,
        }
    }
}

#[tokio::main]
async fn main() {
    let status = match Cli::parse().command {
        // The client commands talk to a server over HTTP: no database, no server settings.
        Command::Client(command) => oncepay_client::cli::run(command).await,
        // Generated from the code alone: no settings, no database.
        Command::Openapi => {
            print!("{}", oncepay::routes::openapi_document());
            0
        }
        Command::Server(command) => match run(command).await {
            Ok(()) => 0,
            Err(err) => {
                eprintln!("oncepay: {err:#}");
                1
            }
        },
    };
    std::process::exit(status);
}

async fn run(command: ServerCommand) -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    telemetry::init(settings.log_json);
    for name in oncepay::config::unknown_variables(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok())) {
        tracing::warn!(variable = %name, "this ONCEPAY_ variable is not one oncepay reads (misspelled?); it is ignored");
    }
    match command {
        ServerCommand::Serve => {
            let app = Application::build(settings.clone())?;
            tracing::info!(bind = %settings.bind, port = app.port(), https = settings.tls_cert.is_some(), version = oncepay::VERSION, "oncepay listening; ready once the database is reached and its schema checked");
            app.run_until_stopped().await?;
        }
        ServerCommand::Migrate => {
            if settings.db_pooler == oncepay::config::Pooler::Transaction {
                // The migration lock is a session advisory lock, which a transaction-mode
                // pooler would leave on whichever server connection took it.
                tracing::warn!(
                    "oncepay migrate needs a direct connection: point DATABASE_URL at PostgreSQL, not at the pooler"
                );
            }
            let applied = db::migrate(&settings.database_url).await?;
            tracing::info!(applied, "migrations applied");
        }
        ServerCommand::Purge => {
            let db = db::Db::new(&settings)?;
            db::check_schema(&db).await?;
            let purged = purge::purge(&db, purge::Retention::of(&settings), settings.purge_batch_size).await?;
            println!("deleted={}", purged.keys);
        }
        ServerCommand::Audit {
            json,
            tenant,
            duplicate_window_secs,
            samples,
        } => {
            let db = db::Db::new(&settings)?;
            db::check_schema(&db).await?;
            let retention = oncepay::purge::audited_retention(&db, settings.retention).await?;
            let options = audit::Options {
                tenant_id: tenant,
                retention,
                fingerprint_window: settings.fingerprint_window,
                duplicate_window: std::time::Duration::from_secs(duplicate_window_secs),
                samples,
                completer_after: settings.completer_after,
                processor: match &settings.processor {
                    None => None,
                    Some(processor) => Some(oncepay::top_ups::processor::ProcessorClient::new(
                        processor,
                        oncepay::metrics::Metrics::new().processor,
                    )?),
                },
            };
            let report = audit::run(&db, &options).await.context("the audit could not run")?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("{report}");
            }
            if !report.clean {
                std::process::exit(audit::EXIT_BROKEN);
            }
        }
        ServerCommand::Tenant(TenantCommand::Create {
            name,
            missing_key_policy,
            main_balance,
        }) => {
            let main_balance = OpeningBalance::new(main_balance).map_err(|e| anyhow::anyhow!("--main-balance: {e}"))?;
            let name = tenants::check_name(&name).map_err(|e| anyhow::anyhow!("--name: {e}"))?;
            let db = db::Db::new(&settings)?;
            db::check_schema(&db).await?;
            let created = tenants::create(&db, name, missing_key_policy.into(), main_balance)
                .await
                .context("cannot create the tenant")?;
            println!("{}", serde_json::to_string(&created)?);
        }
        ServerCommand::Tenant(TenantCommand::Key(command)) => {
            let db = db::Db::new(&settings)?;
            db::check_schema(&db).await?;
            let unknown = || anyhow::anyhow!("no such tenant or key");
            let out = match command {
                KeyCommand::Create { tenant } => {
                    let created = tenants::create_key(&db, TenantId::from_uuid(tenant))
                        .await?
                        .ok_or_else(unknown)?;
                    serde_json::to_string(&created)?
                }
                KeyCommand::List { tenant } => {
                    let keys = tenants::list_keys(&db, TenantId::from_uuid(tenant))
                        .await?
                        .ok_or_else(unknown)?;
                    serde_json::to_string(&keys)?
                }
                KeyCommand::Revoke { tenant, key_id } => {
                    let key = tenants::revoke_key(&db, TenantId::from_uuid(tenant), key_id)
                        .await?
                        .ok_or_else(unknown)?;
                    serde_json::to_string(&key)?
                }
            };
            println!("{out}");
        }
    }
    Ok(())
}
