#!/usr/bin/env bash
# The outbox's conformance: check_outbox.py against the ledger with
# --notify-url, on SQLite and on PostgreSQL (.ci/run runs check_ledger.py on
# the same --all-features build).
set -euo pipefail

conformance=../shared/conformance
for f in "$conformance/check_outbox.py" "$conformance/check_ledger.py"; do  # the first imports the second
    [ -f "$f" ] || { echo "outbox.sh: missing $f" >&2; exit 1; }
done
: "${TOWER_IDEMPOTENCY_POSTGRES_URL:?outbox.sh: TOWER_IDEMPOTENCY_POSTGRES_URL must name the PostgreSQL test database}"

cargo build --release --example ledger --all-features
bin=target/release/examples/ledger

echo "== check_outbox.py (SQLite)"
python3 "$conformance/check_outbox.py" --bin "$bin"
echo "== check_outbox.py (PostgreSQL, a database of its own)"
# A fresh database: the ledger's relay retries its notifications without
# limit, so rows a case leaves behind (a downstream that is gone) would be
# retried by every later relay on the same database, the tests' included.
db=tower_idempotency_outbox_ci
psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" postgres
createdb -h 127.0.0.1 -U postgres "$db"
python3 "$conformance/check_outbox.py" --bin "$bin" --db "postgres://postgres@127.0.0.1:5432/$db"
psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE $db WITH (FORCE)" postgres
