//! The benchmark's limit runs pgbench over copies of oncepay's statements (bench/sql/): if the
//! service's SQL changes and the copy does not, the limit would measure something else.

use std::path::Path;

fn read(relative: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)).expect("file readable")
}

fn normalised(sql: &str) -> String {
    sql.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The raw string literal in src/ledger/effects.rs that calls `function`, up to the call's
/// arguments (the service binds the claim as one composite; the script spells it as a ROW).
fn service_statement(function: &str) -> String {
    let ledger = read("src/ledger/effects.rs");
    let at = ledger
        .find(&format!("FROM {function}("))
        .expect("ledger calls the function");
    let start = ledger[..at].rfind("r#\"").expect("statement is a raw string") + 3;
    normalised(&ledger[start..at + format!("FROM {function}(").len()])
}

/// The pgbench script's statement with its `:variables` numbered `$1, $2, ...` in order, as
/// the prepared statement pgbench sends (`-M prepared`).
fn bench_statement(script: &str) -> String {
    let text = read(script);
    let sql: String = text
        .lines()
        .filter(|l| !l.starts_with("--") && !l.starts_with('\\'))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::new();
    let mut n = 0;
    let mut chars = sql.trim().trim_end_matches(';').chars().peekable();
    while let Some(c) = chars.next() {
        if c == ':' && chars.peek() == Some(&':') {
            // A cast (`::type`), not a variable.
            out.push_str("::");
            chars.next();
        } else if c == ':' && chars.peek().is_some_and(|d| d.is_ascii_alphabetic()) {
            while chars.peek().is_some_and(|d| d.is_ascii_alphanumeric() || *d == '_') {
                chars.next();
            }
            n += 1;
            out.push_str(&format!("${n}"));
        } else {
            out.push(c);
        }
    }
    normalised(&out)
}

/// The script's statement up to the call's arguments, checking it passes the claim the way
/// the function takes it.
fn bench_call(script: &str, function: &str) -> String {
    let statement = bench_statement(script);
    assert!(
        statement.contains("::oncepay_claim_args"),
        "{script} must pass the claim as oncepay_claim_args"
    );
    let call = format!("FROM {function}(");
    let at = statement.find(&call).expect("the script calls the function");
    statement[..at + call.len()].to_owned()
}

#[test]
fn the_bench_pays_with_the_services_own_statement() {
    assert_eq!(
        bench_call("bench/sql/pay.sql", "oncepay_pay"),
        service_statement("oncepay_pay")
    );
}

#[test]
fn the_bench_replays_with_the_services_own_statement() {
    assert_eq!(
        bench_call("bench/sql/replay.sql", "oncepay_pay"),
        service_statement("oncepay_pay")
    );
}
