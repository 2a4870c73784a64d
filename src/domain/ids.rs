//! Identifiers of the resources: one newtype each, so that a payment id can't be passed
//! where a tenant id is expected.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type)]
        #[serde(transparent)]
        #[sqlx(transparent)]
        pub struct $name(Uuid);

        impl $name {
            pub fn new_random() -> Self {
                Self(Uuid::new_v4())
            }

            pub const fn from_uuid(id: Uuid) -> Self {
                Self(id)
            }

            pub const fn get(self) -> Uuid {
                self.0
            }

            /// Parses the text form; anything else names no resource.
            pub fn parse(raw: &str) -> Option<Self> {
                Uuid::parse_str(raw).ok().map(Self)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::Uuid)))
                    .into()
            }
        }
        impl utoipa::ToSchema for $name {}
    };
}

uuid_id!(
    /// A tenant: the scope of every key, account and payment.
    TenantId
);
uuid_id!(
    /// A payment (`/payments/{id}`).
    PaymentId
);
uuid_id!(
    /// A transfer between two accounts of one tenant (`/transfers/{id}`).
    TransferId
);
uuid_id!(
    /// A deposit into an account.
    DepositId
);
uuid_id!(
    /// A card top-up of an account through the processor (`/top-ups/{id}`).
    TopUpId
);
uuid_id!(
    /// A tenant's webhook endpoint (`/webhook-endpoints/{id}`).
    EndpointId
);
uuid_id!(
    /// An event (`/events/{id}`): also its `webhook-id`, the same on every attempt.
    EventId
);

/// One attempt of one event's delivery to an endpoint (`/webhook-endpoints/{id}/attempts`):
/// the event's id and the attempt's number, written `<event id>.<number>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttemptId {
    pub event: EventId,
    pub attempt: i32,
}

impl AttemptId {
    /// Parses the text form; anything else names no attempt.
    pub fn parse(raw: &str) -> Option<Self> {
        let (event, attempt) = raw.rsplit_once('.')?;
        let attempt: i32 = attempt.parse().ok().filter(|n| *n >= 1)?;
        // `+1` parses as 1: only the canonical digits name an attempt.
        if attempt.to_string() != attempt_digits(raw) {
            return None;
        }
        Some(Self {
            event: EventId::parse(event)?,
            attempt,
        })
    }
}

fn attempt_digits(raw: &str) -> &str {
    raw.rsplit_once('.').map_or("", |(_, n)| n)
}

impl fmt::Display for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.event, self.attempt)
    }
}

impl Serialize for AttemptId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl utoipa::PartialSchema for AttemptId {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some("^[0-9a-f-]{36}\\.[1-9][0-9]*$"))
            .description(Some("The event's id and the attempt's number (1 for the first)."))
            .into()
    }
}
impl utoipa::ToSchema for AttemptId {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_id_is_its_events_id_and_its_number() {
        let event = EventId::new_random();
        let id = AttemptId { event, attempt: 3 };
        assert_eq!(AttemptId::parse(&id.to_string()), Some(id));
        for bad in [
            "",
            "3",
            ".3",
            "x.3",
            "{event}.0",
            "{event}.+3",
            "{event}.03",
            "{event}.",
            "{event}",
        ] {
            let bad = bad.replace("{event}", &event.to_string());
            assert_eq!(AttemptId::parse(&bad), None, "{bad}");
        }
    }
}
