//! `kill -9` of one of three servers in the middle of a burst of keyed payments.

use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::stream::{self, StreamExt};

use crate::harness::{self, Server};
use crate::ledger::{self, Ledger, Outcome};

const OPERATIONS: usize = 600;

#[tokio::test]
#[ignore = "stops PostgreSQL and kills processes: run with `make chaos`"]
async fn a_server_killed_mid_burst_loses_nothing_and_charges_nothing_twice() {
    let pool = harness::pool().await;
    let tenant = harness::tenant(&pool).await;
    let mut servers = [
        Server::start(&[]).await,
        Server::start(&[]).await,
        Server::start(&[]).await,
    ];
    let addresses: Vec<String> = servers.iter().map(|s| s.address.clone()).collect();
    let client = ledger::client();
    let ledger = Ledger::new(OPERATIONS);
    let answered = AtomicUsize::new(0);

    // The burst: 48 in flight, round robin over the three servers; server 0 dies once a
    // third of the operations have their answer.
    let burst = stream::iter(0..OPERATIONS).for_each_concurrent(48, |i| {
        let (ledger, client, tenant, addresses, answered) = (&ledger, &client, &tenant, &addresses, &answered);
        async move {
            ledger.send(client, &addresses[i % 3], tenant, i).await;
            answered.fetch_add(1, Ordering::Relaxed);
        }
    });
    let killer = async {
        while answered.load(Ordering::Relaxed) < OPERATIONS / 3 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        servers[0].kill9().await;
    };
    tokio::join!(burst, killer);

    let unanswered = ledger
        .all_attempts()
        .iter()
        .filter(|a| matches!(a.outcome, Outcome::NoAnswer(_)))
        .count();
    assert!(unanswered > 0, "the kill interrupted nothing: the test proved nothing");
    eprintln!("kill -9: {unanswered} of {OPERATIONS} requests got no answer from the killed server");

    let live = [addresses[1].as_str(), addresses[2].as_str()];
    ledger.settle(&client, &live, &tenant).await;
    ledger.verify(&pool, &client, live[0], &tenant).await;
    for server in &mut servers[1..] {
        server.assert_alive();
    }
}
