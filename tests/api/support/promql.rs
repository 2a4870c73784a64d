//! Just enough PromQL to list the series a query reads, with their label matchers, and the
//! queries of the rules file and the dashboard (for `dashboards.rs`): no operator
//! precedence, no evaluation.

use std::collections::BTreeSet;

use serde_json::Value;

/// Series that Prometheus makes itself when it scrapes, not the service.
pub const SCRAPE_SERIES: &[&str] = &["up"];

/// The `expr` of every rule. The rules file is YAML; its expressions are one-line values
/// or block scalars (`|`, `>-`, ...) indented under their key, which is all it uses.
pub fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut exprs = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let Some(value) = trimmed.strip_prefix("expr:") else {
            continue;
        };
        let value = value.trim();
        if matches!(value, "|" | "|-" | ">" | ">-") {
            let indent = line.len() - trimmed.len();
            let block: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .copied()
                .collect();
            exprs.push(block.join("\n"));
        } else {
            exprs.push(value.trim_matches(['\'', '"']).to_owned());
        }
    }
    exprs
}

pub fn recorded_names(yaml: &str) -> BTreeSet<String> {
    yaml.lines()
        .filter_map(|l| l.trim_start().trim_start_matches("- ").strip_prefix("record:"))
        .map(|name| name.trim().to_owned())
        .collect()
}

/// Every PromQL string of the dashboard: panel targets (`expr`) and variable queries.
pub fn dashboard_queries(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr" | "query", Value::String(query)) => out.push(query.clone()),
                    _ => dashboard_queries(value, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| dashboard_queries(v, out)),
        _ => {}
    }
}

#[derive(Debug, PartialEq)]
enum Token {
    Ident(String),
    Str(String),
    Punct(char),
}

/// A small PromQL lexer: identifiers, quoted strings and punctuation; numbers, durations
/// and Grafana `$variables` outside strings are dropped.
fn lex(query: &str) -> Vec<Token> {
    let chars: Vec<char> = query.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if matches!(c, '"' | '\'' | '`') {
            let mut s = String::new();
            i += 1;
            while i < chars.len() && chars[i] != c {
                if chars[i] == '\\' && c != '`' {
                    i += 1;
                }
                s.extend(chars.get(i));
                i += 1;
            }
            i += 1;
            tokens.push(Token::Str(s));
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            tokens.push(Token::Ident(chars[start..i].iter().collect()));
        } else if c.is_ascii_digit() || c == '.' || c == '$' {
            i += 1;
            while i < chars.len() && (ident(chars[i]) || chars[i] == '.') {
                i += 1;
            }
        } else {
            tokens.push(Token::Punct(c));
            i += 1;
        }
    }
    tokens
}

/// A series named in a query, with its label matchers `(label, op, value)`.
pub struct Selector {
    pub name: String,
    pub matchers: Vec<(String, String, String)>,
}

/// The series a query reads: the service's (`oncepay_*`), recorded ones (`level:name:ops`)
/// and Prometheus' own (`up`). Label names (in `by (...)`, matchers) never look like these.
pub fn selectors(query: &str) -> Vec<Selector> {
    let tokens = lex(query);
    let mut found = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let Token::Ident(name) = &tokens[i] else {
            i += 1;
            continue;
        };
        i += 1;
        if !(name.starts_with("oncepay_") || name.contains(':') || SCRAPE_SERIES.contains(&name.as_str())) {
            continue;
        }
        let mut matchers = Vec::new();
        if tokens.get(i) == Some(&Token::Punct('{')) {
            i += 1;
            while let Some(Token::Ident(label)) = tokens.get(i) {
                let mut op = String::new();
                i += 1;
                while let Some(Token::Punct(c @ ('=' | '!' | '~'))) = tokens.get(i) {
                    op.push(*c);
                    i += 1;
                }
                let Some(Token::Str(value)) = tokens.get(i) else {
                    panic!("a matcher without a value after `{label}` in: {query}");
                };
                matchers.push((label.clone(), op, value.clone()));
                i += 1;
                if tokens.get(i) == Some(&Token::Punct(',')) {
                    i += 1;
                }
            }
            assert_eq!(tokens.get(i), Some(&Token::Punct('}')), "unclosed selector in: {query}");
            i += 1;
        }
        found.push(Selector {
            name: name.clone(),
            matchers,
        });
    }
    found
}
