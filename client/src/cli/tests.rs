//! The command line of the client commands, parsed as the `oncepay` binary parses it.

use clap::Parser;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: ClientCommand,
}

fn parse(args: &[&str]) -> Result<ClientCommand, clap::Error> {
    let server = ["--url", "http://127.0.0.1:8130", "--api-key", "k"];
    let all = ["oncepay"].iter().chain(args).chain(server.iter());
    Cli::try_parse_from(all).map(|cli| cli.command)
}

#[test]
fn transfer_takes_from_to_amount_and_an_optional_key() {
    let ClientCommand::Transfer {
        from, to, amount, key, ..
    } = parse(&[
        "transfer", "--from", "u1", "--to", "u2", "--amount", "100", "--key", "t-1",
    ])
    .unwrap()
    else {
        panic!("not a transfer");
    };
    assert_eq!((from.as_str(), to.as_str(), amount), ("u1", "u2", 100));
    assert_eq!(key.resolve().unwrap().as_str(), "t-1");

    let ClientCommand::Transfer { key, .. } =
        parse(&["transfer", "--from", "a", "--to", "b", "--amount", "1"]).unwrap()
    else {
        panic!("not a transfer");
    };
    assert_ne!(
        key.resolve().unwrap(),
        key.resolve().unwrap(),
        "no --key: a new key per run"
    );
}

#[test]
fn transfer_requires_both_accounts_and_the_amount() {
    for args in [
        &["transfer", "--to", "u2", "--amount", "1"][..],
        &["transfer", "--from", "u1", "--amount", "1"],
        &["transfer", "--from", "u1", "--to", "u2"],
    ] {
        let err = parse(args).err().expect("refused");
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument, "{args:?}");
    }
}

#[test]
fn get_transfer_takes_the_id_as_its_argument() {
    let id = "9b2f4f6e-52c4-4c3a-a0f5-0e4d2f5b8a11";
    let ClientCommand::GetTransfer { id: parsed, .. } = parse(&["get-transfer", id]).unwrap() else {
        panic!("not get-transfer");
    };
    assert_eq!(parsed.to_string(), id);
    assert!(parse(&["get-transfer", "not-a-uuid"]).is_err());
}
