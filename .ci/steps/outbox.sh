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

for driver in rusqlite sqlx; do
    echo "== check_outbox.py (SQLite, --db-driver $driver)"
    python3 "$conformance/check_outbox.py" --bin "$bin" --server-arg="--db-driver=$driver"
    echo "== check_outbox.py (PostgreSQL, --db-driver $driver, a database of its own)"
    # A fresh database: the ledger's relay retries its notifications without
    # limit, so rows a case leaves behind (a downstream that is gone) would be
    # retried by every later relay on the same database, the tests' included.
    db=tower_idempotency_outbox_ci
    psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" postgres
    createdb -h 127.0.0.1 -U postgres "$db"
    python3 "$conformance/check_outbox.py" --bin "$bin" --db "postgres://postgres@127.0.0.1:5432/$db" \
        --server-arg="--db-driver=$driver"
    psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE $db WITH (FORCE)" postgres
done
echo "== check_outbox.py (MySQL/MariaDB, a database of its own)"
mysql -h 127.0.0.1 -u root -e "DROP DATABASE IF EXISTS tower_idempotency_outbox_ci; CREATE DATABASE tower_idempotency_outbox_ci"
python3 "$conformance/check_outbox.py" --bin "$bin" --db "mysql://root@127.0.0.1:3306/tower_idempotency_outbox_ci"
mysql -h 127.0.0.1 -u root -e "DROP DATABASE tower_idempotency_outbox_ci"
