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

#[test]
fn get_payment_takes_the_id_as_its_argument_and_still_accepts_the_id_flag() {
    let id = "9b2f4f6e-52c4-4c3a-a0f5-0e4d2f5b8a11";
    for args in [&["get-payment", id][..], &["get-payment", "--id", id]] {
        let ClientCommand::GetPayment {
            id: parsed, id_flag, ..
        } = parse(args).unwrap()
        else {
            panic!("not get-payment");
        };
        assert_eq!(
            parsed.or(id_flag).map(|id| id.to_string()).as_deref(),
            Some(id),
            "{args:?}"
        );
    }
    assert!(parse(&["get-payment"]).is_err(), "the id is required");
    let mut cli = <Cli as clap::CommandFactory>::command();
    let usage = cli
        .find_subcommand_mut("get-payment")
        .unwrap()
        .render_usage()
        .to_string();
    assert!(usage.ends_with(" <ID>"), "the usage shows the id as required: {usage}");
    assert!(parse(&["get-payment", id, "--id", id]).is_err(), "one id at most");
}

#[test]
fn balance_takes_the_account_as_its_argument_and_defaults_to_main() {
    let account = |args: &[&str]| {
        let ClientCommand::Balance {
            account, account_flag, ..
        } = parse(args).unwrap()
        else {
            panic!("not balance");
        };
        account.or(account_flag)
    };
    assert_eq!(account(&["balance", "u1"]).as_deref(), Some("u1"));
    assert_eq!(account(&["balance", "--account", "u1"]).as_deref(), Some("u1"));
    assert_eq!(account(&["balance"]), None, "main, when run");
}

#[test]
fn account_create_takes_the_id_and_an_optional_balance_and_key() {
    let ClientCommand::Account(AccountCommand::Create { id, balance, key, .. }) =
        parse(&["account", "create", "u1", "--balance", "500", "--key", "open-u1"]).unwrap()
    else {
        panic!("not account create");
    };
    assert_eq!((id.as_str(), balance), ("u1", Some(500)));
    assert_eq!(key.resolve().unwrap().as_str(), "open-u1");

    let ClientCommand::Account(AccountCommand::Create { balance, .. }) = parse(&["account", "create", "u2"]).unwrap()
    else {
        panic!("not account create");
    };
    assert_eq!(balance, None, "the server's default, 0");
    assert!(parse(&["account", "create"]).is_err(), "the id is required");
}

#[test]
fn list_times_take_whole_seconds_and_refuse_a_fraction() {
    let since = |at: &str| parse(&["payments", "list", "--since", at]).map(|_| ());
    assert!(since("2026-12-06T12:10:08Z").is_ok());
    assert!(since("2026-12-06T12:10:08.000Z").is_ok(), "a zero fraction is whole");
    assert!(since("2026-12-06").is_ok());
    assert!(since("1764547200").is_ok());
    let err = since("2026-12-06T12:10:08.990Z").unwrap_err().to_string();
    assert!(err.contains("whole seconds"), "{err}");
    let recover = parse(&[
        "webhooks",
        "recover",
        "9b2f4f6e-52c4-4c3a-a0f5-0e4d2f5b8a11",
        "--since",
        "2026-12-06T12:10:08.5+01:00",
    ]);
    assert!(recover.is_err(), "recover's --since alike");
}
