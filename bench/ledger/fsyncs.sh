#!/usr/bin/env bash
# How many times the ledger (SQLite) syncs a file per credit: strace counts
# the fsync and fdatasync calls of every thread of the ledger while one
# client posts N credits with new keys, one after another.
#
#   bench/ledger/fsyncs.sh [BIN] [MODE] [N]   # defaults: the release ledger, separate, 200
#
# Builds nothing (run bench/ledger/compare.sh, or cargo build --release
# --example ledger, first). Needs strace, curl and python3.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${1:-${CARGO_TARGET_DIR:-$root/target}/release/examples/ledger}
mode=${2:-separate}; n=${3:-200}; d=$(mktemp -d)
$bin --db $d/l.sqlite3 --mode $mode --listen 127.0.0.1:0 > $d/out 2>&1 &
pid=$!
for i in $(seq 100); do grep -q listening $d/out && break; sleep 0.05; done
url=$(grep -o 'http://[0-9.:]*' $d/out)
auth=(-H 'Authorization: Bearer bench' -H 'Content-Type: application/json')
curl -sf -X POST $url/accounts "${auth[@]}" -H 'Idempotency-Key: "a"' -d '{"name":"x"}' >/dev/null
curl -sf -X POST $url/accounts/1/credits "${auth[@]}" -H 'Idempotency-Key: "w"' -d '{"amount":1}' >/dev/null
strace -f -p $pid -e trace=fsync,fdatasync -o $d/trace 2>/dev/null &
st=$!; sleep 1
python3 - "$url" "$n" <<'P'
import http.client,sys,uuid
u=sys.argv[1].split('//')[1]; h,p=u.split(':'); c=http.client.HTTPConnection(h,int(p))
for i in range(int(sys.argv[2])):
    c.request("POST","/accounts/1/credits",body='{"amount":1}',headers={"Authorization":"Bearer bench","Content-Type":"application/json","Idempotency-Key":'"%s"'%uuid.uuid4()})
    r=c.getresponse(); r.read(); assert r.status==201, r.status
P
sleep 0.5; kill $st; sleep 0.3; kill $pid
c=$(grep -c 'fsync\|fdatasync' $d/trace)
echo "$mode: $c syncs for $n credits: $(python3 -c "print($c/$n)") per credit"
rm -rf $d
