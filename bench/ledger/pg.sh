#!/usr/bin/env bash
# The ledger example's release binary under wrk on loopback, on PostgreSQL.
#
#   cargo build --release --example ledger --features sqlite,postgres
#   PG_URL=postgres://postgres@127.0.0.1:5432/DB bench/ledger/pg.sh LABEL BIN MODE
#
# MODE is transactional or separate. DROPS AND RECREATES the schema `public`
# of PG_URL's database first: give it a database of its own. Prints
# requests per second with 32 connections (-c32) for GET /accounts/1 (one
# row, a route the layer does not cover), POST credits with a new
# Idempotency-Key each, POST credits repeating one key (replays), the p50
# latency of new-key credits from one connection, and wrk's count of
# non-2xx/3xx answers. DUR sets seconds per run (default 8), PORT the
# listening port (default 15801). Needs wrk, curl and psql.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
label=$1; bin=$2; mode=$3; dur=${DUR:-8}; port=${PORT:-15801}
db=${PG_URL:?set PG_URL}
dir=$(mktemp -d)
psql -q "$db" -c "DROP SCHEMA public CASCADE; CREATE SCHEMA public;" > /dev/null 2>&1
"$bin" --db "$db" --mode "$mode" --listen "127.0.0.1:$port" > "$dir/out" 2> "$dir/err" &
pid=$!
for _ in $(seq 1 100); do grep -q "listening on" "$dir/out" 2>/dev/null && break; sleep 0.1; done
url=http://127.0.0.1:$port
curl -s -X POST "$url/accounts" -H 'Content-Type: application/json' -H 'Authorization: Bearer bench' -H 'Idempotency-Key: "acct-1"' -d '{"name":"bench"}' > /dev/null
curl -s -X POST "$url/accounts/1/credits" -H 'Content-Type: application/json' -H 'Authorization: Bearer bench' -H 'Idempotency-Key: "replay-1"' -d '{"amount": 5}' > /dev/null
rps() { awk '/Requests\/sec/ {print $2}'; }
get=$(wrk -t1 -c32 -d"${dur}s" "$url/accounts/1" | rps)
credit=$(wrk -t1 -c32 -d"${dur}s" -s "$here/credit.lua" "$url" | tee "$dir/credit.txt" | rps)
replay=$(wrk -t1 -c32 -d"${dur}s" -s "$here/replay.lua" "$url" | tee "$dir/replay.txt" | rps)
p50=$(wrk -t1 -c1 -d"${dur}s" --latency -s "$here/credit.lua" "$url" | awk '/ 50%/ {print $2}')
errs=$(grep -h STATUS "$dir/credit.txt" "$dir/replay.txt" | tr '\n' ' ')
kill $pid; wait $pid 2>/dev/null || true
echo "$label mode=$mode get=$get credit=$credit replay=$replay one-client-credit-p50=$p50 [$errs]"
rm -rf "$dir"
