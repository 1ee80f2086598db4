#!/usr/bin/env bash
# Instructions per request (valgrind --tool=callgrind), stable on a noisy
# machine: the ledger example (release) serving exactly N requests of one
# path after a warm-up, all threads counted (async workers, the blocking
# pool, the SQLite writer), divided by N. Paths:
#   get     GET /accounts/1, passed through by the layer (no key)
#   replay  a credit repeating one key (answered from the stored response)
#   credit  a credit with a new key (claim, handler, record, commit)
# and the same on the naive ledger (bench/naive-ledger) for reference.
#
#   bench/ledger/callgrind.sh [transactional|separate]     # N=${N:-2000}
#   PG_URL=postgres://... bench/ledger/callgrind.sh ...     # and on PostgreSQL
#
# With PG_URL, the same two servers again on PostgreSQL (the ledger built
# with --features postgres), each in a fresh schema of that database (needs
# psql); only the servers' own instructions are counted, not PostgreSQL's.
# Builds nothing: run bench/ledger/compare.sh (or the cargo builds in it)
# first. Needs valgrind (callgrind_control) and python3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mode=${1:-transactional}
n=${N:-2000}
target=${CARGO_TARGET_DIR:-$root/target}
dir=$(mktemp -d)
vg=""
cleanup() { [ -n "$vg" ] && kill "$vg" 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT

# requests PORT PATH COUNT: COUNT requests on one keep-alive connection.
requests() {
  python3 - "$@" <<'EOF'
import http.client, sys, uuid
port, path, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
c = http.client.HTTPConnection("127.0.0.1", port)
h = {"Authorization": "Bearer bench", "Content-Type": "application/json"}
for i in range(count):
    if path == "get":
        c.request("GET", "/accounts/1", headers=h)
        want = 200
    else:
        key = '"replay-1"' if path == "replay" else f'"cg-{uuid.uuid4()}"'
        c.request("POST", "/accounts/1/credits", body=b'{"amount": 5}',
                  headers={**h, "Idempotency-Key": key})
        want = 201
    r = c.getresponse()
    r.read()
    if r.status != want:
        sys.exit(f"{path}: answered {r.status}")
EOF
}

# count LABEL BINARY ARGS...: instructions per request for each path.
count() {
  local label=$1; shift
  local port=$((15300 + RANDOM % 90))
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.%p" "$@" --listen "127.0.0.1:$port" \
    > "$dir/out" 2> "$dir/vg.err" &
  vg=$!
  for _ in $(seq 1 600); do grep -q "listening on" "$dir/out" 2>/dev/null && break; sleep 0.1; done
  grep -q "listening on" "$dir/out" || { cat "$dir/vg.err"; exit 1; }
  curl -sf -X POST "http://127.0.0.1:$port/accounts" -H 'Authorization: Bearer bench' \
    -H 'Content-Type: application/json' -H 'Idempotency-Key: "acct-1"' -d '{"name":"bench"}' > /dev/null
  curl -sf -X POST "http://127.0.0.1:$port/accounts/1/credits" -H 'Authorization: Bearer bench' \
    -H 'Content-Type: application/json' -H 'Idempotency-Key: "replay-1"' -d '{"amount": 5}' > /dev/null
  local paths="get credit"
  case $label in *naive) ;; *) paths="get replay credit" ;; esac
  local line="$label"
  for path in $paths; do
    requests "$port" "$path" 200            # warm-up
    callgrind_control -z "$vg" > /dev/null 2>&1
    requests "$port" "$path" "$n"
    callgrind_control -d "$vg" > /dev/null 2>&1
    local file
    file=$(ls -t "$dir"/cg."$vg".* | head -1)
    local ir
    ir=$(awk '/^(summary|totals):/ {print $2}' "$file" | tail -1)
    line="$line $path=$((ir / n))"
    rm -f "$dir"/cg."$vg".*
  done
  kill "$vg"; wait "$vg" 2>/dev/null || true; vg=""
  echo "$line"
}

# pg_schema NAME: a fresh schema NAME in $PG_URL; prints the URL that uses it.
pg_schema() {
  PGOPTIONS="-c client_min_messages=warning" psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $1 CASCADE; CREATE SCHEMA $1" > /dev/null
  local sep='?'; case $PG_URL in *\?*) sep='&';; esac
  echo "${PG_URL}${sep}options=-c%20search_path%3D$1"
}

ledger=${LEDGER_BIN:-$target/release/examples/ledger}
count naive "$target/release/naive-ledger" --db "$dir/naive.sqlite3"
count "ledger-$mode" "$ledger" --db "$dir/ledger.sqlite3" --mode "$mode"
if [ -n "${PG_URL:-}" ]; then
  count postgres-naive "$target/release/naive-ledger" --db "$(pg_schema cg_naive)"
  count "postgres-ledger-$mode" "$ledger" --db "$(pg_schema cg_ledger)" --mode "$mode"
fi
