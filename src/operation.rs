//! The operation table: every idempotent operation of the API, described once.
//!
//! An entry is the single source of an operation's identity (method, canonical path, success
//! status) and of the deterministic failures it can store and replay (its declines, each with
//! its status and problem code). The SQL functions receive these values as parameters
//! (`ledger::ClaimArgs`); the HTTP pipeline (`routes::pipeline`), the OpenAPI document, the
//! audit and the tests all read them from here. The enum types below are PostgreSQL enums
//! (migrations/V4) mapped with `sqlx::Type`; a test checks both sides name the same labels.
//!
//! Problem codes and their statuses are the crate `oncepay-protocol`'s, shared with every
//! client.
//!
//! Adding an operation: a variant and its [`Spec`] here, its SQL function, a
//! `ledger::Effect` and a `routes::pipeline::Endpoint` (ARCHITECTURE.md walks through it).

use oncepay_protocol::{routes, ProblemCode};

/// An idempotent operation (PostgreSQL `oncepay_operation`, stored with each key). In JSON
/// (a rendered statement's argument, `ledger`) by the same label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, sqlx::Type, serde::Serialize)]
#[sqlx(type_name = "oncepay_operation", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    Pay,
    Refund,
    Deposit,
    OpenAccount,
    Transfer,
    TopUp,
    RefundTopUp,
    CreateWebhookEndpoint,
    RotateWebhookSecret,
    EnableWebhookEndpoint,
    ResendWebhookEvent,
    RecoverWebhookEndpoint,
}

/// A deterministic failure (PostgreSQL `oncepay_decline`): stored with the key and replayed
/// like a success. Its label is its problem `code`, in JSON too (a rendered statement's
/// answer, `ledger`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, sqlx::Type, serde::Deserialize)]
#[sqlx(type_name = "oncepay_decline", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Decline {
    InsufficientFunds,
    AccountNotFound,
    NotFound,
    AlreadyRefunded,
    AccountExists,
    /// A top-up the card processor declined.
    CardDeclined,
    /// A top-up whose payment method the card processor refused as invalid.
    InvalidPaymentMethod,
    /// A webhook endpoint past `ONCEPAY_WEBHOOK_MAX_ENDPOINTS`.
    TooManyEndpoints,
    /// A top-up whose request the card processor refused (an amount below its minimum, an
    /// unexpected 4xx): its own code is the top-up's `decline_code`.
    InvalidRequest,
    /// A top-up's refund that the card processor refused or failed; the amount was credited
    /// back.
    RefundFailed,
}

/// What a claim found (PostgreSQL `oncepay_outcome`; in JSON by the same label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::Type, serde::Deserialize)]
#[sqlx(type_name = "oncepay_outcome", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum ClaimOutcome {
    /// The key was new (or absent under policy `allow`): the effect ran.
    Created,
    /// The key was finished: the stored result answers.
    Replayed,
    /// The key was new and the effect declined: the decline is stored.
    Declined,
    /// The key was used with another fingerprint.
    KeyReused,
    /// The key's replay window has passed.
    Expired,
}

/// One row of the operation table.
#[derive(Debug)]
pub struct Spec {
    pub operation: Operation,
    /// Stable name of the operation in the OpenAPI document and logs.
    pub name: &'static str,
    pub method: &'static str,
    /// The canonical path (a route template: `{id}` is a path parameter). Fingerprints and
    /// key rows use it with the parameters filled in.
    pub path: &'static str,
    /// Other paths serving the same operation (fingerprinted as `path`).
    pub aliases: &'static [&'static str],
    pub success_status: u16,
    /// The declines the operation can store, in the order its SQL tries them.
    pub declines: &'static [Decline],
    pub summary: &'static str,
    pub tag: &'static str,
    /// What the key's `resource_id` names (`GET /idempotency-keys/{key}`).
    pub resource: Resource,
}

/// The kind of resource an operation's key names, and the route that reads it (`None`: there
/// is none to read one by its id).
#[derive(Debug)]
pub struct Resource {
    /// Its `type` in `GET /idempotency-keys/{key}`.
    pub kind: &'static str,
    pub read: Option<routes::Route>,
}

const PAYMENT: Resource = Resource {
    kind: "payment",
    read: Some(routes::GET_PAYMENT),
};
const WEBHOOK_ENDPOINT: Resource = Resource {
    kind: "webhook_endpoint",
    read: None,
};
const TOP_UP_RESOURCE: Resource = Resource {
    kind: "top_up",
    read: Some(routes::GET_TOP_UP),
};

const PAY: Spec = Spec {
    operation: Operation::Pay,
    name: "create_payment",
    method: routes::CREATE_PAYMENT.method,
    path: routes::CREATE_PAYMENT.path,
    aliases: &[routes::PAY_ALIAS.path],
    success_status: 201,
    declines: &[Decline::InsufficientFunds, Decline::AccountNotFound],
    summary: "Charges an account, at most once per `Idempotency-Key` (`POST /pay` is an alias).",
    tag: "payments",
    resource: PAYMENT,
};

const REFUND: Spec = Spec {
    operation: Operation::Refund,
    name: "refund_payment",
    method: routes::REFUND_PAYMENT.method,
    path: routes::REFUND_PAYMENT.path,
    aliases: &[],
    success_status: 200,
    declines: &[Decline::NotFound, Decline::AlreadyRefunded],
    summary: "Refunds a whole payment, at most once.",
    tag: "payments",
    resource: PAYMENT,
};

const DEPOSIT: Spec = Spec {
    operation: Operation::Deposit,
    name: "create_deposit",
    method: routes::CREATE_DEPOSIT.method,
    path: routes::CREATE_DEPOSIT.path,
    aliases: &[],
    success_status: 201,
    declines: &[Decline::AccountNotFound],
    summary: "Credits an account, at most once per `Idempotency-Key`.",
    tag: "accounts",
    resource: Resource {
        kind: "deposit",
        read: None,
    },
};

const OPEN_ACCOUNT: Spec = Spec {
    operation: Operation::OpenAccount,
    name: "create_account",
    method: routes::CREATE_ACCOUNT.method,
    path: routes::CREATE_ACCOUNT.path,
    aliases: &[],
    success_status: 201,
    declines: &[Decline::AccountExists],
    summary: "Opens an account, at most once per `Idempotency-Key`.",
    tag: "accounts",
    resource: Resource {
        kind: "account",
        read: Some(routes::GET_ACCOUNT),
    },
};

const TRANSFER: Spec = Spec {
    operation: Operation::Transfer,
    name: "create_transfer",
    method: routes::CREATE_TRANSFER.method,
    path: routes::CREATE_TRANSFER.path,
    aliases: &[],
    success_status: 201,
    declines: &[Decline::InsufficientFunds, Decline::AccountNotFound],
    summary: "Moves an amount between two accounts of the tenant, atomically, at most once per `Idempotency-Key`.",
    tag: "transfers",
    resource: Resource {
        kind: "transfer",
        read: Some(routes::GET_TRANSFER),
    },
};

const TOP_UP: Spec = Spec {
    operation: Operation::TopUp,
    name: "create_top_up",
    method: routes::CREATE_TOP_UP.method,
    path: routes::CREATE_TOP_UP.path,
    aliases: &[],
    success_status: 201,
    declines: &[
        Decline::AccountNotFound,
        Decline::CardDeclined,
        Decline::InvalidPaymentMethod,
        Decline::InvalidRequest,
    ],
    summary: "Charges a card at the processor and credits the account, the card charged at most once and the account credited exactly once iff it was.",
    tag: "top-ups",
    resource: TOP_UP_RESOURCE,
};

const REFUND_TOP_UP: Spec = Spec {
    operation: Operation::RefundTopUp,
    name: "refund_top_up",
    method: routes::REFUND_TOP_UP.method,
    path: routes::REFUND_TOP_UP.path,
    aliases: &[],
    success_status: 200,
    declines: &[
        Decline::NotFound,
        Decline::AlreadyRefunded,
        Decline::InsufficientFunds,
        Decline::RefundFailed,
    ],
    summary: "Debits the top-up's amount from its account, then refunds the card at the processor, at most once; a refund the processor refuses or fails is credited back.",
    tag: "top-ups",
    resource: TOP_UP_RESOURCE,
};

const CREATE_WEBHOOK_ENDPOINT: Spec = Spec {
    operation: Operation::CreateWebhookEndpoint,
    name: "create_webhook_endpoint",
    method: routes::CREATE_WEBHOOK_ENDPOINT.method,
    path: routes::CREATE_WEBHOOK_ENDPOINT.path,
    aliases: &[],
    success_status: 201,
    declines: &[Decline::TooManyEndpoints],
    summary: "Registers a webhook endpoint; the answer shows its `whsec_` signing secret (a replay shows the same one, until the secret is rotated).",
    tag: "webhooks",
    resource: WEBHOOK_ENDPOINT,
};

const ROTATE_WEBHOOK_SECRET: Spec = Spec {
    operation: Operation::RotateWebhookSecret,
    name: "rotate_webhook_secret",
    method: routes::ROTATE_WEBHOOK_SECRET.method,
    path: routes::ROTATE_WEBHOOK_SECRET.path,
    aliases: &[],
    success_status: 200,
    declines: &[Decline::NotFound],
    summary: "Gives an endpoint a new `whsec_` secret; the previous one keeps signing too (two signatures per message) for `overlap_secs` (default a day).",
    tag: "webhooks",
    resource: WEBHOOK_ENDPOINT,
};

const ENABLE_WEBHOOK_ENDPOINT: Spec = Spec {
    operation: Operation::EnableWebhookEndpoint,
    name: "enable_webhook_endpoint",
    method: routes::ENABLE_WEBHOOK_ENDPOINT.method,
    path: routes::ENABLE_WEBHOOK_ENDPOINT.path,
    aliases: &[],
    success_status: 200,
    declines: &[Decline::NotFound],
    summary: "Enables a disabled webhook endpoint: deliveries resume, the events kept while it was disabled first.",
    tag: "webhooks",
    resource: WEBHOOK_ENDPOINT,
};

const RESEND_WEBHOOK_EVENT: Spec = Spec {
    operation: Operation::ResendWebhookEvent,
    name: "resend_webhook_event",
    method: routes::RESEND_WEBHOOK_EVENT.method,
    path: routes::RESEND_WEBHOOK_EVENT.path,
    aliases: &[],
    success_status: 202,
    declines: &[Decline::NotFound],
    summary: "Delivers an event once more to an endpoint, with its `webhook-id`, in its place among its resource's events not yet delivered, with a new retry schedule.",
    tag: "webhooks",
    resource: Resource {
        kind: "event",
        read: Some(routes::GET_EVENT),
    },
};

const RECOVER_WEBHOOK_ENDPOINT: Spec = Spec {
    operation: Operation::RecoverWebhookEndpoint,
    name: "recover_webhook_endpoint",
    method: routes::RECOVER_WEBHOOK_ENDPOINT.method,
    path: routes::RECOVER_WEBHOOK_ENDPOINT.path,
    aliases: &[],
    success_status: 202,
    declines: &[Decline::NotFound],
    summary: "Delivers again every event since `since` that the endpoint was sent and never acknowledged with a 2xx, each with its `webhook-id` and a new retry schedule.",
    tag: "webhooks",
    resource: Resource {
        kind: "webhook_recovery",
        read: None,
    },
};

impl Operation {
    pub const ALL: [Self; 12] = [
        Self::Pay,
        Self::Refund,
        Self::Deposit,
        Self::OpenAccount,
        Self::Transfer,
        Self::TopUp,
        Self::RefundTopUp,
        Self::CreateWebhookEndpoint,
        Self::RotateWebhookSecret,
        Self::EnableWebhookEndpoint,
        Self::ResendWebhookEvent,
        Self::RecoverWebhookEndpoint,
    ];

    pub const fn spec(self) -> &'static Spec {
        match self {
            Self::Pay => &PAY,
            Self::Refund => &REFUND,
            Self::Deposit => &DEPOSIT,
            Self::OpenAccount => &OPEN_ACCOUNT,
            Self::Transfer => &TRANSFER,
            Self::TopUp => &TOP_UP,
            Self::RefundTopUp => &REFUND_TOP_UP,
            Self::CreateWebhookEndpoint => &CREATE_WEBHOOK_ENDPOINT,
            Self::RotateWebhookSecret => &ROTATE_WEBHOOK_SECRET,
            Self::EnableWebhookEndpoint => &ENABLE_WEBHOOK_ENDPOINT,
            Self::ResendWebhookEvent => &RESEND_WEBHOOK_EVENT,
            Self::RecoverWebhookEndpoint => &RECOVER_WEBHOOK_ENDPOINT,
        }
    }
}

impl Decline {
    pub const ALL: [Self; 10] = [
        Self::InsufficientFunds,
        Self::AccountNotFound,
        Self::NotFound,
        Self::AlreadyRefunded,
        Self::AccountExists,
        Self::CardDeclined,
        Self::InvalidPaymentMethod,
        Self::TooManyEndpoints,
        Self::InvalidRequest,
        Self::RefundFailed,
    ];

    /// The problem `code` (its label is also the PostgreSQL enum label).
    pub const fn code(self) -> ProblemCode {
        match self {
            Self::InsufficientFunds => ProblemCode::InsufficientFunds,
            Self::AccountNotFound => ProblemCode::AccountNotFound,
            Self::NotFound => ProblemCode::NotFound,
            Self::AlreadyRefunded => ProblemCode::AlreadyRefunded,
            Self::AccountExists => ProblemCode::AccountExists,
            Self::CardDeclined => ProblemCode::CardDeclined,
            Self::InvalidPaymentMethod => ProblemCode::InvalidPaymentMethod,
            Self::TooManyEndpoints => ProblemCode::TooManyEndpoints,
            Self::InvalidRequest => ProblemCode::InvalidRequest,
            Self::RefundFailed => ProblemCode::RefundFailed,
        }
    }

    /// The HTTP status this decline is answered with (stored with the key): its code's.
    pub const fn status(self) -> u16 {
        self.code().status()
    }

    pub const fn title(self) -> &'static str {
        match self {
            Self::InsufficientFunds => "Insufficient funds",
            Self::AccountNotFound => "Account not found",
            Self::NotFound => "Not found",
            Self::AlreadyRefunded => "Already refunded",
            Self::AccountExists => "Account exists",
            Self::CardDeclined => "Card declined",
            Self::InvalidPaymentMethod => "Invalid payment method",
            Self::TooManyEndpoints => "Too many webhook endpoints",
            Self::InvalidRequest => "Invalid request",
            Self::RefundFailed => "Refund failed",
        }
    }

    pub const fn detail(self) -> &'static str {
        match self {
            Self::InsufficientFunds => "the account's balance is lower than the amount",
            Self::AccountNotFound => "no such account",
            Self::NotFound => "nothing of this tenant's to act on: the path names no resource of this tenant",
            Self::AlreadyRefunded => "it was already refunded",
            Self::AccountExists => "an account with this id already exists",
            Self::CardDeclined => "the card processor declined the charge; nothing was charged",
            Self::InvalidPaymentMethod => {
                "the card processor refused the payment method as invalid; nothing was charged"
            }
            Self::TooManyEndpoints => {
                "the tenant has as many webhook endpoints as the server allows (ONCEPAY_WEBHOOK_MAX_ENDPOINTS); delete one first"
            }
            Self::InvalidRequest => {
                "the card processor refused the request (`decline_code` is its reason); nothing was charged"
            }
            Self::RefundFailed => {
                "the card processor refused the refund or the refund failed there; the amount was credited back to the account (GET /top-ups/{id}: refund_failure_code)"
            }
        }
    }
}

impl Spec {
    /// The detail of a decline of this operation: a 404 names what was not found.
    pub const fn decline_detail(&self, decline: Decline) -> &'static str {
        match (decline, self.operation) {
            (Decline::NotFound, Operation::Refund) => "nothing of this tenant's to act on: no such payment",
            (Decline::NotFound, Operation::RefundTopUp) => {
                "nothing of this tenant's to act on: no such top-up, or a top-up that failed (nothing was charged, so nothing is refunded)"
            }
            (Decline::NotFound, Operation::RotateWebhookSecret | Operation::EnableWebhookEndpoint) => {
                "nothing of this tenant's to act on: no such webhook endpoint (or it was deleted)"
            }
            (Decline::NotFound, Operation::ResendWebhookEvent) => {
                "nothing of this tenant's to act on: no such webhook endpoint, or no such event for it (it is older than the endpoint, of a type it does not subscribe to, or past its retention)"
            }
            (Decline::NotFound, Operation::RecoverWebhookEndpoint) => {
                "nothing of this tenant's to act on: no such webhook endpoint (or it was deleted)"
            }
            _ => decline.detail(),
        }
    }

    /// `{"<decline code>": <status>}` for this operation's declines, as the SQL reads it.
    pub fn decline_statuses(&self) -> serde_json::Value {
        self.declines
            .iter()
            .map(|d| (d.code().as_str().to_owned(), serde_json::Value::from(d.status())))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// The canonical path with its `{id}` filled in.
    pub fn path_with(&self, id: &str) -> String {
        self.path.replace("{id}", id)
    }

    /// The canonical path with its parameters filled in, in their order.
    pub fn path_with_all(&self, params: &[&str]) -> String {
        routes::Route {
            method: self.method,
            path: self.path,
        }
        .with_params(params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_is_described_by_its_own_entry() {
        for op in Operation::ALL {
            assert_eq!(op.spec().operation, op);
        }
        let mut names: Vec<_> = Operation::ALL.iter().map(|op| op.spec().name).collect();
        names.dedup();
        assert_eq!(names.len(), Operation::ALL.len());
    }

    #[test]
    fn declines_are_client_errors_with_their_statuses_in_the_sql_map() {
        for op in Operation::ALL {
            let map = op.spec().decline_statuses();
            for d in op.spec().declines {
                assert!((400..500).contains(&d.status()));
                assert_eq!(map[d.code().as_str()], d.status());
            }
            assert_eq!(map.as_object().unwrap().len(), op.spec().declines.len());
        }
    }

    #[test]
    fn path_templates_are_filled_in() {
        assert_eq!(Operation::Refund.spec().path_with("abc"), "/payments/abc/refund");
        assert_eq!(Operation::Pay.spec().path_with("abc"), "/payments");
    }
}
