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

.PHONY: help run serve build db-up db-down migrate psql purge test check sqlx-prepare bench bench-quick clean-db openapi schemathesis

help:
	@echo "make run      local database if needed, migrate, demo tenant, serve on 127.0.0.1:8130"
	@echo "make test     every test, against a real PostgreSQL (started if needed)"
	@echo "make schemathesis   fuzz a live server from its OpenAPI document (docs/openapi.json)"
	@echo "make migrate | purge | psql | db-up | db-down | check | bench | sqlx-prepare | openapi"

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

check:
	cargo fmt --check
	cargo clippy --all-targets --locked -- -D warnings

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
