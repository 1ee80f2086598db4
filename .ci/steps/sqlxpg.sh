#!/usr/bin/env bash
# The ledger on SqlxPostgresStore (`--db-driver sqlx`): the conformance check
# against PostgreSQL in both modes. Fails loudly when PostgreSQL or the check
# is missing; nothing is skipped.
set -euo pipefail

fail() { echo "FATAL: $*" >&2; exit 1; }

: "${TOWER_IDEMPOTENCY_POSTGRES_URL:?TOWER_IDEMPOTENCY_POSTGRES_URL must name the PostgreSQL database}"
check=../shared/conformance/check_ledger.py
[ -f "$check" ] || fail "$check is missing"
command -v python3 >/dev/null || fail "python3 is required"
pg_isready -q -d "$TOWER_IDEMPOTENCY_POSTGRES_URL" || fail "PostgreSQL at $TOWER_IDEMPOTENCY_POSTGRES_URL is not reachable"

cargo build --example ledger --all-features
for mode in transactional separate; do
    echo "== ledger conformance: --db-driver sqlx --mode $mode"
    python3 "$check" --bin target/debug/examples/ledger --db "$TOWER_IDEMPOTENCY_POSTGRES_URL" \
        --server-arg=--db-driver=sqlx "--server-arg=--mode=$mode"
done
