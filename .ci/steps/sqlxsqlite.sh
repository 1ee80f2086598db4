#!/usr/bin/env bash
# SqlxSqliteStore (feature sqlx-sqlite): its tests, the ledger on it in both
# modes under the conformance check, and the coexistence proof (an app with
# sqlx's SQLite driver AND this crate's default rusqlite store in one graph).
set -euo pipefail

step() { printf '\n== sqlxsqlite: %s\n' "$*"; }
fail() { echo "FATAL (sqlxsqlite): $*" >&2; exit 1; }

check=../shared/conformance/check_ledger.py
[ -f "$check" ] || fail "$check is missing"

# The store's tests (suite, transactional effects, faults, model) run in
# .ci/run's `cargo test --all-features`.

step "the ledger on SqlxSqliteStore (--db-driver sqlx), both modes"
cargo build --example ledger --all-features
for mode in transactional separate; do
    python3 "$check" --bin target/debug/examples/ledger \
        --server-arg=--db-driver=sqlx --server-arg="--mode=$mode" \
        || fail "check_ledger.py with --db-driver=sqlx --mode=$mode"
done

step "coexistence: sqlx's SQLite driver and rusqlite in one app (.ci/sqlx-sqlite-app)"
app=.ci/sqlx-sqlite-app/Cargo.toml
# The repository's target dir: the dependencies it shares with the crate's
# own builds are not compiled again.
cargo check --manifest-path "$app" --target-dir target
sqlite_libs=$(cargo tree --manifest-path "$app" -e normal --prefix none --format '{p}' \
    | sed 's/ (\*)$//' | grep '^libsqlite3-sys ' | sort -u)
echo "$sqlite_libs"
[ "$(printf '%s\n' "$sqlite_libs" | grep -c .)" = 1 ] \
    || fail "the app's tree must hold exactly one libsqlite3-sys, it holds: $sqlite_libs"
cargo tree --manifest-path "$app" -e normal -i rusqlite >/dev/null \
    || fail "rusqlite is not in the app's tree"
cargo tree --manifest-path "$app" -e normal -i sqlx-sqlite >/dev/null \
    || fail "sqlx-sqlite is not in the app's tree"

step "the package does not ship .ci/"
if cargo package -p tower-idempotency --list --allow-dirty 2>/dev/null | grep -q '^\.ci/'; then
    fail "the package ships .ci/: fix the include list in Cargo.toml"
fi
