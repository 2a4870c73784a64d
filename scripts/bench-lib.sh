# Shared by scripts/bench.sh, bench-ab.sh and pgbouncer-bench.sh (sourced, not run).

# Kills every process in the array `pids`, then reaps them.
stop_pids() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}

# bench_database ADMIN_URL URL BIN ACCOUNTS [POLICY]: the database named by URL, made afresh
# and migrated by BIN, with one tenant (missing-key policy POLICY, default `fingerprint`)
# holding accounts "0" .. ACCOUNTS-1; sets `tenant` and `api_key`.
bench_database() {
  local admin_url="$1" url="$2" bin="$3" accounts="$4" policy="${5:-fingerprint}" db tenant_json
  db="${url##*/}"
  psql -X -q "$admin_url" -c "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" \
    -c "CREATE DATABASE $db" >/dev/null
  DATABASE_URL="$url" "$bin" migrate 2>/dev/null
  bench_tenant "$url" "$bin" "$accounts" bench "$policy"
}

# bench_tenant URL BIN ACCOUNTS NAME [POLICY]: one more tenant in the migrated database at URL,
# holding accounts "0" .. ACCOUNTS-1; sets `tenant` and `api_key`.
bench_tenant() {
  local url="$1" bin="$2" accounts="$3" name="$4" policy="${5:-fingerprint}" tenant_json
  tenant_json="$(DATABASE_URL="$url" "$bin" tenant create --name "$name" --missing-key-policy "$policy" 2>/dev/null)"
  tenant="$(sed -n 's/.*"tenant_id":"\([^"]*\)".*/\1/p' <<<"$tenant_json")"
  api_key="$(sed -n 's/.*"api_key":"\([^"]*\)".*/\1/p' <<<"$tenant_json")"
  psql -X -q -v ON_ERROR_STOP=1 "$url" -c "INSERT INTO accounts (tenant_id, account_id, balance, opening_balance)
    SELECT '$tenant', g::text, 1000000000000, 1000000000000 FROM generate_series(0, $((accounts - 1))) g" >/dev/null
}
