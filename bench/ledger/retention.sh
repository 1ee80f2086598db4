#!/usr/bin/env bash
# Retention at scale (issue 39; BENCHMARKS.md, "Retention at scale"): the
# ledger's credit mix while RECORDS live idempotency records expire and are
# replaced, cycle by cycle, against the same mix on an empty table.
#
#   PG_URL=postgres://postgres@127.0.0.1:5432/test bench/ledger/retention.sh
#   MYSQL_URL=mysql://root@127.0.0.1:3306/test bench/ledger/retention.sh
#
# - RECORDS (10000000) completed records are bulk-loaded in one server-side
#   INSERT ... SELECT (over generate_series; MariaDB's sequence engine),
#   with expiries spread evenly over the next TTL seconds (300). From the
#   same moment a loader inside the server (a DO block; a MariaDB compound
#   statement) inserts RECORDS/TTL more a second, every 20 ms, each
#   expiring TTL seconds after it: the table holds RECORDS live records
#   while as many expire in every TTL.
# - The ledger runs with --ttl-secs TTL, MODE (transactional) and the
#   store's default purge (every 60 s, statements of at most 1,000 rows).
# - CYCLES (5) windows of TTL seconds each run mix.lua at CONNS (32)
#   connections: a third credits with new keys, a third replays of earlier
#   credits, a third GETs. The first cycle is the warm-up: the purge works
#   through what expired during the bulk load.
# - Per cycle: credits/s and p99 against one window on an empty table
#   (the same ledger, TTL and mix, no loader), the records' table and index
#   bytes, rows live and in all, write-ahead bytes (PostgreSQL's WAL,
#   InnoDB's redo) per credit and per record written (credits and loaded),
#   and the ledger's RSS.
#
# KEEP=1 gives the bulk and loaded records an expiry a year away: nothing
# expires, so nothing is deleted or vacuumed, and the table grows by RECORDS
# in every cycle. Its first cycle is the floor of any retention design that
# still writes RECORDS/TTL records a second (two generations emptied by
# TRUNCATE among them): what the inserts alone cost beside the mix.
#
# With both URLs, PostgreSQL runs first. Any non-2xx answer, or a balance
# that does not match the credits sent, ends the run with status 1. Builds
# the release ledger first unless NO_BUILD=1 (LEDGER_BIN as in compare.sh).
# Needs wrk, curl, python3, and psql or the mariadb client.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
[ -n "${PG_URL:-}${MYSQL_URL:-}" ] || { echo "PG_URL=postgres://... or MYSQL_URL=mysql://... is required" >&2; exit 2; }
records=${RECORDS:-10000000} ttl=${TTL:-300} cycles=${CYCLES:-5}
conns=${CONNS:-32} mode=${MODE:-transactional}
unset REDIS_URL SQLX_PG
source "$here/lib.sh"
trap 'stop_loaders; cleanup' EXIT
echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
cols="scope, fingerprint, response"
rate="$records / $ttl"
# expiry NOW_MS SPREAD_MS: a record's expiry (ms), or a year away with KEEP=1.
expiry() { if [ "${KEEP:-0}" = 1 ]; then echo "$1 + 31536000000"; else echo "$1 + $2"; fi; }

# --- PostgreSQL: pg_SQL runs statements; $1 of the others is the schema.
pg_sql() { PGOPTIONS="-c client_min_messages=warning" psql -qtAX -F ' ' -v ON_ERROR_STOP=1 "$PG_URL" "$@"; }
pg_q() { pg_sql -c "$1"; }
pg_key=key
pg_now="floor(extract(epoch from clock_timestamp()) * 1000)::bigint"
pg_fresh() { pg_schema "$1"; }
pg_drop() { pg_sql -c "DROP SCHEMA IF EXISTS $1 CASCADE"; }
pg_rows() { # the columns after scope, key, fingerprint: g is the key's number
  echo "t.scope, 'bg-' || $1, t.fingerprint, 1, 'completed', 0, $2, t.response FROM $3.ret_template t"
}
pg_insert="scope, key, fingerprint, token, state, lease_until, expires_at, response"
pg_bulk() {
  pg_sql -c "INSERT INTO $1.idempotency_records ($pg_insert)
    SELECT $(pg_rows g "$(expiry "$pg_now" "g::bigint * ($ttl * 1000) / $records")" "$1"),
      generate_series(1, $records) g" -c "ANALYZE $1.idempotency_records"
}
pg_loader() {
  PGAPPNAME=retention-loader psql -qX "$PG_URL" -c "DO \$\$
    DECLARE
      t0 double precision := extract(epoch from clock_timestamp());
      done bigint := 0;
      due bigint;
    BEGIN
      LOOP
        due := floor((extract(epoch from clock_timestamp()) - t0) * $rate::double precision);
        IF due > done THEN
          INSERT INTO $1.idempotency_records ($pg_insert)
            SELECT $(pg_rows "($records + g)" "$(expiry "$pg_now" "$ttl * 1000")" "$1"),
              generate_series(done + 1, due) g;
          done := due;
          UPDATE $1.ret_loaded SET n = done;
        END IF;
        COMMIT;
        PERFORM pg_sleep(0.02);
      END LOOP;
    END \$\$"
}
pg_stop_loader() {
  pg_sql -c "SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity
             WHERE application_name = 'retention-loader'" > /dev/null
}
pg_lsn() { pg_sql -c "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint"; }
# table bytes, index bytes, live rows, all rows
pg_stats() {
  pg_sql -c "SELECT pg_table_size('$1.idempotency_records'), pg_indexes_size('$1.idempotency_records'),
    count(*) FILTER (WHERE expires_at > $pg_now), count(*) FROM $1.idempotency_records"
}
# The server's settings that matter here. Without autovacuum the purge's
# deleted rows are never reclaimed and the table only grows: refused.
pg_settings() {
  [ "$(pg_sql -c 'SHOW autovacuum')" = on ] ||
    fail "autovacuum is off on PG_URL's server (as .ci's is); turn it on for the run:
  psql \"\$PG_URL\" -c 'ALTER SYSTEM SET autovacuum = on' -c 'SELECT pg_reload_conf()'
and back after it: ALTER SYSTEM RESET autovacuum"
  echo "shared_buffers $(pg_sql -c 'SHOW shared_buffers'), autovacuum on, $(pg_sql -c 'SELECT version()' | cut -d' ' -f1-2)"
}

# --- MySQL/MariaDB: the same, $1 the database. The records' id is any
# unique 32 bytes: the bulk and loaded keys are never claimed.
my_sql() { mysql_cli -N --batch "$@" | tr '\t' ' '; }
my_q() { my_sql -e "$1"; }
my_key='`key`'
my_now="CAST(FLOOR(UNIX_TIMESTAMP(NOW(6)) * 1000) AS SIGNED)"
my_fresh() { mysql_db "$1"; }
my_drop() { my_sql -e "DROP DATABASE IF EXISTS $1"; }
my_insert="id, scope, \`key\`, fingerprint, token, state, lease_until, expires_at, response, claims"
my_rows() {
  echo "UNHEX(SHA2(CONCAT('bg-', $1), 256)), t.scope, CONCAT('bg-', $1), t.fingerprint, 1, 'completed', 0,
    $2, t.response, 1 FROM $3.ret_template t"
}
my_bulk() {
  my_sql -e "INSERT INTO $1.idempotency_records ($my_insert)
    SELECT $(my_rows seq "$(expiry "$my_now" "seq * ($ttl * 1000) DIV $records")" "$1"),
      $1.seq_1_to_$records s; ANALYZE TABLE $1.idempotency_records" > /dev/null
}
my_loader() {
  mysql_cli -N --delimiter=// -e "BEGIN NOT ATOMIC
      DECLARE t0 DOUBLE DEFAULT UNIX_TIMESTAMP(NOW(6));
      DECLARE done BIGINT DEFAULT 0;
      DECLARE due BIGINT;
      DECLARE n BIGINT;
      LOOP
        SET due = FLOOR((UNIX_TIMESTAMP(NOW(6)) - t0) * $rate);
        IF due > done THEN
          -- The sequence engine reads its first N rows for a LIMIT; a WHERE
          -- on seq would read all of them.
          SET n = LEAST(due - done, 1000000);
          INSERT INTO $1.idempotency_records ($my_insert)
            SELECT $(my_rows "($records + done + seq)" "$(expiry "$my_now" "$ttl * 1000")" "$1"), $1.seq_1_to_1000000 s
            ORDER BY seq LIMIT n;
          SET done = done + n;
          UPDATE $1.ret_loaded SET n = done;
        END IF;
        DO SLEEP(0.02);
      END LOOP;
    END"
}
my_stop_loader() {
  local id
  for id in $(my_sql -e "SELECT id FROM information_schema.processlist WHERE info LIKE 'BEGIN NOT ATOMIC%'"); do
    my_sql -e "KILL $id" || true
  done
}
my_lsn() { my_sql -e "SHOW GLOBAL STATUS LIKE 'Innodb_lsn_current'" | cut -d' ' -f2; }
my_stats() {
  my_sql -e "ANALYZE TABLE $1.idempotency_records" > /dev/null
  my_sql -e "SELECT data_length, index_length,
      (SELECT count(*) FROM $1.idempotency_records WHERE expires_at > $my_now),
      (SELECT count(*) FROM $1.idempotency_records)
    FROM information_schema.tables WHERE table_schema = '$1' AND table_name = 'idempotency_records'"
}
my_settings() { echo "innodb_buffer_pool_size $(my_sql -e 'SELECT @@innodb_buffer_pool_size DIV 1048576')MiB, $(my_sql -e 'SELECT VERSION()')"; }

# On exit, also when a run fails: the loaders stopped, the databases
# (millions of rows) dropped.
stop_loaders() {
  local kind
  for be in ${PG_URL:+pg} ${MYSQL_URL:+my}; do
    ${be}_stop_loader 2>/dev/null || true
    for kind in empty full; do
      ${be}_drop "ret_${kind}_$be" > /dev/null 2>&1 || true
    done
  done
}
p99_ms() {
  python3 -c '
import re, sys
unit = {"us": 1e-3, "ms": 1.0, "s": 1e3}
for line in open(sys.argv[1]):
    m = re.match(r"\s+99%\s+([\d.]+)(us|ms|s)\s*$", line)
    if m:
        print(f"{float(m.group(1)) * unit[m.group(2)]:.2f}")
' "$1"
}

# measure DB NAME CYCLE: one window of TTL seconds on ledger NAME, whose
# database (or schema) is DB; appends "NAME CYCLE credits/s p99_ms table_B
# index_B live rows wal_per_credit wal_per_record rss_kB" to $results.
measure() {
  local db=$1 name=$2 cycle=$3 b sent applied lsn0 lsn1 n0 n1 written
  url=${urls[$name]}
  b=$(balance)
  lsn0=$(${be}_lsn) n0=$(${be}_q "SELECT n FROM $db.ret_loaded")
  wrk_run "$dir/w" -t1 -c"$conns" -d"${ttl}s" --latency -s "$here/mix.lua" "$url" -- "$name$cycle$RANDOM" "$ttl"
  sent=$(sed -n 's/^MIX sent_credits=\([0-9]*\).*/\1/p' "$dir/w")
  applied=$(( ($(balance) - b) / 5 ))
  [ "$applied" -le "$sent" ] && [ "$applied" -ge $((sent - conns)) ] ||
    fail "$name cycle $cycle: $sent credits sent, $applied applied"
  lsn1=$(${be}_lsn) n1=$(${be}_q "SELECT n FROM $db.ret_loaded")
  written=$(( applied + n1 - n0 ))
  echo "$name $cycle $((applied / ttl)) $(p99_ms "$dir/w") $(${be}_stats "$db") $(( (lsn1 - lsn0) / (applied > 0 ? applied : 1) ))" \
    "$(( (lsn1 - lsn0) / (written > 0 ? written : 1) )) $(awk '/VmRSS/ {print $2}' "/proc/${pids[$name]}/status")" |
    tee -a "$results"
}

# run BACKEND (pg or my): the empty window, then the loaded cycles.
run() {
  be=$1
  local key=${1}_key kind db name loader_pid started settings
  settings=$(${be}_settings)
  echo "$1: $settings"
  for kind in empty full; do
    db=ret_${kind}_$1 name=$1-$kind
    start "$name" "$ledger" --db "$(${be}_fresh "$db")" --mode "$mode" --ttl-secs "$ttl"
    # What the bulk and loaded records copy: the record of "replay-1".
    ${be}_q "CREATE TABLE $db.ret_template AS SELECT $cols FROM $db.idempotency_records WHERE ${!key} = 'replay-1'"
    ${be}_q "CREATE TABLE $db.ret_loaded AS SELECT 0 AS n"
    if [ "$kind" = empty ]; then
      measure "$db" "$name" 0
    else
      ${be}_loader "$db" > /dev/null 2> "$dir/loader.err" &
      loader_pid=$!
      started=$(date +%s)
      ${be}_bulk "$db"
      echo "$1: bulk load of $records records: $(( $(date +%s) - started )) s (the loader ran beside it)"
      for cycle in $(seq 1 "$cycles"); do
        kill -0 "$loader_pid" 2>/dev/null || fail "the loader stopped: $(cat "$dir/loader.err")"
        measure "$db" "$name" "$cycle"
      done
      ${be}_stop_loader
    fi
    stop "$name"
    ${be}_drop "$db"
  done
}

[ -z "${PG_URL:-}" ] || run pg
[ -z "${MYSQL_URL:-}" ] || run my

python3 - "$results" "$records" "$ttl" <<'PY'
import sys
rows = [line.split() for line in open(sys.argv[1])]
mb = lambda b: f"{int(b) / 2**20:,.0f}"
for be, label in (("pg", "PostgreSQL"), ("my", "MySQL/MariaDB")):
    mine = [r for r in rows if r[0].startswith(be + "-")]
    if not mine:
        continue
    base = next(r for r in mine if r[0].endswith("-empty"))
    bc, bp = float(base[2]), float(base[3])
    print(f"\n{label}: {int(sys.argv[2]):,} live records, TTL {sys.argv[3]} s; empty table: {bc:,.0f} credits/s, p99 {bp} ms\n")
    print("| cycle | credits/s | vs empty | p99 ms | vs empty | table MiB | indexes MiB | live rows | all rows | write-ahead B/credit | B/record written | ledger RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, cycle, c, p, tb, ib, live, all_, wc, wr, rss in mine:
        label = "empty" if name.endswith("-empty") else cycle
        print(f"| {label} | {float(c):,.0f} | {float(c) / bc:.2f}x | {p} | {float(p) / bp:.2f}x | {mb(tb)} | {mb(ib)} "
              f"| {int(live):,} | {int(all_):,} | {int(wc):,} | {int(wr):,} | {int(rss) / 1024:,.0f} |")
PY
