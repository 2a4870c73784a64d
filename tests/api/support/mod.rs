//! What the tests share: the test app and its typed calls (`helpers`), and the real
//! counterparts and faults they stand a server against: a TCP proxy that cuts, delays or
//! drops (`fault_proxy`, `tcp_cut`, `tcp_relay`), a webhook receiver (`webhook_receiver`),
//! localstripe (`stripe`), a second database peer (`db_peer`), and PromQL over the metrics
//! (`promql`). No test lives here.

pub mod db_peer;
pub mod fault_proxy;
pub mod helpers;
pub mod promql;
pub mod stripe;
pub mod tcp_cut;
pub mod tcp_relay;
// Shared with the chaos tests, which use a part of it.
#[allow(dead_code)]
pub mod webhook_receiver;
