//! Values parsed at the edge: past it, an `Amount`, an `AccountId` or a `TenantId` is valid
//! by type. The bottom layer: it knows neither HTTP nor the database layer.

mod ids;
pub mod page;
pub mod time;
mod values;

pub use ids::{AttemptId, DepositId, EndpointId, EventId, PaymentId, TenantId, TopUpId, TransferId};
pub use values::{AccountId, Amount, MissingKeyPolicy, OpeningBalance, MAX_AMOUNT};
