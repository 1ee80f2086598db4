#!/usr/bin/env bash
# The outbox's conformance: check_outbox.py against the ledger with
# --notify-url on every driver: SQLite and PostgreSQL with the default
# drivers and with sqlx, and MySQL/MariaDB (.ci/run runs check_ledger.py on
# the same --all-features build). Each server run gets a database of its
# own, dropped after.
set -euo pipefail

conformance=../shared/conformance
for f in "$conformance/check_outbox.py" "$conformance/check_ledger.py"; do  # the first imports the second
    [ -f "$f" ] || { echo "outbox.sh: missing $f" >&2; exit 1; }
done
: "${TOWER_IDEMPOTENCY_POSTGRES_URL:?outbox.sh: TOWER_IDEMPOTENCY_POSTGRES_URL must name the PostgreSQL test database}"
mysqladmin -h 127.0.0.1 -u root ping >/dev/null || { echo "outbox.sh: MariaDB is not reachable on 127.0.0.1:3306" >&2; exit 1; }

cargo build --example ledger --all-features
bin=target/debug/examples/ledger

# The five runs side by side (each case has its own ledger, downstream and
# free ports; each database is its own): they mostly wait for the relay.
logs=$(mktemp -d)
run() {  # run NAME ARGS...: check_outbox.py ARGS into logs/NAME
    local name=$1
    shift
    python3 "$conformance/check_outbox.py" --bin "$bin" "$@" >"$logs/$name" 2>&1
}
fresh_pg() {  # A fresh database: the ledger's relay retries its notifications
    # without limit, so rows a case leaves behind (a downstream that is gone)
    # would be retried by every later relay on the same database.
    psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE IF EXISTS $1 WITH (FORCE)" postgres
    createdb -h 127.0.0.1 -U postgres "$1"
}
pids=()
names=()
for driver in rusqlite sqlx; do
    run "sqlite-$driver" --server-arg="--db-driver=$driver" &
    pids+=($!) names+=("SQLite, --db-driver $driver")
    fresh_pg "tower_idempotency_outbox_ci_$driver"
    run "postgres-$driver" --db "postgres://postgres@127.0.0.1:5432/tower_idempotency_outbox_ci_$driver" \
        --server-arg="--db-driver=$driver" &
    pids+=($!) names+=("PostgreSQL, --db-driver $driver, a database of its own")
done
mysql -h 127.0.0.1 -u root -e "DROP DATABASE IF EXISTS tower_idempotency_outbox_ci; CREATE DATABASE tower_idempotency_outbox_ci"
run mysql --db "mysql://root@127.0.0.1:3306/tower_idempotency_outbox_ci" &
pids+=($!) names+=("MySQL/MariaDB, a database of its own")
failed=0
files=(sqlite-rusqlite postgres-rusqlite sqlite-sqlx postgres-sqlx mysql)
for i in "${!pids[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    echo "== check_outbox.py (${names[$i]})"
    cat "$logs/${files[$i]}"
    [ "$rc" -eq 0 ] || failed=1
done
for driver in rusqlite sqlx; do
    psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE tower_idempotency_outbox_ci_$driver WITH (FORCE)" postgres
done
mysql -h 127.0.0.1 -u root -e "DROP DATABASE tower_idempotency_outbox_ci"
[ "$failed" -eq 0 ] || { echo "outbox.sh: a check_outbox.py run failed (above)" >&2; exit 1; }
