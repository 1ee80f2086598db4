#!/usr/bin/env bash
# The ledger with its idempotency records on a Redis Cluster: a private
# 3-master cluster on 127.0.0.1:15650-15652 (no persistence), the ledger
# conformance check with the three nodes as --key-store seeds, then the same
# check over TLS (a private `redis-server --tls-port 15653` with a CA made
# here by openssl, handed to the ledger with --key-store-ca). Every server
# started here is stopped on exit. Fails loudly when redis-server,
# redis-cli, openssl or the check is missing; nothing is skipped.
set -euo pipefail

fail() { echo "FATAL: $*" >&2; exit 1; }

check=../shared/conformance/check_ledger.py
[ -f "$check" ] || fail "$check is missing"
for tool in python3 redis-server redis-cli openssl; do
    command -v "$tool" >/dev/null || fail "$tool is required"
done

ports=(15650 15651 15652)
tls_port=15653
source .ci/servers.sh

wait_for() { # what, command...
    local what=$1; shift
    for _ in $(seq 1 200); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
    fail "timed out waiting for $what"
}

for port in "${ports[@]}" "$tls_port"; do
    if redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null 2>&1 || (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        fail "port $port is in use (a leftover redis-server?)"
    fi
done

echo "== a 3-master Redis Cluster on ${ports[*]}"
for port in "${ports[@]}"; do
    redis-server --port "$port" --bind 127.0.0.1 --cluster-enabled yes \
        --cluster-config-file "$dir/nodes-$port.conf" --dir "$dir" \
        --save '' --appendonly no --daemonize no --logfile "$dir/redis-$port.log" &
    pids+=($!)
done
for port in "${ports[@]}"; do
    wait_for "redis-server on $port" redis-cli -h 127.0.0.1 -p "$port" ping
done
redis-cli --cluster create "${ports[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes >"$dir/create.log" \
    || { cat "$dir/create.log"; fail "redis-cli --cluster create failed"; }
cluster_ok() { redis-cli -h 127.0.0.1 -p "$1" cluster info | grep -q '^cluster_state:ok'; }
for port in "${ports[@]}"; do wait_for "cluster_state:ok on $port" cluster_ok "$port"; done

cargo build --example ledger --all-features
ledger=target/debug/examples/ledger
seeds=$(printf 'redis://127.0.0.1:%s,' "${ports[@]}")
seeds=${seeds%,}
echo "== ledger conformance: --key-store $seeds"
python3 "$check" --bin "$ledger" "--server-arg=--key-store=$seeds"
for port in "${ports[@]}"; do
    echo "keys on 127.0.0.1:$port: $(redis-cli -h 127.0.0.1 -p "$port" dbsize)"
done

echo "== a TLS redis-server on $tls_port"
(
    cd "$dir"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
        -subj /CN=ci-ca -addext basicConstraints=critical,CA:TRUE \
        -addext keyUsage=critical,keyCertSign,cRLSign -keyout ca.key -out ca.crt 2>/dev/null
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=localhost \
        -keyout server.key -out server.csr 2>/dev/null
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >server.ext
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
        -extfile server.ext -out server.crt 2>/dev/null
) || fail "openssl could not make the CA and the server certificate"
redis-server --port 0 --tls-port "$tls_port" --bind 127.0.0.1 \
    --tls-cert-file "$dir/server.crt" --tls-key-file "$dir/server.key" \
    --tls-ca-cert-file "$dir/ca.crt" --tls-auth-clients no \
    --save '' --appendonly no --daemonize no --dir "$dir" --logfile "$dir/redis-tls.log" &
pids+=($!)
wait_for "redis-server --tls-port $tls_port" redis-cli --tls --cacert "$dir/ca.crt" -h localhost -p "$tls_port" ping
echo "== ledger conformance: --key-store rediss://localhost:$tls_port --key-store-ca"
python3 "$check" --bin "$ledger" "--server-arg=--key-store=rediss://localhost:$tls_port" \
    "--server-arg=--key-store-ca=$dir/ca.crt"
