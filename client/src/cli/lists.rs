//! The client commands of the lists (docs/api.md, Lists) and of delivery's repair
//! (docs/webhooks.md, "Delivering again"): the lists (`payments list`, `transfers list`,
//! `top-ups list`, `account list`, `events list`, `webhooks attempts`), each printing every
//! item of every page, one JSON object a line, newest first; the repairs (`webhooks resend`,
//! `webhooks recover`, `webhooks enable`), keyed like every POST; and `get-idempotency-key`.

use chrono::{DateTime, NaiveDate, TimeZone, Utc};
use clap::{Args, Subcommand};
use futures_util::{Stream, TryStreamExt as _};
use serde::Serialize;
use uuid::Uuid;

use super::{client, line_out, print, print_keyed, Failed, KeyArg, ServerArgs};
use crate::lists::Listed;
use crate::{
    AttemptListParams, ClientError, EventListParams, IdempotencyKey, ListParams, PaymentListParams, TopUpListParams,
    TransferListParams,
};

/// What every list command takes.
#[derive(Args)]
pub struct ListArgs {
    /// Only what was created at or after this time: RFC 3339 (2026-11-30T08:00:00Z), a day
    /// (2026-11-30, from its midnight UTC) or Unix seconds.
    #[arg(long, value_parser = parse_time)]
    since: Option<DateTime<Utc>>,
    /// Only what was created before this time (same forms as --since).
    #[arg(long, value_parser = parse_time)]
    until: Option<DateTime<Utc>>,
    /// Items per request, 1 to 100; every page is printed.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// Start after this item (its id): the items older than it.
    #[arg(long)]
    starting_after: Option<String>,
}

impl ListArgs {
    fn params(&self) -> ListParams {
        ListParams {
            limit: Some(self.limit),
            starting_after: self.starting_after.clone(),
            created_gte: self.since,
            created_lt: self.until,
            ..ListParams::default()
        }
    }
}

/// A time as a list command takes it.
/// A fraction of a second is refused: the API filters by whole seconds, so `--since
/// 12:10:08.990` listed a payment of 12:10:08.946, before it (found from outside).
fn parse_time(raw: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(at) = DateTime::parse_from_rfc3339(raw) {
        if at.timestamp_subsec_nanos() != 0 {
            return Err(format!(
                "{raw:?} has a fraction of a second; the API takes whole seconds: give the time without it"
            ));
        }
        return Ok(at.with_timezone(&Utc));
    }
    if let Ok(day) = NaiveDate::parse_from_str(raw, "%Y-%m-%d") {
        if let Some(midnight) = day.and_hms_opt(0, 0, 0) {
            return Ok(Utc.from_utc_datetime(&midnight));
        }
    }
    raw.parse::<i64>()
        .ok()
        .and_then(|secs| Utc.timestamp_opt(secs, 0).single())
        .ok_or_else(|| format!("{raw:?} is not an RFC 3339 time, a day (YYYY-MM-DD) or Unix seconds"))
}

#[derive(Subcommand)]
pub enum PaymentsCommand {
    /// The tenant's payments, newest first: GET /payments, every page.
    List {
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        list: ListArgs,
        /// Only this account's payments.
        #[arg(long)]
        account: Option<String>,
        /// succeeded or refunded.
        #[arg(long)]
        status: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum TransfersCommand {
    /// The tenant's transfers, newest first: GET /transfers, every page.
    List {
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        list: ListArgs,
        /// Only the transfers with this account on either side.
        #[arg(long)]
        account: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum TopUpsCommand {
    /// The tenant's top-ups, newest first: GET /top-ups, every page.
    List {
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        list: ListArgs,
        /// processing, succeeded, failed or refunded.
        #[arg(long)]
        status: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum EventsCommand {
    /// The tenant's events, newest first: GET /events, every page.
    List {
        #[command(flatten)]
        server: ServerArgs,
        #[command(flatten)]
        list: ListArgs,
        /// Only events of this type (payment.succeeded, ...).
        #[arg(long = "type")]
        event_type: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum WebhooksCommand {
    /// An endpoint's delivery attempts, newest first: GET /webhook-endpoints/{id}/attempts.
    Attempts {
        #[command(flatten)]
        server: ServerArgs,
        /// The endpoint's id.
        endpoint: Uuid,
        #[command(flatten)]
        list: ListArgs,
        /// failed (no 2xx) or succeeded.
        #[arg(long)]
        outcome: Option<String>,
    },
    /// Deliver an event once more to an endpoint, with its webhook-id:
    /// POST /webhook-endpoints/{id}/events/{event_id}/resend.
    Resend {
        #[command(flatten)]
        server: ServerArgs,
        /// The endpoint's id.
        endpoint: Uuid,
        /// The event's id (its webhook-id).
        event: Uuid,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Deliver again every event since a time that the endpoint never acknowledged with a
    /// 2xx: POST /webhook-endpoints/{id}/recover.
    Recover {
        #[command(flatten)]
        server: ServerArgs,
        /// The endpoint's id.
        endpoint: Uuid,
        /// From when (same forms as the lists' --since).
        #[arg(long, value_parser = parse_time)]
        since: DateTime<Utc>,
        #[command(flatten)]
        key: KeyArg,
    },
    /// Enable a disabled endpoint: its kept events are delivered:
    /// POST /webhook-endpoints/{id}/enable.
    Enable {
        #[command(flatten)]
        server: ServerArgs,
        /// The endpoint's id.
        endpoint: Uuid,
        #[command(flatten)]
        key: KeyArg,
    },
}

/// Prints every item of a list, one JSON object a line. A list that fails part-way says where
/// to go on from (found from outside: a long export cut at page 3 by a proxy's page had to
/// start over, as nothing named the last item printed).
async fn print_all<T: Serialize + Listed>(items: impl Stream<Item = Result<T, ClientError>>) -> Result<(), Failed> {
    let mut items = std::pin::pin!(items);
    let mut printed: Option<(usize, String)> = None;
    loop {
        let item = match items.try_next().await {
            Ok(Some(item)) => item,
            Ok(None) => return Ok(()),
            Err(error) => {
                if let Some((count, cursor)) = &printed {
                    eprintln!(
                        "oncepay: the list stopped after {count} item(s); to go on from there, run the same command with --starting-after {cursor}"
                    );
                }
                return Err(error.into());
            }
        };
        let json =
            serde_json::to_string(&item).map_err(|source| ClientError::InvalidResponse { status: 200, source })?;
        if !line_out(&json)? {
            return Ok(());
        }
        let count = printed.as_ref().map_or(0, |(count, _)| *count) + 1;
        printed = Some((count, item.cursor()));
    }
}

pub(super) async fn payments(command: PaymentsCommand) -> Result<(), Failed> {
    let PaymentsCommand::List {
        server,
        list,
        account,
        status,
    } = command;
    let params = PaymentListParams {
        account,
        status,
        list: list.params(),
    };
    print_all(client(&server)?.payments().list(params).stream()).await
}

pub(super) async fn transfers(command: TransfersCommand) -> Result<(), Failed> {
    let TransfersCommand::List { server, list, account } = command;
    let params = TransferListParams {
        account,
        list: list.params(),
    };
    print_all(client(&server)?.transfers().list(params).stream()).await
}

pub(super) async fn top_ups(command: TopUpsCommand) -> Result<(), Failed> {
    let TopUpsCommand::List { server, list, status } = command;
    let params = TopUpListParams {
        status,
        list: list.params(),
    };
    print_all(client(&server)?.top_ups().list(params).stream()).await
}

pub(super) async fn accounts(server: &ServerArgs, list: &ListArgs) -> Result<(), Failed> {
    print_all(client(server)?.accounts().list(list.params()).stream()).await
}

pub(super) async fn events(command: EventsCommand) -> Result<(), Failed> {
    let EventsCommand::List {
        server,
        list,
        event_type,
    } = command;
    let params = EventListParams {
        event_type,
        list: list.params(),
    };
    print_all(client(&server)?.events().list(params).stream()).await
}

pub(super) async fn webhooks(command: WebhooksCommand) -> Result<(), Failed> {
    match command {
        WebhooksCommand::Attempts {
            server,
            endpoint,
            list,
            outcome,
        } => {
            let params = AttemptListParams {
                outcome,
                list: list.params(),
            };
            print_all(client(&server)?.webhook_attempts(endpoint, params).stream()).await
        }
        WebhooksCommand::Resend {
            server,
            endpoint,
            event,
            key,
        } => {
            let key = key.resolve()?;
            print_keyed(client(&server)?.resend_webhook_event(endpoint, event, &key).await, &key)
        }
        WebhooksCommand::Recover {
            server,
            endpoint,
            since,
            key,
        } => {
            let key = key.resolve()?;
            print_keyed(
                client(&server)?.recover_webhook_endpoint(endpoint, since, &key).await,
                &key,
            )
        }
        WebhooksCommand::Enable { server, endpoint, key } => {
            let key = key.resolve()?;
            print_keyed(client(&server)?.enable_webhook_endpoint(endpoint, &key).await, &key)
        }
    }
}

pub(super) async fn idempotency_key(server: &ServerArgs, key: &str) -> Result<(), Failed> {
    let key = IdempotencyKey::parse(key)?;
    print(client(server)?.idempotency_key(&key).await?, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc_3339_days_or_unix_seconds() {
        let at = |raw| parse_time(raw).map(|t| t.timestamp());
        assert_eq!(at("2026-01-01T00:00:10Z"), Ok(1_767_225_610));
        assert_eq!(at("2026-01-01T01:00:10+01:00"), Ok(1_767_225_610));
        assert_eq!(at("2026-01-01"), Ok(1_767_225_600));
        assert_eq!(at("1767225600"), Ok(1_767_225_600));
        assert!(at("yesterday").is_err());
    }
}
