# Shared by compare.sh and scale.sh (sourced, not run; the caller sets $here
# and $root): builds the release ledger (with PostgreSQL if PG_URL is set,
# its sqlx driver too if SQLX_PG is, MySQL if MYSQL_URL is, Redis if
# REDIS_URL is) and the naive
# ledger unless NO_BUILD=1, makes a scratch directory $dir removed on exit
# with every server started, and defines what starts servers on free ports,
# drives them with wrk and reads the balance back.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
fail() { echo "FAILED: $*" >&2; exit 1; }
[ -z "${SQLX_PG:-}" ] || [ -n "${PG_URL:-}" ] || fail "SQLX_PG=1 needs PG_URL=postgres://..."
case ${MYSQL_URL:-mysql://} in mysql://*) ;; *) fail "MYSQL_URL=$MYSQL_URL: not a mysql:// URL" ;; esac
features=""
[ -z "${PG_URL:-}" ] || features+=" postgres"
[ -z "${SQLX_PG:-}" ] || features+=" sqlx-postgres"
[ -z "${MYSQL_URL:-}" ] || features+=" mysql"
[ -z "${REDIS_URL:-}" ] || features+=" redis"
features=${features# }
if [ -z "${NO_BUILD:-}" ]; then
  (cd "$root" && cargo build -q --release --example ledger ${features:+--features "$features"})
  cargo build -q --release --manifest-path "$root/bench/naive-ledger/Cargo.toml"
fi
ledger=${LEDGER_BIN:-$CARGO_TARGET_DIR/release/examples/ledger}
naive=${NAIVE_BIN:-$CARGO_TARGET_DIR/release/naive-ledger}
dir=$(mktemp -d)
results=$dir/results
declare -A pids urls
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$dir"; }
trap cleanup EXIT

auth=(-H 'Authorization: Bearer bench' -H 'Content-Type: application/json')

# launch NAME ARGS...: a server on a free port, kept until the script ends;
# sets ${urls[NAME]} and $url.
launch() {
  local name=$1; shift
  "$@" --listen 127.0.0.1:0 > "$dir/$name.out" 2> "$dir/$name.err" &
  pids[$name]=$!
  for _ in $(seq 1 200); do grep -qs "listening on" "$dir/$name.out" && break; sleep 0.05; done
  urls[$name]=$(grep -o 'http://[0-9.:]*' "$dir/$name.out" | head -1)
  [ -n "${urls[$name]}" ] || fail "$name did not start: $(cat "$dir/$name.err")"
  url=${urls[$name]}
}
# start NAME ARGS...: a ledger (or the naive one) with account 1 and one
# credit under the key "replay-1" (what replay.lua repeats).
start() {
  launch "$@"
  curl -sf -X POST "$url/accounts" "${auth[@]}" -H 'Idempotency-Key: "acct-1"' -d '{"name":"bench"}' > /dev/null ||
    fail "$1: account not created"
  curl -sf -X POST "$url/accounts/1/credits" "${auth[@]}" -H 'Idempotency-Key: "replay-1"' -d '{"amount": 5}' > /dev/null ||
    fail "$1: first credit failed"
}
stop() { kill "${pids[$1]}" 2>/dev/null; wait "${pids[$1]}" 2>/dev/null || true; unset "pids[$1]"; }
read_balance() { curl -sf "$url/accounts/1" "${auth[@]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["balance"])'; }
# The balance once the credits still in flight when wrk stopped have landed
# (two reads 0.3 s apart agree).
balance() {
  local last now
  last=$(read_balance)
  while sleep 0.3; now=$(read_balance); [ "$now" != "$last" ]; do last=$now; done
  echo "$now"
}
# wrk_run OUT ARGS...: runs wrk, checks no error answer, sets $rps.
wrk_run() {
  local out=$1; shift
  wrk "$@" > "$out"
  if grep -q "Non-2xx" "$out"; then
    fail "non-2xx answers: $(cat "$out"); the servers' last errors: $(tail -n 3 "$dir"/*.err)"
  fi
  rps=$(awk '/Requests\/sec/ {print $2}' "$out")
}
# check_credits BEFORE OUT LABEL SLACK: the balance grew by 5 per counted credit
# (+ at most SLACK in flight).
check_credits() {
  local before=$1 out=$2 slack=$4 after counted applied
  after=$(balance)
  counted=$(awk '/requests in/ {print $1}' "$out")
  applied=$(( (after - before) / 5 ))
  [ "$applied" -ge "$counted" ] && [ "$applied" -le $((counted + slack)) ] ||
    fail "$3: $counted credits answered, $applied applied"
}
# drive PATH ROUND NAME: one window of PATH on server NAME: credit (wrk
# -c$conns, the balance checked against the credits answered) or p50ms
# (one client, --latency); sets $rps (credits a second, or the p50 in ms).
# The caller sets $conns and $dur.
drive() {
  local path=$1 round=$2 name=$3 b
  url=${urls[$name]}
  b=$(balance)
  case $path in
    credit)
      wrk_run "$dir/credit" -t1 -c"$conns" -d"${dur}s" -s "$root/bench/ledger/credit.lua" "$url" -- "c$round$name$RANDOM"
      check_credits "$b" "$dir/credit" "$name credit" "$conns" ;;
    p50ms)
      wrk_run "$dir/p50" -t1 -c1 -d"${dur}s" --latency -s "$root/bench/ledger/credit.lua" "$url" -- "p$round$name$RANDOM"
      check_credits "$b" "$dir/p50" "$name p50" 1
      rps=$(p50_ms "$dir/p50") ;;
    *) fail "unknown path $path (credit or p50ms)" ;;
  esac
}
p50_ms() {
  python3 -c '
import re, sys
for line in open(sys.argv[1]):
    m = re.match(r"\s+50%\s+([\d.]+)(us|ms|s)\s*$", line)
    if m:
        v = float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
        print(f"{v:.3f}")
' "$1"
}
# pg_schema NAME: a fresh PostgreSQL schema of $PG_URL's database; prints
# the URL whose search_path is that schema.
pg_schema() {
  PGOPTIONS="-c client_min_messages=warning" psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $1 CASCADE; CREATE SCHEMA $1" > /dev/null
  local sep='?'; case $PG_URL in *\?*) sep='&';; esac
  echo "${PG_URL}${sep}options=-c%20search_path%3D$1"
}
# mysql_cli ARGS...: the mariadb (or mysql) client on $MYSQL_URL's server,
# as the URL's user.
mysql_cli() {
  local cli parts
  cli=$(command -v mariadb || command -v mysql) || fail "MYSQL_URL needs the mariadb or mysql client"
  # user, password, host, port.
  mapfile -t parts < <(python3 - "$MYSQL_URL" <<'PY'
import sys
from urllib.parse import unquote, urlsplit
u = urlsplit(sys.argv[1])
print(unquote(u.username or "root"), unquote(u.password or ""), u.hostname or "127.0.0.1", u.port or 3306, sep="\n")
PY
  )
  [ "${#parts[@]}" = 4 ] || fail "MYSQL_URL=$MYSQL_URL: not a mysql://USER[:PASSWORD]@HOST[:PORT]/DB URL"
  MYSQL_PWD=${parts[1]} "$cli" --protocol=tcp -h "${parts[2]}" -P "${parts[3]}" -u "${parts[0]}" "$@"
}
# mysql_db NAME: a fresh database NAME on $MYSQL_URL's server (dropped and
# created); prints the URL of that database.
mysql_db() {
  mysql_cli -e "DROP DATABASE IF EXISTS $1; CREATE DATABASE $1" > /dev/null ||
    fail "MYSQL_URL: could not create database $1"
  python3 -c 'import sys; from urllib.parse import urlsplit; print(urlsplit(sys.argv[1])._replace(path="/" + sys.argv[2]).geturl())' "$MYSQL_URL" "$1"
}
# start_all: the naive ledger and the ledger in both modes on fresh SQLite
# files; with PG_URL the same three on PostgreSQL through tokio-postgres
# (each in a fresh schema), with SQLX_PG=1 too the same three through sqlx
# (fresh schemas again), and with MYSQL_URL the same three on MySQL/MariaDB
# (each in a fresh database of that server); with REDIS_URL the ledger in
# separate mode with its records in Redis and its data in SQLite, beside a
# naive SQLite ledger of its own (REDIS_URL's database is emptied first:
# give it one of its own, e.g. redis://127.0.0.1:6379/9). Sets the array $servers to
# their names (BACKEND-LABEL; BACKEND without a dash).
start_all() {
  servers=(sqlite-naive sqlite-transactional sqlite-separate)
  start sqlite-naive "$naive" --db "$dir/naive.sqlite3"
  # LEDGER_ARGS (split on spaces) go to every ledger: options to measure,
  # e.g. "--encryption-key-file K --wait-in-flight-ms 2000".
  # shellcheck disable=SC2086
  start sqlite-transactional "$ledger" --db "$dir/t.sqlite3" --mode transactional ${LEDGER_ARGS:-}
  # shellcheck disable=SC2086
  start sqlite-separate "$ledger" --db "$dir/s.sqlite3" --mode separate ${LEDGER_ARGS:-}
  if [ -n "${PG_URL:-}" ]; then
    servers+=(postgres-naive postgres-transactional postgres-separate)
    start postgres-naive "$naive" --db "$(pg_schema bench_naive)"
    # shellcheck disable=SC2086
    start postgres-transactional "$ledger" --db "$(pg_schema bench_t)" --mode transactional ${LEDGER_ARGS:-}
    # shellcheck disable=SC2086
    start postgres-separate "$ledger" --db "$(pg_schema bench_s)" --mode separate ${LEDGER_ARGS:-}
  fi
  if [ -n "${SQLX_PG:-}" ]; then
    servers+=(sqlxpg-naive sqlxpg-transactional sqlxpg-separate)
    start sqlxpg-naive "$naive" --db "$(pg_schema bench_sqlx_naive)" --db-driver sqlx
    # shellcheck disable=SC2086
    start sqlxpg-transactional "$ledger" --db "$(pg_schema bench_sqlx_t)" --db-driver sqlx --mode transactional ${LEDGER_ARGS:-}
    # shellcheck disable=SC2086
    start sqlxpg-separate "$ledger" --db "$(pg_schema bench_sqlx_s)" --db-driver sqlx --mode separate ${LEDGER_ARGS:-}
  fi
  if [ -n "${MYSQL_URL:-}" ]; then
    servers+=(mysql-naive mysql-transactional mysql-separate)
    # Assigned first, so that a database not created ends the script.
    local naive_db t_db s_db
    naive_db=$(mysql_db bench_naive); t_db=$(mysql_db bench_t); s_db=$(mysql_db bench_s)
    start mysql-naive "$naive" --db "$naive_db"
    # shellcheck disable=SC2086
    start mysql-transactional "$ledger" --db "$t_db" --mode transactional ${LEDGER_ARGS:-}
    # shellcheck disable=SC2086
    start mysql-separate "$ledger" --db "$s_db" --mode separate ${LEDGER_ARGS:-}
  fi
  if [ -n "${REDIS_URL:-}" ]; then
    command -v redis-cli > /dev/null || fail "REDIS_URL needs redis-cli"
    redis-cli -u "$REDIS_URL" FLUSHDB > /dev/null || fail "REDIS_URL: could not empty $REDIS_URL"
    servers+=(redis-naive redis-separate)
    start redis-naive "$naive" --db "$dir/redis-naive.sqlite3"
    # shellcheck disable=SC2086
    start redis-separate "$ledger" --db "$dir/r.sqlite3" --mode separate --key-store "$REDIS_URL" ${LEDGER_ARGS:-}
  fi
}
# rss_mib PID: the process's resident set (VmRSS), MiB.
rss_mib() { awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$1/status"; }
