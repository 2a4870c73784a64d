//! The workspace's promise (README.md, development): a program that depends on `oncepay-client`
//! alone compiles no actix-web, sqlx or refinery; nor does `oncepay-protocol`, the rules the
//! client shares with the server.

use std::process::Command;

/// The crates of the server side that the client must never pull in.
const SERVER_CRATES: &[&str] = &["actix-", "sqlx", "refinery", "tokio-postgres", "moka", "prometheus"];

/// The normal (non-dev, non-build) dependencies of `package`, every feature on, one name per line.
fn normal_dependencies(package: &str) -> Vec<String> {
    let output = Command::new(env!("CARGO"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["tree", "--locked", "--all-features", "-e", "normal"])
        .args(["--prefix", "none", "--format", "{p}", "-p", package])
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .expect("UTF-8")
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

fn server_crates_among(dependencies: &[String]) -> Vec<&str> {
    let mut found: Vec<&str> = dependencies
        .iter()
        .filter(|name| SERVER_CRATES.iter().any(|server| name.starts_with(server)))
        .map(String::as_str)
        .collect();
    found.sort_unstable();
    found.dedup();
    found
}

/// `package`'s tree has no server crate; `one_it_has` proves the tree was read at all.
fn assert_no_server_crate(package: &str, one_it_has: &str) {
    let dependencies = normal_dependencies(package);
    assert!(
        dependencies.iter().any(|name| name == one_it_has),
        "the tree was read: {dependencies:?}"
    );
    assert_eq!(server_crates_among(&dependencies), Vec::<&str>::new(), "in {package}");
}

#[test]
fn the_client_crate_compiles_no_server_crate() {
    assert_no_server_crate("oncepay-client", "reqwest");
}

#[test]
fn the_protocol_crate_compiles_no_server_crate() {
    assert_no_server_crate("oncepay-protocol", "serde");
}

/// The same check finds them in the server's tree, so it is not a check that cannot fail.
#[test]
fn the_check_sees_the_server_crates_where_they_are() {
    let server = normal_dependencies("oncepay");
    let found = server_crates_among(&server);
    for expected in ["actix-web", "sqlx", "refinery"] {
        assert!(found.contains(&expected), "{expected} not seen in {found:?}");
    }
}
