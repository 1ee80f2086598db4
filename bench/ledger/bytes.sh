#!/usr/bin/env bash
# What a record costs each store (docs/guide/capacity.md). Every server of
# start_all (lib.sh: SQLite always; PostgreSQL with PG_URL, MySQL/MariaDB with
# MYSQL_URL, Redis with REDIS_URL) takes DUR seconds (default 10) of new-key
# credits (wrk -c32), one server at a time. Then, per record of the
# ledger's idempotency table: the table's bytes, its indexes' bytes, and
# their sum (SQLite: dbstat pages; PostgreSQL: pg_relation_size,
# pg_indexes_size, pg_total_relation_size; MySQL: information_schema after
# ANALYZE TABLE; Redis: MEMORY USAGE of 200 records, and used_memory's
# growth over the window per record). And per credit, for the naive ledger
# and the ledger alike: the write-ahead log the database server wrote
# (PostgreSQL's WAL position, InnoDB's redo LSN). The naive ledgers on
# SQLite (and beside Redis) are not driven: they have no records, and no
# server's log to read.
#
#   PG_URL=postgres://postgres@127.0.0.1:5432/test MYSQL_URL=mysql://root@127.0.0.1:3306/test \
#     REDIS_URL=redis://127.0.0.1:6379/9 DUR=20 bench/ledger/bytes.sh
#
# Builds the release binaries first unless NO_BUILD=1. A balance that does
# not match the answers counted ends the run with status 1.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dur=${DUR:-10}
source "$here/lib.sh"

# write_ahead NAME: the position, in bytes, of what NAME's database has
# written ahead of its pages.
write_ahead() {
  case $1 in
    postgres-*) psql -Atq "$PG_URL" -c "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint" ;;
    mysql-*) mysql_cli -N -e "SHOW GLOBAL STATUS LIKE 'Innodb_lsn_current'" | cut -f2 ;;
    *) echo - ;;
  esac
}

# records NAME: "count table_bytes index_bytes total_bytes" of NAME's
# idempotency records ("-" where the store has no such split).
records() {
  case $1 in
    *-naive) echo "0 - - -" ;;
    sqlite-*)
      python3 - "$dir/${1:7:1}.sqlite3" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
n = db.execute("SELECT count(*) FROM idempotency_records").fetchone()[0]
table = db.execute("SELECT sum(pgsize) FROM dbstat WHERE name = 'idempotency_records'").fetchone()[0]
index = db.execute("""SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name IN
    (SELECT name FROM sqlite_schema WHERE type = 'index' AND tbl_name = 'idempotency_records')""").fetchone()[0]
print(n, table, index, table + index)
PY
      ;;
    postgres-*)
      local t="bench_${1:9:1}.idempotency_records"
      psql -q "$PG_URL" -c "VACUUM $t" > /dev/null
      psql -Atq -F' ' "$PG_URL" -c "SELECT count(*), pg_relation_size('$t'), pg_indexes_size('$t'),
        pg_total_relation_size('$t') FROM $t" ;;
    mysql-*)
      local db="bench_${1:6:1}"
      mysql_cli -N -e "ANALYZE TABLE $db.idempotency_records" > /dev/null
      mysql_cli -N -e "SELECT (SELECT count(*) FROM $db.idempotency_records), data_length, index_length,
        data_length + index_length FROM information_schema.tables
        WHERE table_schema = '$db' AND table_name = 'idempotency_records'" | tr '\t' ' ' ;;
    redis-*)
      local n sum=0 k
      n=$(redis-cli -u "$REDIS_URL" --scan --pattern 'idempotency:*' | wc -l)
      for k in $(redis-cli -u "$REDIS_URL" --scan --pattern 'idempotency:*' | head -200); do
        sum=$(( sum + $(redis-cli -u "$REDIS_URL" MEMORY USAGE "$k" SAMPLES 0) ))
      done
      echo "$n - - $(( sum * n / 200 ))" ;;
    *) echo "0 - - -" ;;
  esac
}

redis_used() { redis-cli -u "$REDIS_URL" INFO memory | sed -n 's/^used_memory:\([0-9]*\)\r*$/\1/p'; }

start_all
echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| server | credits | write-ahead, bytes per credit | records | table, bytes per record | indexes, bytes per record | all, bytes per record | Redis used_memory growth per record |"
echo "|---|---|---|---|---|---|---|---|"
for name in "${servers[@]}"; do
  case $name in sqlite-naive|redis-naive) continue ;; esac
  url=${urls[$name]}
  b=$(balance)
  w0=$(write_ahead "$name")
  m0=$([ "${name%%-*}" = redis ] && redis_used || echo 0)
  wrk_run "$dir/w" -t1 -c32 -d"${dur}s" -s "$here/credit.lua" "$url" -- "bytes$name"
  check_credits "$b" "$dir/w" "$name bytes" 32
  credits=$(( ($(balance) - b) / 5 ))
  w1=$(write_ahead "$name")
  m1=$([ "${name%%-*}" = redis ] && redis_used || echo 0)
  read -r n table index all < <(records "$name")
  wal=$([ "$w0" = - ] && echo - || echo $((w1 - w0)))
  python3 - "$name" "$credits" "$wal" "$n" "$table" "$index" "$all" "$((m1 - m0))" <<'PY'
import sys
name, credits, wal, n, table, index, total, grew = sys.argv[1:]
credits, n = int(credits), int(n)
per = lambda v: "" if v == "-" or not n else f"{int(v) / n:,.0f}"
wal = "" if wal == "-" else f"{int(wal) / max(credits, 1):,.0f}"
print(f"| {name} | {credits:,} | {wal} | {n:,} | {per(table)} | {per(index)} "
      f"| {per(total)} | {per(grew) if name.startswith('redis-') and int(grew) else ''} |")
PY
done
