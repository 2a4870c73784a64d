# oncepay: `make run` takes a fresh clone to a running service, `make test` runs every test.
# Without DATABASE_URL, both use a project-local PostgreSQL cluster (scripts/db.sh).

SHELL := /bin/bash
.DEFAULT_GOAL := help

ifeq ($(strip $(DATABASE_URL)),)
LOCAL_DB := 1
DATABASE_URL := $(shell scripts/db.sh url oncepay)
TEST_DATABASE_URL ?= $(shell scripts/db.sh url oncepay_test)
SCHEMATHESIS_DATABASE_URL ?= $(shell scripts/db.sh url oncepay_schemathesis)
else
TEST_DATABASE_URL ?= $(DATABASE_URL)
SCHEMATHESIS_DATABASE_URL ?= $(DATABASE_URL)
endif
export DATABASE_URL
# The crate builds from the committed query cache in .sqlx/, with or without a database.
export SQLX_OFFLINE ?= true

BIN := target/release/oncepay
CARGO_TEST := $(shell cargo nextest --version >/dev/null 2>&1 && echo "cargo nextest run --workspace --no-fail-fast" || echo "cargo test --workspace --no-fail-fast")

.PHONY: help run lab tenant db-url build install db-up db-down db-port-test readme-test migrate psql purge audit audit-bench test test-pgbouncer chaos check client-deps-check sqlx-check sqlx-prepare schema schema-check bench bench-quick bench-analyze callgrind sql-callgrind bench-ab bench-lists-ab openapi schemathesis alerts-test ha bench-ha

help:
	@echo "make run      local database if needed, migrate, demo tenant, serve on 127.0.0.1:8130"
	@echo "make lab      a new tenant with 10000 for the README's walkthrough: eval \"\$$(make lab)\" sets U, API, TENANT, ADMIN, STRIPE"
	@echo "make tenant NAME=n [POLICY=reject|allow|fingerprint] [BALANCE=N]   a tenant via the CLI on make run's database"
	@echo "make db-url   the DATABASE_URL make uses (the local cluster's unless set)"
	@echo "make test     every test, against a real PostgreSQL (started if needed)"
	@echo "make readme-test   the console blocks of README.md and docs/lab.md run against make run's server, their output compared"
	@echo "make test-pgbouncer   the API tests with the servers behind PgBouncer in transaction mode"
	@echo "make chaos    fault tests (kill -9, PostgreSQL restart, ...) on their own PostgreSQL cluster"
	@echo "make audit    reconcile balances, key rows and payments; non-zero exit if an invariant is broken"
	@echo "make schemathesis   fuzz a live server from its OpenAPI document (docs/openapi.json)"
	@echo "make alerts-test    check the Prometheus rules (ops/prometheus) and run their unit tests with promtool"
	@echo "make check    fmt, clippy -D warnings over the workspace, the freshness of .sqlx/, client-deps-check"
	@echo "make bench | bench-quick   oncepay against pgbench and the yardstick, CPU per request, retry storm"
	@echo "make bench-analyze   where PostgreSQL's CPU per payment goes (pg_stat_statements, auto_explain, perf)"
	@echo "make callgrind       the server's instructions per new payment and per replay (valgrind)"
	@echo "make bench-ab BASE_BIN=dir   this tree's server against another build, side by side in one run"
	@echo "make bench-lists-ab BASE_BIN=dir  the list rows of make bench for both builds, side by side"
	@echo "make sql-callgrind   PostgreSQL's instructions per new payment, replay and payment with a webhook endpoint, alone and in batches, this SQL vs an older one"
	@echo "make ha       Patroni cluster (3 PostgreSQL 15, etcd, HAProxy), 3 oncepay, 5 faults under load, books verified (root)"
	@echo "make bench-ha  the yardstick ratios on that cluster (0.5 ms between nodes) and through PgBouncer (root)"
	@echo "make build    the release binary (target/release/oncepay)"
	@echo "make install  cargo install --path . --locked: the oncepay binary into ~/.cargo/bin"
	@echo "make schema  schema/: the tables and every SQL function as the migrations leave them (make check fails while stale)"
	@echo "make migrate | purge | psql | db-up | db-down | db-port-test | client-deps-check | bench | audit-bench | sqlx-prepare | sqlx-check | schema-check | openapi | ha"

db-up:
ifdef LOCAL_DB
	@scripts/db.sh up
endif

db-down:
ifdef LOCAL_DB
	@scripts/db.sh down
endif

# The local cluster starts while a client socket holds 55130, its old default port inside
# Linux's ephemeral range (tests/db-port.sh); it restarts the cluster when one runs.
db-port-test:
ifdef LOCAL_DB
	@tests/db-port.sh
else
	@echo "db-port-test: DATABASE_URL is set, no local cluster to test"
endif

build:
	@[ -x $(BIN) ] || echo "make: building the release binary $(BIN) for the first time: about 9 minutes on 2 cores" >&2
	cargo build --release --locked

# The `oncepay` binary (server and client commands) into cargo's bin folder (~/.cargo/bin),
# built from target/ like `make build`.
install:
	cargo install --path . --locked

migrate: db-up build
	$(BIN) migrate

run: migrate
	@scripts/run.sh $(BIN)

# A new tenant with 10000 for the README's walkthrough, on the database `make run` serves:
# prints the lines that set U, API, TENANT, ADMIN and STRIPE (eval "$$(make lab)"). Build output and
# notes go to stderr, so that stdout is only those lines.
lab: db-up
	@cargo build --release --locked --quiet >&2
	@scripts/lab.sh $(BIN)

# A tenant on the database `make run` serves, through the CLI: NAME required, POLICY (reject,
# allow or fingerprint; default reject), BALANCE (main account, default 0). Prints the tenant as
# JSON, its API key included (shown once). Build output goes to stderr.
tenant: db-up
	@[ -n "$(NAME)" ] || { echo "make tenant: NAME=... is required (POLICY=reject|allow|fingerprint, BALANCE=N optional)" >&2; exit 2; }
	@cargo build --release --locked --quiet >&2
	@$(BIN) tenant create --name "$(NAME)" --missing-key-policy "$(or $(POLICY),reject)" --main-balance "$(or $(BALANCE),0)"

# The DATABASE_URL make uses: the local cluster's unless set (psql "$$(make -s db-url)").
db-url:
	@echo "$(DATABASE_URL)"

purge: db-up build
	$(BIN) purge

audit: db-up build
	$(BIN) audit

# Times the audit on a generated ledger of a million payments (docs/audit.md).
audit-bench: db-up build
	@scripts/audit-bench.sh $(BIN) "$(DATABASE_URL)" oncepay_audit_bench

psql: db-up
	@psql "$(DATABASE_URL)"

# Tests migrate the test database themselves; a local one is recreated for every run.
test: db-up
ifdef LOCAL_DB
	@psql -X -q "$(shell scripts/db.sh url postgres)" -c 'DROP DATABASE IF EXISTS oncepay_test WITH (FORCE)' -c 'CREATE DATABASE oncepay_test'
endif
	@mkdir -p target
	set -o pipefail; DATABASE_URL="$(TEST_DATABASE_URL)" ONCEPAY_TEST_PG_CA="$$(scripts/db.sh ca)" \
		ONCEPAY_TEST_LOCALSTRIPE="$$(scripts/localstripe.sh install)" $(CARGO_TEST) --locked 2>&1 | tee target/test.log \
		|| { echo "== the failures again (the whole output: target/test.log) =="; \
		     sed -n '/^failures:$$/,/^test result: FAILED/p' target/test.log; exit 1; }

# Every console block of README.md and docs/lab.md run against `make run`'s server, output compared
# (ids and times masked), and every link of README.md and docs/ kept inside the repository
# (tests/readme/run.py). Starts `make run` and stops it afterwards (scripts/readme-test.sh).
readme-test: db-up
	@scripts/readme-test.sh

# The API tests (no test there restarts or kills the database) with every test server
# connected through PgBouncer in transaction mode (scripts/pgbouncer.sh, installed if missing)
# and ONCEPAY_DB_POOLER=transaction; the tests' own queries go straight to PostgreSQL.
# PgBouncer is stopped again afterwards, also when a test fails.
PGBOUNCER_PORT ?= 25139
test-pgbouncer: db-up
ifdef LOCAL_DB
	@psql -X -q "$(shell scripts/db.sh url postgres)" -c 'DROP DATABASE IF EXISTS oncepay_test WITH (FORCE)' -c 'CREATE DATABASE oncepay_test'
endif
	@ONCEPAY_PGBOUNCER_PORT=$(PGBOUNCER_PORT) scripts/pgbouncer.sh up
	@status=0; DATABASE_URL="$(TEST_DATABASE_URL)" ONCEPAY_DB_POOLER=transaction ONCEPAY_TEST_PG_CA="$$(scripts/db.sh ca)" \
		ONCEPAY_TEST_POOLER_URL="$$(ONCEPAY_PGBOUNCER_PORT=$(PGBOUNCER_PORT) scripts/pgbouncer.sh url oncepay_test)" \
		$(CARGO_TEST) --locked --test api || status=$$?; \
	echo "PgBouncer served oncepay_test: $$(psql -X -tA -F ' ' "$$(ONCEPAY_PGBOUNCER_PORT=$(PGBOUNCER_PORT) scripts/pgbouncer.sh url pgbouncer)" \
		-c 'SHOW STATS' | awk '$$1 == "oncepay_test" { print $$2 " transactions, " $$3 " queries" }')"; \
	ONCEPAY_PGBOUNCER_PORT=$(PGBOUNCER_PORT) scripts/pgbouncer.sh down; exit $$status

# A live server fuzzed from its own /openapi.json; a local database is recreated for every run.
schemathesis: db-up
ifdef LOCAL_DB
	@psql -X -q "$(shell scripts/db.sh url postgres)" -c 'DROP DATABASE IF EXISTS oncepay_schemathesis WITH (FORCE)' -c 'CREATE DATABASE oncepay_schemathesis'
endif
	DATABASE_URL="$(SCHEMATHESIS_DATABASE_URL)" scripts/schemathesis.sh

# The alerting and recording rules and their unit tests (docs/operations.md); promtool is
# installed from Debian's prometheus package when missing. No database needed.
alerts-test:
	@scripts/alerts-test.sh

# Regenerates the committed OpenAPI document (a unit test fails while it is stale).
openapi:
	cargo run --quiet --locked -- openapi > docs/openapi.json

# The chaos tests stop and restart PostgreSQL, so they get a cluster of their own (port
# CHAOS_PG_PORT), stopped again afterwards, and run one at a time. `make test` skips them
# (they are #[ignore]d); .ci/run runs both.
CHAOS_PG_PORT ?= 25131
CHAOS_PGDATA ?= $(shell if [ "$$(id -u)" = 0 ]; then echo /var/tmp/oncepay-chaos-pg-$$(printf '%s' "$(CURDIR)" | sha256sum | cut -c1-12); else echo "$(CURDIR)/.pgdata-chaos"; fi)
CHAOS_DB := ONCEPAY_PG_PORT=$(CHAOS_PG_PORT) ONCEPAY_PGDATA=$(CHAOS_PGDATA)
CHAOS_TEST := $(shell cargo nextest --version >/dev/null 2>&1 \
	&& echo "cargo nextest run --no-fail-fast --locked --test chaos --run-ignored only --test-threads 1" \
	|| echo "cargo test --no-fail-fast --locked --test chaos -- --ignored --test-threads=1")

chaos:
	@$(CHAOS_DB) scripts/db.sh up
	@psql -X -q "$$($(CHAOS_DB) scripts/db.sh url postgres)" -c 'DROP DATABASE IF EXISTS oncepay_chaos WITH (FORCE)' -c 'CREATE DATABASE oncepay_chaos'
	@status=0; $(CHAOS_DB) ONCEPAY_CHAOS_DATABASE_URL="$$($(CHAOS_DB) scripts/db.sh url oncepay_chaos)" \
		ONCEPAY_TEST_LOCALSTRIPE="$$(scripts/localstripe.sh install)" \
		$(CHAOS_TEST) || status=$$?; \
	$(CHAOS_DB) scripts/db.sh down; exit $$status

check: sqlx-check schema-check client-deps-check
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	cargo clippy -p oncepay-client --all-targets --locked -- -D warnings
	# The library alone, without the tests' dev-dependencies, whose features would hide one it
	# lacks (tokio's `select!` for the CLI did not compile in a program depending on the crate).
	cargo clippy -p oncepay-client --locked --features cli -- -D warnings
	cargo clippy -p oncepay-client --locked -- -D warnings

# The client crate, and the protocol crate it shares with the server, compile no server crate
# (README.md, development): fails if `cargo tree` shows one.
client-deps-check:
	@for package in oncepay-protocol oncepay-client; do \
		deps="$$(cargo tree --locked -p $$package --all-features -e normal --prefix none --format '{p}')" || exit 1; \
		server="$$(grep -E '^(actix-|sqlx|refinery|tokio-postgres)' <<<"$$deps" | awk '{print $$1, $$2}' | sort -u)"; \
		if [ -n "$$server" ]; then echo "$$package depends on server crates:"; echo "$$server"; exit 1; fi; \
		echo "$$package: $$(sort -u <<<"$$deps" | wc -l) crates, no actix-web, sqlx, refinery or tokio-postgres"; \
	done

# The query cache as the macros write it from a scratch database with the migrations applied
# by psql (no sqlx-cli needed: compiling online, they write to SQLX_OFFLINE_DIR). Touching
# src/lib.rs makes cargo expand them again while every dependency stays cached; its time is
# put back afterwards, so that the next build does not redo the crate for an unchanged file.
# $(1): the scratch database, $(2): the folder the cache goes to (emptied first).
define sqlx_regenerate
	@psql -X -q "$(shell scripts/db.sh url postgres)" -c 'SET client_min_messages = warning' -c 'DROP DATABASE IF EXISTS $(1) WITH (FORCE)' -c 'CREATE DATABASE $(1)'
	@for f in $$(ls migrations/V*__*.sql | sort -t V -k2 -n); do psql -X -q -v ON_ERROR_STOP=1 "$(shell scripts/db.sh url $(1))" -f "$$f"; done
	rm -rf "$(2)" && mkdir -p "$(2)"
	touch -r src/lib.rs "$(2).lib-mtime" && touch src/lib.rs; status=0; \
	DATABASE_URL="$(shell scripts/db.sh url $(1))" SQLX_OFFLINE=false SQLX_OFFLINE_DIR="$(2)" \
		cargo check --all-targets --locked --quiet || status=$$?; \
	touch -r "$(2).lib-mtime" src/lib.rs && rm "$(2).lib-mtime"; exit $$status
	@psql -X -q "$(shell scripts/db.sh url postgres)" -c 'DROP DATABASE $(1) WITH (FORCE)'
endef

# The schema as the migrations leave it, to read in one place: schema/tables.sql and one
# schema/functions/<name>.sql per oncepay_* function (scripts/schema.sh). Commit it after a
# migration; schema-check (in `make check`) fails while it is stale.
schema: db-up
	@scripts/schema.sh schema

schema-check: db-up
	@scripts/schema.sh target/schema-check 2>/dev/null
	@if ! diff -r -q schema target/schema-check >/dev/null; then \
		diff -r schema target/schema-check | head -n 40; \
		echo "schema-check: schema/ is stale: run make schema and commit schema/" >&2; exit 1; \
	fi; echo "schema-check: schema/ is fresh ($$(ls schema/functions | wc -l) functions)"

# Regenerates .sqlx/ (commit it after changing a query or a migration).
sqlx-prepare: db-up
	$(call sqlx_regenerate,oncepay_prepare,$(CURDIR)/.sqlx)
	@echo "query cache: $$(ls .sqlx | wc -l) files in .sqlx/"

# Fails, naming the files, when the committed .sqlx/ is not what sqlx-prepare would write.
SQLX_CHECK_DIR := $(CURDIR)/target/sqlx-check
sqlx-check: db-up
	$(call sqlx_regenerate,oncepay_sqlx_check,$(SQLX_CHECK_DIR))
	@ls .sqlx > "$(SQLX_CHECK_DIR).committed"; ls "$(SQLX_CHECK_DIR)" > "$(SQLX_CHECK_DIR).expected"; \
	missing=$$(comm -13 "$(SQLX_CHECK_DIR).committed" "$(SQLX_CHECK_DIR).expected"); \
	extra=$$(comm -23 "$(SQLX_CHECK_DIR).committed" "$(SQLX_CHECK_DIR).expected"); \
	stale=$$(for f in $$(comm -12 "$(SQLX_CHECK_DIR).committed" "$(SQLX_CHECK_DIR).expected"); do \
		cmp -s ".sqlx/$$f" "$(SQLX_CHECK_DIR)/$$f" || echo "$$f"; done); \
	for f in $$missing; do echo "sqlx-check: missing .sqlx/$$f (a query without its cache entry)"; done; \
	for f in $$extra; do echo "sqlx-check: extra .sqlx/$$f (no query uses it)"; done; \
	for f in $$stale; do echo "sqlx-check: stale .sqlx/$$f (the query or the schema changed)"; done; \
	if [ -n "$$missing$$extra$$stale" ]; then echo "sqlx-check: .sqlx/ is stale: run make sqlx-prepare and commit .sqlx/" >&2; exit 1; fi; \
	echo "sqlx-check: .sqlx/ is fresh ($$(wc -l < "$(SQLX_CHECK_DIR).expected") files)"

bench: db-up
	@scripts/bench.sh

bench-quick: db-up
	@BENCH_QUICK=1 scripts/bench.sh

# On a cluster of its own (ANALYZE_PG_PORT, default ONCEPAY_PG_PORT + 2), stopped afterwards:
# it preloads pg_stat_statements and auto_explain, which the bench's cluster must not carry.
bench-analyze:
	@scripts/bench-analyze.sh

callgrind: db-up
	@scripts/bench-callgrind.sh

# PostgreSQL's instructions per new payment and per replay, the SQL of this tree against that
# of SQL_CALLGRIND_BASE (default 623b367, before the operation table), one backend under
# callgrind (about 4 minutes; docs/bench/analysis.md).
sql-callgrind: db-up
	@scripts/sql-callgrind.sh

# This tree's server against another build (BASE_BIN=dir holding its oncepay binary), one run,
# rounds alternated: a change's before and after (scripts/bench-ab.sh).
bench-ab: db-up
	@scripts/bench-ab.sh

# make bench's list page steps (issue 39's p99 rows) for this tree and another build, each
# against pgbench's bare SELECT, side by side in one run (scripts/bench-lists-ab.sh).
bench-lists-ab: db-up
	@scripts/bench-lists-ab.sh

# High availability (docs/ha.md): etcd, three PostgreSQL 15 nodes under Patroni with
# strict synchronous replication, HAProxy to the leader, three oncepay instances, in network
# namespaces of its own; five faults under load, then the books verified on the final leader.
# Needs root; installs etcd, HAProxy and Patroni (PyPI, in a virtualenv) when missing. The
# driver is the workspace's tools/ha (package oncepay-ha), built with the server in one go.
ha:
	cargo build --release --locked -p oncepay -p oncepay-ha
	@scripts/ha.sh run

# The yardstick ratios where production runs (docs/bench/ha/): the cluster of
# `make ha` with a 0.5 ms delay each way between its namespaces, and PgBouncer in transaction
# mode in front of it; about 12 minutes, root. Writes docs/bench/ha/REPORT.md.
bench-ha:
	@scripts/bench-ha.sh
