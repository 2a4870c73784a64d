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
