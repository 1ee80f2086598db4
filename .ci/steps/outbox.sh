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
echo "== check_outbox.py (PostgreSQL)"
python3 "$conformance/check_outbox.py" --bin "$bin" --db "$TOWER_IDEMPOTENCY_POSTGRES_URL"
