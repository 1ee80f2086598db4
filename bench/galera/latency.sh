#!/usr/bin/env bash
# The cost of a Galera cluster per credit: the release ledger on one MariaDB
# server and on one node of a Galera cluster (configured as in
# .ci/steps/galera.sh), each on a fresh database, in both modes; one-client
# p50 (wrk -c1 5 s) and credits/s at 32 connections (wrk -c32 5 s), new keys.
#
#   bench/galera/latency.sh target/release/examples/ledger \
#       mysql://root@127.0.0.1:3306 mysql://root@127.0.0.1:14306
set -euo pipefail
ledger=$1 one=$2 galera=$3
here=$(cd "$(dirname "$0")" && pwd)
credit=$here/../ledger/credit.lua
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$dir"' EXIT
measure() { # name server-url mode
    local db="latency_$1_$3_$$" out=$dir/$1-$3.out url p50 rps
    mariadb -uroot -h127.0.0.1 -P"${2##*:}" -e "CREATE DATABASE $db"
    "$ledger" --db "$2/$db" --mode "$3" --listen 127.0.0.1:0 > "$out" 2>/dev/null &
    for _ in $(seq 1 100); do grep -qs "listening on" "$out" && break; sleep 0.1; done
    url=$(grep -o 'http://[0-9.:]*' "$out" | head -1)
    curl -sf -X POST "$url/accounts" -H 'Authorization: Bearer bench' -H 'Content-Type: application/json' \
        -H 'Idempotency-Key: "account"' -d '{"name":"bench"}' > /dev/null
    p50=$(wrk -t1 -c1 -d5s --latency -s "$credit" "$url" -- "p$RANDOM" | awk '/ 50%/ {print $2}')
    rps=$(wrk -t1 -c32 -d5s -s "$credit" "$url" -- "c$RANDOM" | awk '/Requests\/sec/ {print $2}')
    echo "$1 $3: one-client p50 $p50, credits/s at 32 connections $rps"
    kill %%
}
for mode in transactional separate; do
    measure one "$one" "$mode"
    measure galera "$galera" "$mode"
done
