#!/usr/bin/env bash
# The ledger example against the naive ledger (bench/naive-ledger: the same
# three endpoints, no idempotency, one transaction per credit), under wrk on
# loopback. One command:
#
#   bench/ledger/compare.sh                 # SQLite
#   PG_URL=postgres://postgres@127.0.0.1:5432/DB bench/ledger/compare.sh   # also PostgreSQL
#   PG_URL=... SQLX_PG=1 bench/ledger/compare.sh      # also PostgreSQL through sqlx
#   MYSQL_URL=mysql://root@127.0.0.1:3306/DB bench/ledger/compare.sh       # also MySQL/MariaDB
#   REDIS_URL=redis://127.0.0.1:6379/9 bench/ledger/compare.sh   # also records in Redis (emptied first)
#   ALL=1 bench/ledger/compare.sh           # every backend, on the local services
#
# ALL=1 sets whichever of PG_URL (postgres://postgres@127.0.0.1:5432/test),
# SQLX_PG (1), MYSQL_URL (mysql://root@127.0.0.1:3306/test) and REDIS_URL
# (redis://127.0.0.1:6379/9) is unset, so that one command gives the whole
# table: SQLite, PostgreSQL through tokio-postgres and through sqlx,
# MySQL/MariaDB, and records in Redis beside SQLite data (one set empty,
# e.g. MYSQL_URL=, stays off).
#
# Builds both (release; the ledger with the features the backends need),
# starts the naive ledger, the ledger in transactional mode and the ledger
# in separate mode (each on a fresh database), and the same three again on
# every other backend asked for: with PG_URL on PostgreSQL through
# tokio-postgres, each in a fresh schema of that database; with SQLX_PG=1
# too, on PostgreSQL through sqlx (the ledger's and the naive ledger's
# --db-driver sqlx), in fresh schemas again; with MYSQL_URL on MySQL/MariaDB
# through sqlx, each in a fresh database of that server (bench_naive,
# bench_t, bench_s, dropped and created anew: the URL's user needs the right
# to). Each naive ledger uses the client library its ledger uses. Then, for
# ROUNDS rounds (default 3), drives each path on every server in turn with
# wrk -t1 -c$CONNS (default 32) for DUR seconds (default 5), so that the
# windows compared are neighbours in time:
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
# of the ledger (e.g. an older one), NAIVE_BIN=PATH another build of the
# naive ledger; NO_BUILD=1 skips the builds; OUT=FILE
# appends the raw windows to FILE; CHART=FILE.svg draws BENCHMARKS.md's
# chart (bench/ledger/chart.py); PATHS and CONNS choose what is driven;
# LEDGER_ARGS adds options to every ledger (the naive one is unchanged).
# Needs wrk, curl, python3 (and psql for PostgreSQL, the mariadb or mysql
# client for MySQL, redis-cli for Redis).
set -euo pipefail
if [ -n "${ALL:-}" ]; then
  PG_URL=${PG_URL-postgres://postgres@127.0.0.1:5432/test}
  SQLX_PG=${SQLX_PG-${PG_URL:+1}}
  MYSQL_URL=${MYSQL_URL-mysql://root@127.0.0.1:3306/test}
  REDIS_URL=${REDIS_URL-redis://127.0.0.1:6379/9}
fi
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
rounds=${ROUNDS:-3}; dur=${DUR:-5}; conns=${CONNS:-32}
paths=${PATHS:-get credit replay p50ms}
source "$here/lib.sh"

# window ROUND PATH NAME: one wrk window of PATH on server NAME (BACKEND-LABEL).
window() {
  local round=$1 path=$2 name=$3 b
  local backend=${name%%-*} label=${name#*-}
  url=${urls[$name]}
  case $path in
    get)
      wrk_run "$dir/get" -t1 -c"$conns" -d"${dur}s" "$url/accounts/1" ;;
    credit|p50ms)
      drive "$path" "$round" "$name" ;;
    replay)
      [ "$label" = naive ] && return
      b=$(balance)
      wrk_run "$dir/replay" -t1 -c"$conns" -d"${dur}s" -s "$here/replay.lua" "$url"
      [ "$(balance)" = "$b" ] || fail "$name: a replay moved the balance" ;;
  esac
  echo "$round $backend $label $path $rps $conns" >> "$results"
  printf '%s ' "$name $path=$rps"
}

echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
start_all
# Each path in turn on every server, so that the windows compared are
# neighbours in time (the machine's load drifts).
for round in $(seq 1 "$rounds"); do
  for path in $paths; do
    for name in "${servers[@]}"; do window "$round" "$path" "$name"; done
    echo
  done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
[ -n "${OUT:-}" ] && cat "$results" >> "$OUT"
[ -z "${CHART:-}" ] || python3 "$here/chart.py" "$results" "$CHART"

python3 "$here/table.py" "$results"
