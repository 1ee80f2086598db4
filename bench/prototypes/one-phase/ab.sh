#!/bin/bash
# A/B of the one-phase prototype on PostgreSQL (see README.md): the naive
# ledger, the ledger as landed (BASE_BIN), and the prototype's build
# (PROTO_BIN) under each TI_PROTO variant, each on a fresh schema of PG_URL.
# Each path runs on every server in turn, ROUNDS times (wrk -c32 for
# credits, -c1 --latency for p50ms). With CPU=1 it also prints the CPU
# seconds per credit of the server process and of every postgres process.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
export NO_BUILD=1 PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432/test}
source "$root/bench/ledger/lib.sh"
ledger_base=${BASE_BIN:?the ledger as landed}
ledger_proto=${PROTO_BIN:?the ledger built with prototype.patch}
rounds=${ROUNDS:-3}; dur=${DUR:-5}; conns=${CONNS:-32}
paths=${PATHS:-credit p50ms}
variants=${VARIANTS:-pipe one one2}
servers=(pg-naive pg-base)
start pg-naive "$naive" --db "$(pg_schema ab_naive)"
start pg-base "$ledger_base" --db "$(pg_schema ab_base)" --mode transactional
for v in $variants; do
  TI_PROTO=$v start "pg-$v" "$ledger_proto" --db "$(pg_schema "ab_$v")" --mode transactional
  servers+=("pg-$v")
done
for round in $(seq 1 "$rounds"); do
  for path in $paths; do
    for name in "${servers[@]}"; do
      [ -z "${CPU:-}" ] || python3 "$here/cpu.py" snapshot "$dir/s1" "${pids[$name]}"
      drive "$path" "$round" "$name"
      if [ -n "${CPU:-}" ] && [ "$path" = credit ]; then
        python3 "$here/cpu.py" snapshot "$dir/s2" "${pids[$name]}"
        n=$(awk '/requests in/ {print $1}' "$dir/credit")
        read -r app pg < <(python3 "$here/cpu.py" diff "$dir/s1" "$dir/s2")
        rps="$rps $(python3 -c 'import sys; n, a, p = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]); print(f"app_us={a / n * 1e6:.0f} pg_us={p / n * 1e6:.0f}")' "$n" "$app" "$pg")"
      fi
      echo "$round $path $name $rps"
    done
  done
done
