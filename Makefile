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
CARGO_TEST := $(shell cargo nextest --version >/dev/null 2>&1 && echo "cargo nextest run --no-fail-fast" || echo "cargo test --no-fail-fast")

.PHONY: help run serve build db-up db-down migrate psql purge audit audit-bench test chaos check sqlx-prepare bench bench-quick clean-db openapi schemathesis ha

help:
	@echo "make run      local database if needed, migrate, demo tenant, serve on 127.0.0.1:8130"
	@echo "make test     every test, against a real PostgreSQL (started if needed)"
	@echo "make chaos    fault tests (kill -9, PostgreSQL restart, ...) on their own PostgreSQL cluster"
	@echo "make audit    reconcile balances, key rows and payments; non-zero exit if an invariant is broken"
	@echo "make schemathesis   fuzz a live server from its OpenAPI document (docs/openapi.json)"
	@echo "make ha       Patroni cluster (3 PostgreSQL 15, etcd, HAProxy), 3 oncepay, 5 faults under load, books verified (root)"
	@echo "make migrate | purge | psql | db-up | db-down | check | bench | audit-bench | sqlx-prepare | openapi"

db-up:
ifdef LOCAL_DB
	@scripts/db.sh up
endif

db-down:
ifdef LOCAL_DB
	@scripts/db.sh down
endif

build:
	cargo build --release --locked

migrate: db-up build
	$(BIN) migrate

run: migrate
	@scripts/run.sh $(BIN)

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
	DATABASE_URL="$(TEST_DATABASE_URL)" $(CARGO_TEST) --locked

# A live server fuzzed from its own /openapi.json; a local database is recreated for every run.
schemathesis: db-up
ifdef LOCAL_DB
	@psql -X -q "$(shell scripts/db.sh url postgres)" -c 'DROP DATABASE IF EXISTS oncepay_schemathesis WITH (FORCE)' -c 'CREATE DATABASE oncepay_schemathesis'
endif
	DATABASE_URL="$(SCHEMATHESIS_DATABASE_URL)" scripts/schemathesis.sh

# Regenerates the committed OpenAPI document (a unit test fails while it is stale).
openapi:
	cargo run --quiet --locked -- openapi > docs/openapi.json

# The chaos tests stop and restart PostgreSQL, so they get a cluster of their own (port
# CHAOS_PG_PORT), stopped again afterwards, and run one at a time. `make test` skips them
# (they are #[ignore]d); .ci/run runs both.
CHAOS_PG_PORT ?= 55131
CHAOS_PGDATA ?= $(shell if [ "$$(id -u)" = 0 ]; then echo /var/tmp/oncepay-chaos-pg-$$(printf '%s' "$(CURDIR)" | sha256sum | cut -c1-12); else echo "$(CURDIR)/.pgdata-chaos"; fi)
CHAOS_DB := ONCEPAY_PG_PORT=$(CHAOS_PG_PORT) ONCEPAY_PGDATA=$(CHAOS_PGDATA)
CHAOS_TEST := $(shell cargo nextest --version >/dev/null 2>&1 \
	&& echo "cargo nextest run --no-fail-fast --locked --test chaos --run-ignored only --test-threads 1" \
	|| echo "cargo test --no-fail-fast --locked --test chaos -- --ignored --test-threads=1")

chaos:
	@$(CHAOS_DB) scripts/db.sh up
	@psql -X -q "$$($(CHAOS_DB) scripts/db.sh url postgres)" -c 'DROP DATABASE IF EXISTS oncepay_chaos WITH (FORCE)' -c 'CREATE DATABASE oncepay_chaos'
	@status=0; $(CHAOS_DB) ONCEPAY_CHAOS_DATABASE_URL="$$($(CHAOS_DB) scripts/db.sh url oncepay_chaos)" \
		$(CHAOS_TEST) || status=$$?; \
	$(CHAOS_DB) scripts/db.sh down; exit $$status

check:
	cargo fmt --check
	cargo clippy --all-targets --locked -- -D warnings
	cargo clippy --all-targets --locked --features bench -- -D warnings

# Regenerates .sqlx/ from a scratch database with the migrations applied by psql (no
# sqlx-cli needed: the macros write their cache to SQLX_OFFLINE_DIR while compiling online).
sqlx-prepare: db-up
	@psql -X -q "$(shell scripts/db.sh url postgres)" -c 'DROP DATABASE IF EXISTS oncepay_prepare WITH (FORCE)' -c 'CREATE DATABASE oncepay_prepare'
	@for f in $$(ls migrations/V*__*.sql | sort -t V -k2 -n); do psql -X -q -v ON_ERROR_STOP=1 "$(shell scripts/db.sh url oncepay_prepare)" -f "$$f"; done
	rm -rf .sqlx && mkdir -p .sqlx
	touch src/lib.rs
	DATABASE_URL="$(shell scripts/db.sh url oncepay_prepare)" SQLX_OFFLINE=false SQLX_OFFLINE_DIR="$(CURDIR)/.sqlx" cargo check --all-targets --quiet
	@echo "query cache: $$(ls .sqlx | wc -l) files in .sqlx/"

bench: db-up
	@scripts/bench.sh

bench-quick: db-up
	@BENCH_QUICK=1 scripts/bench.sh

# High availability (issue 11, docs/ha.md): etcd, three PostgreSQL 15 nodes under Patroni with
# strict synchronous replication, HAProxy to the leader, three oncepay instances, in network
# namespaces of its own; five faults under load, then the books verified on the final leader.
# Needs root; installs etcd, HAProxy and Patroni (PyPI, in a virtualenv) when missing.
ha: build
	@scripts/ha.sh run
