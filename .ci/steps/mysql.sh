#!/usr/bin/env bash
# MySqlStore on a real MariaDB/MySQL server: its tests (the store suite, the
# model tests, transactional effects) and the ledger's conformance check in
# both modes. Starts MariaDB on 127.0.0.1:3306 if it is down; a server that
# cannot be reached fails the step: nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() { echo "FATAL: $*" >&2; exit 1; }

db=${TOWER_IDEMPOTENCY_MYSQL_DB:-test}
ping() { mysqladmin -h 127.0.0.1 -P 3306 -u root ping >/dev/null 2>&1; }

echo "== services: MariaDB on 127.0.0.1:3306"
if ! ping; then
    echo "MariaDB is down; starting it"
    mkdir -p /run/mysqld
    chown mysql:mysql /run/mysqld 2>/dev/null || true
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd -- --user=mysql \
        || fail "cannot start /usr/sbin/mariadbd"
    for _ in $(seq 1 60); do ping && break; sleep 0.5; done
fi
ping || fail "MariaDB/MySQL is not reachable on 127.0.0.1:3306 as root"
mysql -h 127.0.0.1 -P 3306 -u root -e "CREATE DATABASE IF NOT EXISTS \`$db\`" \
    || fail "cannot create the database $db"
export TOWER_IDEMPOTENCY_MYSQL_URL="${TOWER_IDEMPOTENCY_MYSQL_URL:-mysql://root@127.0.0.1:3306/$db}"
echo "TOWER_IDEMPOTENCY_MYSQL_URL=$TOWER_IDEMPOTENCY_MYSQL_URL"

# MySqlStore's tests (store suite, transactional effects, faults, fleet,
# model) run in .ci/run's `cargo test --all-features`, against the same server.

echo "== the ledger on MySQL: check_ledger.py in both modes"
cargo build --example ledger --all-features
for mode in transactional separate; do
    python3 ../shared/conformance/check_ledger.py --bin target/debug/examples/ledger \
        --db "$TOWER_IDEMPOTENCY_MYSQL_URL" --server-arg=--mode=$mode \
        || fail "check_ledger.py on MySQL, --mode=$mode"
done
