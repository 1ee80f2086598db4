# Shared by compare.sh and scale.sh (sourced, not run; the caller sets $here
# and $root): builds the release ledger (with PostgreSQL if PG_URL is set)
# and the naive ledger unless NO_BUILD=1, makes a scratch directory $dir
# removed on exit with every server started, and defines what starts
# servers on free ports, drives them with wrk and reads the balance back.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
features=""; [ -n "${PG_URL:-}" ] && features="--features postgres"
if [ -z "${NO_BUILD:-}" ]; then
  (cd "$root" && cargo build -q --release --example ledger $features)
  cargo build -q --release --manifest-path "$root/bench/naive-ledger/Cargo.toml"
fi
ledger=${LEDGER_BIN:-$CARGO_TARGET_DIR/release/examples/ledger}
naive=$CARGO_TARGET_DIR/release/naive-ledger
dir=$(mktemp -d)
results=$dir/results
declare -A pids urls
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$dir"; }
trap cleanup EXIT

auth=(-H 'Authorization: Bearer bench' -H 'Content-Type: application/json')
fail() { echo "FAILED: $*" >&2; exit 1; }

# launch NAME ARGS...: a server on a free port, kept until the script ends;
# sets ${urls[NAME]} and $url.
launch() {
  local name=$1; shift
  "$@" --listen 127.0.0.1:0 > "$dir/$name.out" 2> "$dir/$name.err" &
  pids[$name]=$!
  for _ in $(seq 1 200); do grep -q "listening on" "$dir/$name.out" && break; sleep 0.05; done
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
# start_all: the naive ledger and the ledger in both modes on fresh SQLite
# files, and with PG_URL the same three on PostgreSQL (each in a fresh
# schema); sets the array $servers to their names (BACKEND-LABEL).
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
}
# rss_mib PID: the process's resident set (VmRSS), MiB.
rss_mib() { awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$1/status"; }
