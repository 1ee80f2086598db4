#!/usr/bin/env bash
# How the ledger's cost grows (BENCHMARKS.md, "How the cost grows"). One
# subcommand per question; each prints its windows and a Markdown table.
#
#   bench/ledger/scale.sh sweep   # GETs, credits and replays at 1, 8, 32, 128 connections
#   bench/ledger/scale.sh fill    # 1,000,000 stored records against 1,000
#   bench/ledger/scale.sh sizes   # replays of 1 KiB, 64 KiB, 1 MiB against the same bytes without the layer
#   bench/ledger/scale.sh rss     # VmRSS every 10 s over 1,000,000 requests per server
#   bench/ledger/scale.sh why     # per credit: fsyncs, busy-handler sleeps, context switches, CPU, PostgreSQL lock waits
#
# PG_URL=postgres://... adds PostgreSQL to sweep and fill (each server in a
# fresh schema of that database). ROUNDS (sweep: 1; fill, sizes: 3) and DUR
# (seconds per wrk window, 5) as in compare.sh; FILL (1000000) and SMALL (1000) for fill;
# REQUESTS (1000000) and WINDOW (seconds per sample, 10) for rss. Builds the release binaries
# first unless NO_BUILD=1. Any non-2xx answer, or a balance that does not
# match the answers counted, ends the run with status 1. Needs wrk, curl,
# python3 (and psql for PostgreSQL).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dur=${DUR:-5}
what=${1:?"sweep, fill, sizes, rss or why"}
source "$here/lib.sh"
[ -n "${NO_BUILD:-}" ] || cargo build -q --release --manifest-path "$root/bench/replay-size/Cargo.toml"
echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"

sweep() {
  local out=$dir/sweep
  for c in 1 8 32 128; do
    CONNS=$c PATHS="get credit replay" ROUNDS=${ROUNDS:-1} DUR=$dur OUT=$out NO_BUILD=1 \
      LEDGER_BIN=$ledger "$here/compare.sh" > "$dir/sweep-$c.log" || { cat "$dir/sweep-$c.log"; fail "compare.sh -c$c"; }
    grep -v '^|\|^#\|^$' "$dir/sweep-$c.log" | sed "s/^/c$c: /"
  done
  python3 "$here/table.py" "$out"
  [ -n "${OUT:-}" ] && cp "$out" "$OUT"
  return 0
}

# fill_sqlite FILE N / fill_pg SCHEMA N: N completed records, copies of the
# one stored for "replay-1" (same scope, fingerprint and response) under the
# keys fill-1 .. fill-N.
fill_sqlite() {
  python3 - "$1" "$2" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=30)
db.execute("""WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)
  INSERT INTO idempotency_records SELECT r.scope, 'fill-' || i, r.fingerprint, r.token, r.state,
    r.lease_until, r.expires_at, r.response FROM n, idempotency_records r WHERE r.key = 'replay-1'""",
  (int(sys.argv[2]),))
db.commit()
db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
print(db.execute("SELECT count(*) FROM idempotency_records").fetchone()[0], "records", file=sys.stderr)
PY
}
fill_pg() {
  psql -q "$PG_URL" -c "INSERT INTO $1.idempotency_records SELECT r.scope, 'fill-' || i, r.fingerprint,
    r.token, r.state, r.lease_until, r.expires_at, r.response FROM $1.idempotency_records r,
    generate_series(1, $2) i WHERE r.key = 'replay-1'" -c "VACUUM ANALYZE $1.idempotency_records" > /dev/null
}

fill() {
  local n=${FILL:-1000000} small=${SMALL:-1000} rounds=${ROUNDS:-3} servers=() name b
  for mode in transactional separate; do
    for size in "$small" "$n"; do
      name=sqlite-$mode-$size
      start "$name" "$ledger" --db "$dir/$name.sqlite3" --mode "$mode"
      fill_sqlite "$dir/$name.sqlite3" "$size"
      servers+=("$name")
      if [ -n "${PG_URL:-}" ]; then
        name=postgres-$mode-$size
        local schema=bench_${mode:0:1}_$size
        start "$name" "$ledger" --db "$(pg_schema "$schema")" --mode "$mode"
        fill_pg "$schema" "$size"
        servers+=("$name")
      fi
    done
  done
  for round in $(seq 1 "$rounds"); do
    for path in credit replay random; do
      for name in "${servers[@]}"; do
        url=${urls[$name]}
        case $path in
          credit)
            b=$(balance)
            wrk_run "$dir/w" -t1 -c32 -d"${dur}s" -s "$here/credit.lua" "$url" -- "f$round$name"
            check_credits "$b" "$dir/w" "$name credit" 32 ;;
          replay)
            b=$(balance)
            wrk_run "$dir/w" -t1 -c32 -d"${dur}s" -s "$here/replay.lua" "$url"
            [ "$(balance)" = "$b" ] || fail "$name: a replay moved the balance" ;;
          random)
            b=$(balance)
            local size=${name##*-}
            wrk_run "$dir/w" -t1 -c32 -d"${dur}s" -s "$here/replay-random.lua" "$url" -- "$size"
            [ "$(balance)" = "$b" ] || fail "$name: a replay moved the balance" ;;
        esac
        echo "$round $name $path $rps" | tee -a "$results"
      done
    done
  done
  python3 - "$results" "$n" "$small" <<'PY'
import statistics, sys
from collections import defaultdict
v = defaultdict(list)
for line in open(sys.argv[1]):
    _, name, path, x = line.split()
    backend, mode, size = name.split("-")
    v[(backend, mode, size, path)].append(float(x))
med = {k: statistics.median(x) for k, x in v.items()}
n, small = sys.argv[2], sys.argv[3]
print(f"\n| backend, mode | path | {int(small):,} records, req/s | {int(n):,} records, req/s | ratio |")
print("|---|---|---|---|---|")
for (backend, mode, size, path), x in sorted(med.items()):
    if size != small:
        continue
    y = med[(backend, mode, n, path)]
    what = {"credit": "credit, new key", "replay": "replay of one key",
            "random": "replay of a random stored key"}[path]
    print(f"| {backend}, {mode} | {what} | {x:,.0f} | {y:,.0f} | **{y / x:.3f}** |")
PY
}

sizes() {
  local rounds=${ROUNDS:-3} sizes=(1024 65536 1048576) s
  launch replay-size "$CARGO_TARGET_DIR/release/replay-size" --db "$dir/sizes.sqlite3"
  for s in "${sizes[@]}"; do
    # The first answer, then a replay: exact bytes, marked as a replay.
    curl -sf -X POST "$url/layer/$s" -H 'x-user: bench' -H "Idempotency-Key: \"size-$s\"" -o "$dir/first" || fail "first $s"
    curl -sf -X POST "$url/layer/$s" -H 'x-user: bench' -H "Idempotency-Key: \"size-$s\"" -D "$dir/h" -o "$dir/again" || fail "replay $s"
    curl -sf -X POST "$url/naive/$s" -o "$dir/naive"
    cmp -s "$dir/first" "$dir/again" && cmp -s "$dir/first" "$dir/naive" || fail "$s: the replay's bytes differ"
    [ "$(stat -c %s "$dir/again")" = "$s" ] || fail "$s: $(stat -c %s "$dir/again") bytes"
    grep -qi '^idempotent-replayed: true' "$dir/h" || fail "$s: not marked as a replay"
  done
  for round in $(seq 1 "$rounds"); do
    for s in "${sizes[@]}"; do
      for side in naive layer; do
        wrk_run "$dir/w" -t1 -c32 -d"${dur}s" -s "$here/size.lua" "$url" -- "$side" "$s"
        echo "$round $s $side $rps" | tee -a "$results"
      done
    done
  done
  # A replay is still a replay after the windows (the handler never ran again).
  curl -sf -X POST "$url/layer/65536" -H 'x-user: bench' -H 'Idempotency-Key: "size-65536"' -D "$dir/h" -o /dev/null
  grep -qi '^idempotent-replayed: true' "$dir/h" || fail "65536: not a replay after the run"
  python3 - "$results" <<'PY'
import statistics, sys
from collections import defaultdict
v = defaultdict(list)
for line in open(sys.argv[1]):
    _, size, side, x = line.split()
    v[(int(size), side)].append(float(x))
print("\n| response | naive, req/s | naive, MB/s | replay, req/s | replay, MB/s | ratio |")
print("|---|---|---|---|---|---|")
for size in sorted({s for s, _ in v}):
    n, r = statistics.median(v[(size, "naive")]), statistics.median(v[(size, "layer")])
    label = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
    print(f"| {label} | {n:,.0f} | {n * size / 1e6:,.1f} | {r:,.0f} | {r * size / 1e6:,.1f} | **{r / n:.2f}** |")
PY
}

rss() {
  local total=${REQUESTS:-1000000} window=${WINDOW:-10} name n c r
  declare -A sent windows
  start naive "$naive" --db "$dir/naive.sqlite3"
  start transactional "$ledger" --db "$dir/t.sqlite3" --mode transactional
  start separate "$ledger" --db "$dir/s.sqlite3" --mode separate
  echo "| server | requests | VmRSS, MiB |"
  echo "|---|---|---|"
  for name in naive transactional separate; do
    url=${urls[$name]}
    n=0
    echo "| $name | 0 | $(rss_mib "${pids[$name]}") |"
    # Windows of WINDOW seconds until REQUESTS answers: a third each of
    # new-key credits, replays of one key and GETs.
    while [ "$n" -lt "$total" ]; do
      wrk_run "$dir/w" -t1 -c32 -d"${window}s" -s "$here/mix.lua" "$url" -- "r$n$name"
      n=$(( n + $(awk '/requests in/ {print $1}' "$dir/w") ))
      read -r c r < <(sed -n 's/^MIX sent_credits=\([0-9]*\) sent_replays=\([0-9]*\)$/\1 \2/p' "$dir/w")
      [ "$name" = naive ] || r=0
      sent[$name]=$(( ${sent[$name]:-0} + c + r ))
      windows[$name]=$(( ${windows[$name]:-0} + 1 ))
      echo "| $name | $n | $(rss_mib "${pids[$name]}") |"
    done
  done
  # Every credit sent was applied once (the naive ledger applies repeats
  # too); a credit wrk wrote but stopped before reading may or may not
  # have been applied, so up to 32 per window are uncertain.
  local applied
  for name in naive transactional separate; do
    url=${urls[$name]}
    applied=$(( $(balance) / 5 - 1 ))
    echo "$name: $applied credits applied, ${sent[$name]} sent"
    [ $(( sent[$name] - applied )) -ge 0 ] && [ $(( sent[$name] - applied )) -le $(( 32 * windows[$name] )) ] ||
      fail "$name: $applied credits applied, ${sent[$name]} sent"
  done
}

# cpu_ticks PID...: user + system clock ticks of these processes so far.
cpu_ticks() { local t=0 p; for p in "$@"; do [ -r "/proc/$p/stat" ] && t=$(( t + $(awk '{print $14 + $15}' "/proc/$p/stat") )); done; echo "$t"; }
# busy_ticks: the machine's non-idle clock ticks so far, and all ticks.
busy_ticks() { awk '/^cpu / {print $2+$3+$4+$7+$8, $2+$3+$4+$5+$6+$7+$8}' /proc/stat; }

# Per new-key credit, counted while wrk drives one server (-c1 and -c32):
# fsync/fdatasync calls and clock_nanosleep calls (SQLite's busy handler
# sleeps with it; nothing else in these servers sleeps) of the server
# process, its context switches, the CPU time it and PostgreSQL's backends
# used (microseconds per credit), and how busy the whole machine was.
why() {
  local name c
  start_all
  local events=syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync,syscalls:sys_enter_clock_nanosleep,context-switches
  echo "| server | connections | credits/s | fsync + fdatasync | busy sleeps | context switches | server CPU, µs | PostgreSQL CPU, µs | PostgreSQL backends waiting on a lock | machine busy |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  for c in 1 32; do
    for name in "${servers[@]}"; do
      url=${urls[$name]}
      local pid=${pids[$name]} pg0 pg1 s0 s1 m0 m1 b
      pg0=$(cpu_ticks $(pgrep -u postgres || true)); s0=$(cpu_ticks "$pid"); m0=$(busy_ticks)
      perf stat -x, -e "$events" -p "$pid" -o "$dir/perf" -- sleep "$dur" &
      local perf_pid=$!
      b=$(read_balance)
      # On PostgreSQL, the backends waiting on a lock (pg_stat_activity,
      # sampled every 0.1 s): every credit updates account 1's row.
      rm -f "$dir/locks"; local sampler=""
      case $name in
        postgres-*|sqlxpg-*)
          while :; do
            psql -Atq "$PG_URL" -c "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            sleep 0.1
          done > "$dir/locks" 2> /dev/null &
          sampler=$! ;;
      esac
      wrk_run "$dir/w" -t1 -c"$c" -d"${dur}s" -s "$here/credit.lua" "$url" -- "why$c$name"
      [ -z "$sampler" ] || { kill "$sampler"; wait "$sampler" 2> /dev/null || true; }
      wait "$perf_pid"
      pg1=$(cpu_ticks $(pgrep -u postgres || true)); s1=$(cpu_ticks "$pid"); m1=$(busy_ticks)
      check_credits "$b" "$dir/w" "$name why" "$c"
      python3 - "$dir/perf" "$dir/w" "$name" "$c" "$rps" "$((s1 - s0))" "$((pg1 - pg0))" "$m0" "$m1" "$(getconf CLK_TCK)" "$dir/locks" <<'PY'
import os, sys
perf, w, name, c, rps, server, pg, m0, m1, hz, locks = sys.argv[1:]
samples = [int(l) for l in open(locks) if l.strip().isdigit()] if os.path.exists(locks) else []
lock_cell = f"{sum(samples) / len(samples):.1f} ({len(samples)} samples)" if samples else ""
n = int(next(l.split()[0] for l in open(w) if "requests in" in l))
counts = {}
for line in open(perf):
    f = line.strip().split(",")
    if len(f) > 2 and f[0].replace(".", "").isdigit():
        counts[f[2]] = float(f[0])
per = lambda e: counts.get(e, 0) / n
fsyncs = per("syscalls:sys_enter_fsync") + per("syscalls:sys_enter_fdatasync")
b0, t0 = map(int, m0.split()); b1, t1 = map(int, m1.split())
us = lambda ticks: int(ticks) / int(hz) * 1e6 / n
pg_cell = f"{us(pg):.0f}" if name.startswith(("postgres", "sqlxpg")) else ""
print(f"| {name} | {c} | {float(rps):,.0f} | {fsyncs:.2f} | {per('syscalls:sys_enter_clock_nanosleep'):.2f} "
      f"| {per('context-switches'):.1f} | {us(server):.0f} | {pg_cell} | {lock_cell} | {(b1 - b0) / max(t1 - t0, 1):.0%} |")
PY
    done
  done
}

"$what"
