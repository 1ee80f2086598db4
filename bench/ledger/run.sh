#!/usr/bin/env bash
# The main job measured from outside: the ledger example's release binary
# under wrk on loopback, in transactional mode on a fresh SQLite file.
#
#   cargo build --release --example ledger
#   bench/ledger/run.sh LABEL target/release/examples/ledger
#
# Prints requests per second for three routes of one server: GET
# /accounts/1 (the baseline: a route the layer does not cover), POST credits
# with a new Idempotency-Key each (wrk counter per connection), and POST
# credits repeating one key (replays), plus wrk's count of non-2xx/3xx
# answers and the final balance (5 per credit actually applied). DUR sets
# seconds per route (default 8). Needs wrk and curl.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
label=$1; bin=$2; dur=${DUR:-8}
dir=$(mktemp -d)
"$bin" --db "$dir/ledger.sqlite3" --listen 127.0.0.1:0 > "$dir/out" 2>"$dir/err" &
pid=$!
for _ in $(seq 1 100); do grep -q "listening on" "$dir/out" 2>/dev/null && break; sleep 0.1; done
url=$(grep -o 'http://[0-9.:]*' "$dir/out" | head -1)
curl -s -X POST "$url/accounts" -H 'Content-Type: application/json' -H 'Authorization: Bearer bench' -H 'Idempotency-Key: "acct-1"' -d '{"name":"bench"}' > /dev/null
curl -s -X POST "$url/accounts/1/credits" -H 'Content-Type: application/json' -H 'Authorization: Bearer bench' -H 'Idempotency-Key: "replay-1"' -d '{"amount": 5}' > /dev/null
rps() { awk '/Requests\/sec/ {print $2}'; }
get=$(wrk -t1 -c16 -d${dur}s "$url/accounts/1" | rps)
credit=$(wrk -t1 -c16 -d${dur}s -s "$here/credit.lua" "$url" | tee "$dir/credit.txt" | rps)
replay=$(wrk -t1 -c16 -d${dur}s -s "$here/replay.lua" "$url" | tee "$dir/replay.txt" | rps)
errs=$(grep -h STATUS "$dir/credit.txt" "$dir/replay.txt" | tr '\n' ' ')
bal=$(curl -s "$url/accounts/1" -H 'Authorization: Bearer bench')
kill $pid; wait $pid 2>/dev/null || true
echo "$label get=$get credit=$credit replay=$replay  [$errs] balance=$bal"
rm -rf "$dir"
