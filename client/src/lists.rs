//! The lists of docs/api.md: `GET /payments`, `/transfers`, `/top-ups`, `/accounts`,
//! `/events` and `/webhook-endpoints/{id}/attempts`, each a typed call that reads one page
//! ([`ListRequest::page`]) or every item, page after page, as a stream
//! ([`ListRequest::stream`]):
//!
//! ```no_run
//! # async fn example(client: oncepay_client::Client) -> Result<(), oncepay_client::ClientError> {
//! use futures_util::TryStreamExt as _;
//! use oncepay_client::{ListParams, PaymentListParams};
//!
//! let monday = "2026-11-30T00:00:00Z".parse().unwrap();
//! let saturday = "2026-12-05T00:00:00Z".parse().unwrap();
//! let params = PaymentListParams {
//!     account: Some("u1".to_owned()),
//!     list: ListParams { created_gte: Some(monday), created_lt: Some(saturday), ..ListParams::default() },
//!     ..PaymentListParams::default()
//! };
//! let payments: Vec<_> = client.payments().list(params).stream().try_collect().await?;
//! # Ok(()) }
//! ```
//!
//! Items come newest first. A stream follows `has_more` with the last item's id as the next
//! page's `starting_after` (with `ending_before`, toward newer items: the first item's id as
//! the next `ending_before`); each page is one GET, retried like every call of the client.
//! Paging is stable while the tenant keeps writing: an item that existed when the stream began
//! comes exactly once.

use std::marker::PhantomData;

use chrono::{DateTime, Utc};
use futures_util::stream::{self, Stream, TryStreamExt as _};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::calls::{Account, PaymentState};
use crate::error::ClientError;
use crate::protocol::routes::{self, Route};
use crate::top_ups::TopUpState;
use crate::transfers::TransferState;
use crate::webhooks::Event;
use crate::{Client, Reply};

/// A page of a list, newest first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct List<T> {
    /// `list`.
    pub object: String,
    pub data: Vec<T>,
    /// More items lie beyond this page in the direction it was read.
    pub has_more: bool,
    /// The list's path.
    pub url: String,
}

/// What every list takes. Times are whole seconds (a fraction is dropped).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListParams {
    /// Items per page, 1 to 100 (the server's default, 10, when `None`).
    pub limit: Option<u32>,
    /// The id of an item of the list: the items older than it.
    pub starting_after: Option<String>,
    /// The id of an item of the list: the items newer than it.
    pub ending_before: Option<String>,
    pub created_gte: Option<DateTime<Utc>>,
    pub created_gt: Option<DateTime<Utc>>,
    pub created_lte: Option<DateTime<Utc>>,
    pub created_lt: Option<DateTime<Utc>>,
}

impl ListParams {
    fn query(&self) -> Vec<(&'static str, String)> {
        let mut query = Vec::new();
        if let Some(limit) = self.limit {
            query.push(("limit", limit.to_string()));
        }
        if let Some(id) = &self.starting_after {
            query.push(("starting_after", id.clone()));
        }
        if let Some(id) = &self.ending_before {
            query.push(("ending_before", id.clone()));
        }
        for (name, at) in [
            ("created[gte]", self.created_gte),
            ("created[gt]", self.created_gt),
            ("created[lte]", self.created_lte),
            ("created[lt]", self.created_lt),
        ] {
            if let Some(at) = at {
                query.push((name, at.timestamp().to_string()));
            }
        }
        query
    }
}

/// `GET /payments`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PaymentListParams {
    /// Only this account's payments.
    pub account: Option<String>,
    /// `succeeded` or `refunded`.
    pub status: Option<String>,
    pub list: ListParams,
}

/// `GET /transfers`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferListParams {
    /// Only the transfers with this account on either side.
    pub account: Option<String>,
    pub list: ListParams,
}

/// `GET /top-ups`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopUpListParams {
    /// `processing`, `succeeded`, `failed` or `refunded`.
    pub status: Option<String>,
    pub list: ListParams,
}

/// `GET /events`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventListParams {
    /// Only events of this type (`payment.succeeded`, ...).
    pub event_type: Option<String>,
    pub list: ListParams,
}

/// `GET /webhook-endpoints/{id}/attempts`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttemptListParams {
    /// `failed` (no 2xx: another status, or no answer) or `succeeded`.
    pub outcome: Option<String>,
    pub list: ListParams,
}

/// `GET /webhook-endpoints/{id}/attempts`: one attempt to deliver an event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    /// `<event id>.<attempt number>`.
    pub id: String,
    /// The event, its `webhook-id`.
    pub event_id: Uuid,
    #[serde(serialize_with = "crate::time::rfc3339")]
    pub attempted_at: DateTime<Utc>,
    /// The receiver's status; `None` when no answer came (see `error`).
    pub status: Option<u16>,
    pub error: Option<String>,
    pub latency_ms: u64,
}

/// An item of a list: its id, the cursor of the next page.
pub trait Listed {
    fn cursor(&self) -> String;
}

impl Listed for PaymentState {
    fn cursor(&self) -> String {
        self.id.to_string()
    }
}

impl Listed for TransferState {
    fn cursor(&self) -> String {
        self.id.to_string()
    }
}

impl Listed for TopUpState {
    fn cursor(&self) -> String {
        self.id.to_string()
    }
}

impl Listed for Account {
    fn cursor(&self) -> String {
        self.id.clone()
    }
}

impl Listed for Event {
    fn cursor(&self) -> String {
        self.id.to_string()
    }
}

impl Listed for Attempt {
    fn cursor(&self) -> String {
        self.id.clone()
    }
}

/// One list with its parameters: read a page, or stream every item.
#[must_use = "a list request does nothing until `.page()` or `.stream()`"]
pub struct ListRequest<T> {
    client: Client,
    segments: Vec<String>,
    filters: Vec<(&'static str, String)>,
    params: ListParams,
    item: PhantomData<fn() -> T>,
}

impl<T> Clone for ListRequest<T> {
    fn clone(&self) -> Self {
        Self {
            client: self.client.clone(),
            segments: self.segments.clone(),
            filters: self.filters.clone(),
            params: self.params.clone(),
            item: PhantomData,
        }
    }
}

impl<T: DeserializeOwned + Listed + Send + 'static> ListRequest<T> {
    fn new(
        client: &Client,
        route: Route,
        params: &[&str],
        filters: Vec<(&'static str, String)>,
        list: ListParams,
    ) -> Self {
        Self {
            client: client.clone(),
            segments: route.segments_with(params).into_iter().map(str::to_owned).collect(),
            filters,
            params: list,
            item: PhantomData,
        }
    }

    /// The page these parameters name.
    pub async fn page(&self) -> Result<Reply<List<T>>, ClientError> {
        let segments: Vec<&str> = self.segments.iter().map(String::as_str).collect();
        let mut call = self.client.get_call(&segments)?;
        call.url
            .query_pairs_mut()
            .extend_pairs(self.params.query())
            .extend_pairs(self.filters.iter().map(|(k, v)| (*k, v.as_str())));
        if call.url.query() == Some("") {
            call.url.set_query(None);
        }
        self.client.execute(call).await
    }

    /// Every item from the page these parameters name on, page after page while `has_more`
    /// (an error ends the stream after it is yielded).
    pub fn stream(self) -> impl Stream<Item = Result<T, ClientError>> + Send {
        stream::try_unfold(Some(self), |request| async move {
            let Some(request) = request else {
                return Ok(None);
            };
            let page = request.page().await?.value;
            let newer = request.params.ending_before.is_some();
            let next = if newer { page.data.first() } else { page.data.last() }
                .filter(|_| page.has_more)
                .map(Listed::cursor)
                .map(|cursor| {
                    let mut next = request.clone();
                    if newer {
                        next.params.ending_before = Some(cursor);
                    } else {
                        next.params.starting_after = Some(cursor);
                    }
                    next
                });
            Ok(Some((stream::iter(page.data.into_iter().map(Ok)), next)))
        })
        .try_flatten()
    }
}

/// A list of the tenant's: `client.payments()`, `client.events()`, ...
pub struct Lists<'a, T> {
    client: &'a Client,
    route: Route,
    item: PhantomData<fn() -> T>,
}

impl Client {
    /// `GET /payments`.
    pub fn payments(&self) -> Lists<'_, PaymentState> {
        self.lists(routes::LIST_PAYMENTS)
    }

    /// `GET /transfers`.
    pub fn transfers(&self) -> Lists<'_, TransferState> {
        self.lists(routes::LIST_TRANSFERS)
    }

    /// `GET /top-ups`.
    pub fn top_ups(&self) -> Lists<'_, TopUpState> {
        self.lists(routes::LIST_TOP_UPS)
    }

    /// `GET /accounts`.
    pub fn accounts(&self) -> Lists<'_, Account> {
        self.lists(routes::LIST_ACCOUNTS)
    }

    /// `GET /events`: the events kept (the server's `ONCEPAY_EVENT_RETENTION_DAYS`).
    pub fn events(&self) -> Lists<'_, Event> {
        self.lists(routes::LIST_EVENTS)
    }

    /// `GET /webhook-endpoints/{id}/attempts`: the endpoint's delivery attempts.
    pub fn webhook_attempts(&self, endpoint: Uuid, params: AttemptListParams) -> ListRequest<Attempt> {
        let filters = params.outcome.map(|o| ("outcome", o)).into_iter().collect();
        ListRequest::new(
            self,
            routes::LIST_WEBHOOK_ATTEMPTS,
            &[&endpoint.to_string()],
            filters,
            params.list,
        )
    }

    fn lists<T>(&self, route: Route) -> Lists<'_, T> {
        Lists {
            client: self,
            route,
            item: PhantomData,
        }
    }
}

impl Lists<'_, PaymentState> {
    pub fn list(&self, params: PaymentListParams) -> ListRequest<PaymentState> {
        let filters = [("account", params.account), ("status", params.status)]
            .into_iter()
            .filter_map(|(name, value)| Some((name, value?)))
            .collect();
        ListRequest::new(self.client, self.route, &[], filters, params.list)
    }
}

impl Lists<'_, TransferState> {
    pub fn list(&self, params: TransferListParams) -> ListRequest<TransferState> {
        let filters = params.account.map(|a| ("account", a)).into_iter().collect();
        ListRequest::new(self.client, self.route, &[], filters, params.list)
    }
}

impl Lists<'_, TopUpState> {
    pub fn list(&self, params: TopUpListParams) -> ListRequest<TopUpState> {
        let filters = params.status.map(|s| ("status", s)).into_iter().collect();
        ListRequest::new(self.client, self.route, &[], filters, params.list)
    }
}

impl Lists<'_, Account> {
    pub fn list(&self, params: ListParams) -> ListRequest<Account> {
        ListRequest::new(self.client, self.route, &[], Vec::new(), params)
    }
}

impl Lists<'_, Event> {
    pub fn list(&self, params: EventListParams) -> ListRequest<Event> {
        let filters = params.event_type.map(|t| ("type", t)).into_iter().collect();
        ListRequest::new(self.client, self.route, &[], filters, params.list)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_parameters_are_stripes_in_whole_seconds() {
        let params = ListParams {
            limit: Some(5),
            starting_after: Some("p1".to_owned()),
            created_gte: "2026-01-01T00:00:00.9Z".parse().ok(),
            created_lt: "2026-01-02T00:00:00Z".parse().ok(),
            ..ListParams::default()
        };
        assert_eq!(
            params.query(),
            [
                ("limit", "5".to_owned()),
                ("starting_after", "p1".to_owned()),
                ("created[gte]", "1767225600".to_owned()),
                ("created[lt]", "1767312000".to_owned()),
            ]
        );
    }
}
