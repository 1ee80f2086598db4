#!/usr/bin/env bash
# Two builds of the ledger side by side on one backend: the naive ledger,
# then BEFORE_BIN and AFTER_BIN (release ledgers built with the backend's
# feature) in transactional and in separate mode, each on a fresh database.
# Each path runs on every server in turn, ROUNDS times (default 3), so the
# windows compared are neighbours in time; it prints one line per window
# and then each build's ratio to the naive ledger per round.
#
#   BEFORE_BIN=/tmp/ledger-before AFTER_BIN=target/release/examples/ledger \
#     BACKEND=mysql bench/ledger/ab.sh
#
# BACKEND: sqlite (default), postgres (tokio-postgres), sqlx (PostgreSQL
# through sqlx) or mysql, on PG_URL / MYSQL_URL (the local services by
# default). PATHS (default "credit p50ms"), CONNS, DUR as in compare.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export NO_BUILD=1
backend=${BACKEND:-sqlite}
case $backend in
  postgres|sqlx) export PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432/test} ;;
  mysql) export MYSQL_URL=${MYSQL_URL:-mysql://root@127.0.0.1:3306/test} ;;
  sqlite) ;;
  *) echo "BACKEND=$backend: sqlite, postgres, sqlx or mysql" >&2; exit 2 ;;
esac
source "$here/lib.sh"
before=${BEFORE_BIN:?BEFORE_BIN: the ledger before the change}
after=${AFTER_BIN:?AFTER_BIN: the ledger after it}
rounds=${ROUNDS:-3}; dur=${DUR:-5}; conns=${CONNS:-32}
paths=${PATHS:-credit p50ms}
# db NAME: a fresh database of the backend for server NAME.
db() {
  case $backend in
    sqlite) echo "$dir/$1.sqlite3" ;;
    postgres) pg_schema "ab_$1" ;;
    sqlx) echo "$(pg_schema "ab_$1") --db-driver sqlx" ;;
    mysql) mysql_db "ab_$1" ;;
  esac
}
# shellcheck disable=SC2046 # db's words are arguments
start naive "$naive" --db $(db naive)
servers=(naive)
for build in before after; do
  for mode in transactional separate; do
    bin=$before; [ $build = after ] && bin=$after
    # shellcheck disable=SC2046
    start "$build-$mode" "$bin" --db $(db "${build}_$mode") --mode "$mode"
    servers+=("$build-$mode")
  done
done
for round in $(seq 1 "$rounds"); do
  for path in $paths; do
    for name in "${servers[@]}"; do
      drive "$path" "$round" "$name"
      echo "$round $path $name $rps" | tee -a "$results"
    done
  done
done
python3 - "$results" <<'PY'
import collections, statistics, sys
windows = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    rnd, path, name, value = line.split()
    windows[(path, rnd)][name] = float(value)
for path in ("credit", "p50ms"):
    for name in ("before-transactional", "after-transactional", "before-separate", "after-separate"):
        # credits: ratio to naive; p50: ms over naive; one figure per round
        per = [w[name] / w["naive"] if path == "credit" else w[name] - w["naive"]
               for (p, _), w in sorted(windows.items()) if p == path and name in w]
        if per:
            label = "ratio" if path == "credit" else "ms over naive"
            print(f"{path:6} {name:21} {label}: " + " ".join(f"{v:.3f}" for v in per)
                  + f"  median {statistics.median(per):.3f}")
PY
