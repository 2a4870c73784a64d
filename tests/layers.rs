//! The layers of `src/` (ARCHITECTURE.md, "Layers"), checked: each top-level module of the
//! library uses only modules of its own layer or below (`crate::name` paths, in `use` lines
//! or inline, outside comments and `#[cfg(test)]` modules), and no two use each other through
//! any chain. A new top-level module fails this test until it is given its layer below.
//!
//! `main.rs` (the command line) and `lib.rs` (the module list) are outside the stack.

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first: what each top-level module is allowed to know.
const LAYERS: &[(&str, &[&str])] = &[
    ("values", &["domain", "json", "config", "operation", "throttle"]),
    ("the protocol", &["idempotency"]),
    ("the database", &["db"]),
    (
        "effects",
        &["ledger", "batch", "tenants", "purge", "top_ups", "audit", "webhooks"],
    ),
    (
        "the edge",
        &[
            "metrics",
            "error",
            "auth",
            "telemetry",
            "state",
            "routes",
            "tls",
            "http1",
            "startup",
        ],
    ),
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, modules)| modules.contains(&module))
}

/// The top-level modules of `src/` and their files.
fn modules(src: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if ["main.rs", "lib.rs", "bin"].contains(&name.as_str()) {
            continue;
        }
        if let Some(module) = name.strip_suffix(".rs") {
            modules.insert(module.to_owned(), vec![path]);
        } else if path.is_dir() {
            let mut files = Vec::new();
            let mut dirs = vec![path];
            while let Some(dir) = dirs.pop() {
                for entry in std::fs::read_dir(dir).unwrap() {
                    let p = entry.unwrap().path();
                    if p.is_dir() {
                        dirs.push(p);
                    } else if p.extension().is_some_and(|e| e == "rs") {
                        files.push(p);
                    }
                }
            }
            modules.insert(name, files);
        }
    }
    modules
}

/// The text without line comments and without `#[cfg(test)] mod ... { ... }` blocks.
fn code(text: &str) -> String {
    let uncommented: String = text
        .lines()
        .map(|line| match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::new();
    let mut rest = uncommented.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        // Only a test module is dropped; a lone #[cfg(test)] item is kept (rare, harmless).
        let Some(brace) = after.find('{').filter(|&b| after[..b].contains("mod ")) else {
            out.push_str("#[cfg(test)]");
            rest = &after["#[cfg(test)]".len()..];
            continue;
        };
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after[brace..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = brace + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The top-level modules named by `crate::...` in `text`, grouped imports included.
fn uses(text: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String { s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect() };
    let mut found = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        let after = &text[at + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            // The group's items at its own depth: `a`, `b::c`, `d::{e, f}` name a, b and d.
            let (mut depth, mut item) = (0usize, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        found.insert(ident(item.trim()));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            found.insert(ident(item.trim()));
            found.remove("");
        } else {
            let name = ident(after);
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

/// Every module that `from` reaches through the graph.
fn reach(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo: Vec<String> = graph[from].iter().cloned().collect();
    while let Some(m) = todo.pop() {
        if seen.insert(m.clone()) {
            todo.extend(graph.get(&m).into_iter().flatten().cloned());
        }
    }
    seen
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    let mut graph = BTreeMap::new();
    for (module, files) in &modules {
        let mut used = BTreeSet::new();
        for f in files {
            used.extend(uses(&code(&std::fs::read_to_string(f).unwrap())));
        }
        used.retain(|u| u != module && modules.contains_key(u));
        graph.insert(module.clone(), used);
    }
    graph
}

#[test]
fn every_module_uses_only_its_layer_and_those_below() {
    let graph = graph();
    let unplaced: Vec<&String> = graph.keys().filter(|m| layer_of(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "modules with no layer (give them one in tests/layers.rs and ARCHITECTURE.md): {unplaced:?}"
    );
    let mut upward = Vec::new();
    for (module, used) in &graph {
        let own = layer_of(module).unwrap();
        for u in used {
            let theirs = layer_of(u).unwrap();
            if theirs > own {
                upward.push(format!("{module} ({}) uses {u} ({})", LAYERS[own].0, LAYERS[theirs].0));
            }
        }
    }
    assert!(upward.is_empty(), "a lower layer uses a higher one: {upward:#?}");
}

#[test]
fn no_two_modules_use_each_other() {
    let graph = graph();
    let cycles: Vec<String> = graph
        .keys()
        .filter(|m| reach(&graph, m).contains(*m))
        .cloned()
        .collect();
    assert!(cycles.is_empty(), "modules on a cycle of uses: {cycles:?}");
}

#[test]
fn the_reading_of_uses_sees_grouped_inline_and_test_only_paths_as_they_are() {
    let text = "use crate::{db::Db, ledger, routes::{a, b}};\nfn f() { crate::metrics::x(); }\n\
                // crate::startup in a comment\n#[cfg(test)]\nmod tests {\n    use crate::tls;\n    fn g() { if true {} }\n}\n";
    let found = uses(&code(text));
    let expected: BTreeSet<String> = ["db", "ledger", "routes", "metrics"].map(String::from).into();
    assert_eq!(found, expected);
}
