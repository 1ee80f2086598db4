#!/usr/bin/env bash
# PostgreSQL where fleets run: the ledger's conformance check against a private
# PostgreSQL 15 cluster that accepts only TLS (hostssl), connecting with
# sslmode=verify-full and a CA made here. Also checks what the TLS, failover
# and partition tests (integration/tests/postgres/tls.rs, integration/tests/postgres/failover.rs,
# integration/tests/postgres/partition.rs, run by `cargo test --all-features`) need on this machine.
# Fails loudly, never skips. Port 15590 (127.0.0.1).
set -euo pipefail

fail() { echo "FATAL: $*" >&2; exit 1; }
bin=/usr/lib/postgresql/15/bin

echo "== pgfleet: prerequisites of the private-cluster tests"
[ "$(id -u)" = 0 ] || fail "the private clusters run as the postgres user through runuser: needs root"
id postgres >/dev/null 2>&1 || fail "no postgres user (apt-get install postgresql-15)"
for tool in initdb pg_ctl pg_basebackup postgres psql; do
    [ -x "$bin/$tool" ] || fail "$bin/$tool is missing (apt-get install postgresql-15)"
done
command -v runuser >/dev/null || fail "runuser is missing (util-linux)"
command -v openssl >/dev/null || fail "openssl is missing (apt-get install openssl)"

echo "== pgfleet: a TLS-only cluster on 127.0.0.1:15590"
dir=$(mktemp -d /tmp/pgfleet-ci.XXXXXX)
port=15590
cleanup() {
    if [ -f "$dir/data/postmaster.pid" ]; then
        runuser -u postgres -- "$bin/pg_ctl" -D "$dir/data" -m immediate -w -t 10 stop >/dev/null 2>&1 ||
            kill -KILL "$(head -1 "$dir/data/postmaster.pid")" 2>/dev/null || true
    fi
    rm -rf "$dir"
}
trap cleanup EXIT
chown postgres:postgres "$dir"
runuser -u postgres -- "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync >/dev/null

# A CA of our own and a server certificate for `localhost` signed by it.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj "/CN=pgfleet CI CA" -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/CN=localhost" -keyout "$dir/data/server.key" -out "$dir/server.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n' >"$dir/ext.cnf"
openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 2 -extfile "$dir/ext.cnf" -out "$dir/data/server.crt" 2>/dev/null
chown postgres:postgres "$dir/data/server.key" "$dir/data/server.crt"
chmod 600 "$dir/data/server.key"

cat >>"$dir/data/postgresql.conf" <<CONF
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
fsync = off
ssl = on
ssl_cert_file = 'server.crt'
ssl_key_file = 'server.key'
CONF
echo "hostssl all all 127.0.0.1/32 trust" >"$dir/data/pg_hba.conf"
runuser -u postgres -- "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null ||
    { cat "$dir/server.log"; fail "the TLS cluster did not start"; }

url="postgres://postgres@localhost:$port/postgres?hostaddr=127.0.0.1&sslmode=verify-full&sslrootcert=$dir/ca.pem"

echo "== pgfleet: the ledger (every feature)"
cargo build --example ledger --all-features
ledger=target/debug/examples/ledger

echo "== pgfleet: a plain-text connection to the TLS-only cluster is refused at start-up"
if out=$("$ledger" --db "postgres://postgres@localhost:$port/postgres?hostaddr=127.0.0.1&sslmode=disable" \
    --listen 127.0.0.1:0 2>&1 </dev/null); then
    fail "the ledger started on sslmode=disable against a hostssl-only server: $out"
fi
echo "$out" | grep -q "no encryption" || fail "the start-up error does not name the cause: $out"
echo "refused as it must be: $out"

for mode in transactional separate; do
    echo "== pgfleet: ledger conformance over verify-full TLS, $mode mode"
    python3 ../shared/conformance/check_ledger.py --bin "$ledger" --db "$url" --server-arg=--mode=$mode
done
echo "pgfleet: done (verify-full over TLS; the cluster accepts only hostssl)"
