#!/usr/bin/env bash
# scripts/pg-waits.sh DB [SAMPLES] [INTERVAL_MS]: what the statements of database DB are doing,
# sampled while a load runs: SAMPLES looks (300) at pg_stat_activity, INTERVAL_MS apart (10),
# each counting the backends of DB in state `active` by wait event (`cpu` where there is none).
# Prints the mean number of statements active per look, then the same by wait event, most first.
#
# Made to read where a closed loop's time goes inside PostgreSQL: at c=8 on the lab host, new
# payments through oncepay kept 1.66 statements active (0.59 of them in IO:WALSync, the
# commit's fdatasync; 0.39 queued behind it in LWLock:WALWrite; 0.63 on a CPU), the yardstick
# 6.51 (4.65 queued behind a flush that was always in progress): docs/bench/README.md, results
# of 2026-12-06 18:20. Run it beside any step (`make bench-ab`, a load generator), on the
# local cluster (scripts/db.sh) or on the database of DATABASE_URL's server.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"

db="${1:?usage: scripts/pg-waits.sh DB [SAMPLES] [INTERVAL_MS]}"
samples="${2:-300}"
interval_ms="${3:-10}"
[[ "$db" =~ ^[A-Za-z0-9_]+$ ]] || { echo "pg-waits: DB is a database name ([A-Za-z0-9_]+)" >&2; exit 2; }
[[ "$samples" =~ ^[0-9]+$ ]] && ((samples >= 1 && samples <= 100000)) ||
  { echo "pg-waits: SAMPLES is 1 to 100000" >&2; exit 2; }
[[ "$interval_ms" =~ ^[0-9]+$ ]] && ((interval_ms >= 1 && interval_ms <= 10000)) ||
  { echo "pg-waits: INTERVAL_MS is 1 to 10000" >&2; exit 2; }
url="${PG_WAITS_URL:-$("$top/scripts/db.sh" url postgres)}"

psql -X -q -At -v ON_ERROR_STOP=1 -v db="$db" -v samples="$samples" -v interval="$interval_ms" "$url" <<'SQL'
CREATE TEMP TABLE looks (look int, what text);
SELECT set_config('pg_waits.db', :'db', false), set_config('pg_waits.samples', :'samples', false),
       set_config('pg_waits.interval', :'interval', false) \g /dev/null
DO $$
BEGIN
    FOR i IN 1 .. current_setting('pg_waits.samples')::int LOOP
        INSERT INTO looks
        SELECT i, coalesce(a.wait_event_type || ':' || a.wait_event, 'cpu')
          FROM pg_stat_activity a
         WHERE a.datname = current_setting('pg_waits.db') AND a.state = 'active'
           AND a.pid <> pg_backend_pid();
        PERFORM pg_stat_clear_snapshot();
        PERFORM pg_sleep(current_setting('pg_waits.interval')::int / 1000.0);
    END LOOP;
END
$$;
SELECT format('%s looks, %s ms apart: %s statements active per look', :samples, :interval,
              round(count(*)::numeric / :samples, 2))
  FROM looks;
SELECT format('  %-28s %s', what, round(count(*)::numeric / :samples, 2))
  FROM looks GROUP BY what ORDER BY count(*) DESC, what;
SQL
