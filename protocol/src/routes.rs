//! The API's routes, written once: the server registers them, builds its operation table and
//! its `Location` headers from them, and the client builds its requests from them. A path is
//! a template; `{id}` stands for its one parameter.

/// One route: its method and its path template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
}

impl Route {
    /// The path with `{id}` replaced by `id` (as it is: the caller encodes it if needed).
    pub fn with_id(&self, id: &str) -> String {
        self.path.replace("{id}", id)
    }

    /// The path's segments, `{id}` replaced by `id`, for a URL builder that encodes each
    /// segment (`/accounts/{id}/deposits` and `a/b`: `["accounts", "a/b", "deposits"]`).
    pub fn segments<'a>(&self, id: &'a str) -> Vec<&'a str> {
        self.path
            .trim_start_matches('/')
            .split('/')
            .map(|segment| if segment == "{id}" { id } else { segment })
            .collect()
    }
}

pub const CREATE_PAYMENT: Route = Route {
    method: "POST",
    path: "/payments",
};
/// The same operation as [`CREATE_PAYMENT`] (fingerprinted with its path).
pub const PAY_ALIAS: Route = Route {
    method: "POST",
    path: "/pay",
};
pub const GET_PAYMENT: Route = Route {
    method: "GET",
    path: "/payments/{id}",
};
pub const REFUND_PAYMENT: Route = Route {
    method: "POST",
    path: "/payments/{id}/refund",
};
pub const CREATE_ACCOUNT: Route = Route {
    method: "POST",
    path: "/accounts",
};
pub const GET_ACCOUNT: Route = Route {
    method: "GET",
    path: "/accounts/{id}",
};
pub const CREATE_DEPOSIT: Route = Route {
    method: "POST",
    path: "/accounts/{id}/deposits",
};
pub const CREATE_TRANSFER: Route = Route {
    method: "POST",
    path: "/transfers",
};
pub const GET_TRANSFER: Route = Route {
    method: "GET",
    path: "/transfers/{id}",
};
pub const CREATE_TOP_UP: Route = Route {
    method: "POST",
    path: "/accounts/{id}/top-ups",
};
pub const GET_TOP_UP: Route = Route {
    method: "GET",
    path: "/top-ups/{id}",
};
pub const REFUND_TOP_UP: Route = Route {
    method: "POST",
    path: "/top-ups/{id}/refund",
};

pub const CREATE_WEBHOOK_ENDPOINT: Route = Route {
    method: "POST",
    path: "/webhook-endpoints",
};
pub const LIST_WEBHOOK_ENDPOINTS: Route = Route {
    method: "GET",
    path: "/webhook-endpoints",
};
pub const DELETE_WEBHOOK_ENDPOINT: Route = Route {
    method: "DELETE",
    path: "/webhook-endpoints/{id}",
};
pub const ROTATE_WEBHOOK_SECRET: Route = Route {
    method: "POST",
    path: "/webhook-endpoints/{id}/rotate-secret",
};
pub const ENABLE_WEBHOOK_ENDPOINT: Route = Route {
    method: "POST",
    path: "/webhook-endpoints/{id}/enable",
};
pub const GET_EVENT: Route = Route {
    method: "GET",
    path: "/events/{id}",
};

/// Every route a tenant calls with its API key.
pub const TENANT_ROUTES: [Route; 18] = [
    CREATE_PAYMENT,
    PAY_ALIAS,
    GET_PAYMENT,
    REFUND_PAYMENT,
    CREATE_ACCOUNT,
    GET_ACCOUNT,
    CREATE_DEPOSIT,
    CREATE_TRANSFER,
    GET_TRANSFER,
    CREATE_TOP_UP,
    GET_TOP_UP,
    REFUND_TOP_UP,
    CREATE_WEBHOOK_ENDPOINT,
    LIST_WEBHOOK_ENDPOINTS,
    DELETE_WEBHOOK_ENDPOINT,
    ROTATE_WEBHOOK_SECRET,
    ENABLE_WEBHOOK_ENDPOINT,
    GET_EVENT,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_fill_the_parameter_without_splitting_it() {
        assert_eq!(CREATE_DEPOSIT.segments("a/b"), ["accounts", "a/b", "deposits"]);
        assert_eq!(CREATE_PAYMENT.segments("x"), ["payments"]);
        assert_eq!(GET_TRANSFER.with_id("7"), "/transfers/7");
    }
}
