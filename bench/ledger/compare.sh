#!/usr/bin/env bash
# The ledger example against the naive ledger (bench/naive-ledger: the same
# three endpoints, no idempotency, one transaction per credit), under wrk on
# loopback. One command:
#
#   bench/ledger/compare.sh                 # SQLite
#   PG_URL=postgres://postgres@127.0.0.1:5432/DB bench/ledger/compare.sh   # also PostgreSQL
#
# Builds both (release), starts the naive ledger, the ledger in
# transactional mode and the ledger in separate mode (each on a fresh
# database; with PG_URL the same three again on PostgreSQL, each in a fresh
# schema of that database), and then, for ROUNDS rounds (default 3), drives
# each path on every server in turn with wrk -t1 -c$CONNS (default 32) for
# DUR seconds (default 5), so that the windows compared are neighbours in
# time:
#   get     GET /accounts/1 (passed through by the layer)
#   credit  POST /accounts/1/credits with a new Idempotency-Key per request
#   replay  the same credit and key again and again (ledger only; its
#           baseline is the naive GET of one row)
#   p50ms   one client (-c1) posting new-key credits: wrk's p50 latency, ms
# After every credit window the balance is read back (once it has settled)
# and checked against the answers wrk counted (5 per credit; a credit in
# flight when wrk stops may land uncounted, so at most CONNS more), and a
# replay window must not move it. A failed check or any non-2xx answer ends
# the script with status 1. Prints every window, the medians, and the
# ledger/naive ratios as Markdown. LEDGER_BIN=PATH measures another build
# of the ledger (e.g. an older one); NO_BUILD=1 skips the builds.
# Needs wrk, curl, python3 (and psql for PostgreSQL).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
rounds=${ROUNDS:-3}; dur=${DUR:-5}; conns=${CONNS:-32}
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
declare -A pids
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$dir"; }
trap cleanup EXIT

auth=(-H 'Authorization: Bearer bench' -H 'Content-Type: application/json')
fail() { echo "FAILED: $*" >&2; exit 1; }

# start NAME ARGS...: a server on a free port, kept up for the whole run.
declare -A urls
start() {
  local name=$1; shift
  "$@" --listen 127.0.0.1:0 > "$dir/$name.out" 2> "$dir/$name.err" &
  pids[$name]=$!
  for _ in $(seq 1 200); do grep -q "listening on" "$dir/$name.out" && break; sleep 0.05; done
  urls[$name]=$(grep -o 'http://[0-9.:]*' "$dir/$name.out" | head -1)
  [ -n "${urls[$name]}" ] || fail "$name did not start: $(cat "$dir/$name.err")"
  url=${urls[$name]}
  curl -sf -X POST "$url/accounts" "${auth[@]}" -H 'Idempotency-Key: "acct-1"' -d '{"name":"bench"}' > /dev/null ||
    fail "$name: account not created"
  curl -sf -X POST "$url/accounts/1/credits" "${auth[@]}" -H 'Idempotency-Key: "replay-1"' -d '{"amount": 5}' > /dev/null ||
    fail "$name: first credit failed"
}
read_balance() { curl -sf "$url/accounts/1" "${auth[@]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["balance"])'; }
# The balance once the credits still in flight when wrk stopped have landed
# (two reads 0.3 s apart agree).
balance() { curl -sf "$url/accounts/1" "${auth[@]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["balance"])'; }
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
  if grep -q "Non-2xx" "$out"; then fail "non-2xx answers: $(cat "$out")"; fi
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

# window ROUND PATH NAME: one wrk window of PATH on server NAME (BACKEND-LABEL).
window() {
  local round=$1 path=$2 name=$3 b
  local backend=${name%%-*} label=${name#*-}
  url=${urls[$name]}
  case $path in
    get)
      wrk_run "$dir/get" -t1 -c"$conns" -d"${dur}s" "$url/accounts/1" ;;
    credit)
      b=$(balance)
      wrk_run "$dir/credit" -t1 -c"$conns" -d"${dur}s" -s "$here/credit.lua" "$url" -- "c$round$name$RANDOM"
      check_credits "$b" "$dir/credit" "$name credit" "$conns" ;;
    replay)
      [ "$label" = naive ] && return
      b=$(balance)
      wrk_run "$dir/replay" -t1 -c"$conns" -d"${dur}s" -s "$here/replay.lua" "$url"
      [ "$(balance)" = "$b" ] || fail "$name: a replay moved the balance" ;;
    p50ms)
      b=$(balance)
      wrk_run "$dir/p50" -t1 -c1 -d"${dur}s" --latency -s "$here/credit.lua" "$url" -- "p$round$name$RANDOM"
      check_credits "$b" "$dir/p50" "$name p50" 1
      rps=$(p50_ms "$dir/p50") ;;
  esac
  echo "$round $backend $label $path $rps" >> "$results"
  printf '%s ' "$name $path=$rps"
}

# A fresh PostgreSQL schema per server run: URL with its search_path.
pg_schema() {
  psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $1 CASCADE; CREATE SCHEMA $1" > /dev/null
  local sep='?'; case $PG_URL in *\?*) sep='&';; esac
  echo "${PG_URL}${sep}options=-c%20search_path%3D$1"
}

echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
servers=(sqlite-naive sqlite-transactional sqlite-separate)
start sqlite-naive "$naive" --db "$dir/naive.sqlite3"
start sqlite-transactional "$ledger" --db "$dir/t.sqlite3" --mode transactional
start sqlite-separate "$ledger" --db "$dir/s.sqlite3" --mode separate
if [ -n "${PG_URL:-}" ]; then
  servers+=(postgres-naive postgres-transactional postgres-separate)
  start postgres-naive "$naive" --db "$(pg_schema bench_naive)"
  start postgres-transactional "$ledger" --db "$(pg_schema bench_t)" --mode transactional
  start postgres-separate "$ledger" --db "$(pg_schema bench_s)" --mode separate
fi
# Each path in turn on every server, so that the windows compared are
# neighbours in time (the machine's load drifts).
for round in $(seq 1 "$rounds"); do
  for path in get credit replay p50ms; do
    for name in "${servers[@]}"; do window "$round" "$path" "$name"; done
    echo
  done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$results" "$rounds" "$dur" "$conns" <<'EOF'
import statistics, sys
from collections import defaultdict
rows = [l.split() for l in open(sys.argv[1])]
v = defaultdict(list)
for _, backend, label, metric, value in rows:
    v[(backend, label, metric)].append(float(value))
med = {k: statistics.median(x) for k, x in v.items()}
print(f"\nmedians of {sys.argv[2]} rounds, wrk -t1 -c{sys.argv[4]}, {sys.argv[3]} s windows\n")
for backend in ("sqlite", "postgres"):
    if (backend, "naive", "get") not in med:
        continue
    n = lambda m: med[(backend, "naive", m)]
    print(f"### {backend}\n")
    print("| path | naive | transactional | ratio | separate | ratio |")
    print("|---|---|---|---|---|---|")
    for name, metric, base in (
        ("GET /accounts/1 (passed through), req/s", "get", "get"),
        ("credit, new key, req/s", "credit", "credit"),
        ("replayed credit vs naive GET, req/s", "replay", "get"),
    ):
        cells = [f"{n(base):,.0f}"]
        for mode in ("transactional", "separate"):
            x = med[(backend, mode, metric)]
            cells += [f"{x:,.0f}", f"**{x / n(base):.2f}**"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{n('p50ms'):.3f}"]
    for mode in ("transactional", "separate"):
        x = med[(backend, mode, "p50ms")]
        cells += [f"{x:.3f}", f"**{x - n('p50ms'):+.3f} ms**"]
    print("| one client, credit p50 latency, ms (difference) | " + " | ".join(cells) + " |\n")
EOF
