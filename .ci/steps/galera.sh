#!/usr/bin/env bash
# The ledger on a MariaDB Galera cluster (multi-master): three private
# nodes on 127.0.0.1 (SQL ports 14306-14308, Galera 14567/14577/14587, state
# transfers by rsync), each with its own data directory, run as the `mysql`
# user. Then check_ledger.py on each node in both modes; check_outbox.py with
# the credits on node 1 and the relay on node 2 (`--relay-db`); the race of
# `.ci/galera/race.py`: ledgers on two nodes of one database, each credit
# sent to both at once, in both modes; every credit applied once, no 5xx,
# the loser answered 409 or the replay, and (transactional) every credit
# notified exactly once by the two nodes' relays; then `.ci/galera/storm.py`: every
# credit sent to ledgers on all three nodes at once, one node killed
# (`kill -9`) a third of the way in and started again, then every key once
# more (STORM_RUNS runs per mode, default 1). Installs galera-4 and rsync when
# missing; fails loudly when anything else is; every server started here is
# stopped on exit.
set -euo pipefail

fail() { echo "FATAL: $*" >&2; exit 1; }

check=../shared/conformance/check_ledger.py
[ -f "$check" ] || fail "$check is missing"
provider=/usr/lib/galera/libgalera_smm.so
if [ ! -f "$provider" ] || ! command -v rsync >/dev/null; then
    apt-get install -y -q galera-4 rsync >/dev/null || fail "apt-get install galera-4 rsync failed"
fi
for tool in mariadbd mariadb-install-db mariadb wsrep_sst_rsync rsync python3; do
    command -v "$tool" >/dev/null || fail "$tool is required (apt-get install mariadb-server galera-4 rsync)"
done
id mysql >/dev/null 2>&1 || fail "no mysql user (apt-get install mariadb-server)"

source .ci/servers.sh
chmod 755 "$dir"
# A node the storm restarted is not in `pids`: every node is stopped by its
# pid file, and waited for, before the directory goes.
stop_nodes() {
    local f pid
    for f in "$dir"/n*/pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
}
trap 'stop_nodes; stop' EXIT

members="127.0.0.1:14567,127.0.0.1:14577,127.0.0.1:14587"
sql_port() { echo $((14305 + $1)); }
for n in 1 2 3; do
    d=$dir/n$n
    mkdir -p "$d/data"
    cat > "$d/my.cnf" <<CNF
[mariadbd]
datadir=$d/data
socket=$d/sock
port=$(sql_port $n)
bind-address=127.0.0.1
pid-file=$d/pid
log-error=$d/err.log
user=mysql
skip-name-resolve
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
innodb_buffer_pool_size=64M
wsrep_on=ON
wsrep_provider=$provider
wsrep_cluster_name=tower_idempotency_ci
wsrep_cluster_address=gcomm://$members
wsrep_node_address=127.0.0.1:$((14557 + 10 * n))
wsrep_node_name=n$n
wsrep_provider_options="gmcast.listen_addr=tcp://127.0.0.1:$((14557 + 10 * n));ist.recv_addr=127.0.0.1:$((14558 + 10 * n));gcache.size=32M"
wsrep_sst_method=rsync
wsrep_sst_receive_address=127.0.0.1:$((14444 + 10 * n))
CNF
    if [ "$n" = 1 ]; then
        mariadb-install-db --defaults-file="$d/my.cnf" --auth-root-authentication-method=normal \
            > "$d/install.log" 2>&1 || fail "mariadb-install-db: $(tail -5 "$d/install.log")"
    fi
    chown -R mysql:mysql "$d"
done

# start N [ARGS]: node N, until it answers (60 s), joined to the cluster.
start() {
    local n=$1; shift
    mariadbd --defaults-file="$dir/n$n/my.cnf" "$@" > "$dir/n$n/out.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 300); do
        mariadb -uroot -h127.0.0.1 -P"$(sql_port "$n")" -e "SELECT 1" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    fail "Galera node $n did not start: $(tail -20 "$dir/n$n/err.log")"
}
start 1 --wsrep-new-cluster
start 2
start 3
size=$(mariadb -uroot -h127.0.0.1 -P14306 -N -e "SHOW STATUS LIKE 'wsrep_cluster_size'" | cut -f2)
[ "$size" = 3 ] || fail "the cluster has $size nodes, not 3"
mariadb -uroot -h127.0.0.1 -P14306 -e "CREATE DATABASE IF NOT EXISTS test"
echo "a 3-node Galera cluster on 127.0.0.1:14306-14308"

ledger=target/debug/examples/ledger
cargo build --example ledger --all-features
for n in 1 2 3; do
    for mode in transactional separate; do
        python3 "$check" --bin "$ledger" --db "mysql://root@127.0.0.1:$(sql_port "$n")/test" \
            --server-arg=--mode=$mode || fail "check_ledger.py on Galera node $n, --mode=$mode"
    done
done
python3 "$(dirname "$check")/check_outbox.py" --bin "$ledger" --db mysql://root@127.0.0.1:14306/test \
    --server-arg=--relay-db=mysql://root@127.0.0.1:14307/test ||
    fail "check_outbox.py with the credits on Galera node 1 and the relay on node 2"
for mode in separate transactional; do
    python3 .ci/galera/race.py --bin "$ledger" --mode "$mode" --keys 30 \
        --nodes mysql://root@127.0.0.1:14306 mysql://root@127.0.0.1:14307 ||
        fail "the race on two Galera nodes, --mode=$mode"
done
for mode in separate transactional; do
    python3 .ci/galera/storm.py --bin "$ledger" --mode "$mode" --keys 60 --runs "${STORM_RUNS:-1}" \
        --nodes mysql://root@127.0.0.1:14306 mysql://root@127.0.0.1:14307 mysql://root@127.0.0.1:14308 \
        --victim-pidfile "$dir/n3/pid" --victim-start "mariadbd --defaults-file=$dir/n3/my.cnf" ||
        fail "the storm on three Galera nodes, one killed, --mode=$mode"
done
