#!/usr/bin/env python3
"""Ledgers on two nodes of a multi-master cluster (one database), each
credit sent to both at once (a barrier, two sockets). Passes when every
credit is applied exactly once (the balance), each key answered 201 exactly
once, and the other answer is 409 or the replay: no 5xx, not even once.
Prints what each node answered.

In transactional mode both ledgers also notify every credit (`--notify-url`),
so two outbox relays on two nodes claim the same notifications: passes only
when each credit is delivered exactly once (the relay whose claim loses
certification sends nothing).

    race.py --bin LEDGER --mode separate --keys 30 --nodes URL1 URL2
"""
import argparse
import collections
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

p = argparse.ArgumentParser()
p.add_argument("--bin", required=True)
p.add_argument("--mode", required=True, choices=["separate", "transactional"])
p.add_argument("--keys", type=int, default=30)
p.add_argument("--nodes", nargs=2, required=True, help="mysql:// URLs without a database")
args = p.parse_args()

db = f"galera_race_{args.mode}_{os.getpid()}"
subprocess.run(["mariadb", "-uroot", "-h127.0.0.1", "-P" + args.nodes[0].rsplit(":", 1)[1],
                "-e", f"CREATE DATABASE {db}"], check=True)
HEADERS = {"Authorization": "Bearer galera", "Content-Type": "application/json"}
procs, urls = [], []
deliveries, delivered = [], threading.Lock()


class Downstream(http.server.BaseHTTPRequestHandler):
    """Records each notification (its key and body) and answers 200."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with delivered:
            deliveries.append((self.headers["Idempotency-Key"], json.loads(body)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_):
        pass


downstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Downstream)
threading.Thread(target=downstream.serve_forever, daemon=True).start()
notify = ["--notify-url", f"http://127.0.0.1:{downstream.server_port}/notify"]


def start(node):
    proc = subprocess.Popen([args.bin, "--db", f"{node}/{db}", "--mode", args.mode,
                             "--listen", "127.0.0.1:0",
                             *(notify if args.mode == "transactional" else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.append(proc)
    for line in proc.stdout:
        m = re.search(r"listening on (http://[0-9.:]+)", line)
        if m:
            return m.group(1)
    sys.exit(f"the ledger on {node} did not start")


def post(url, path, key, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={**HEADERS, "Idempotency-Key": f'"{key}"'})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Idempotent-Replayed") == "true", r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, False, e.read().decode()


def audit_notifications(account):
    """Every credit delivered exactly once (the warm-up, an amount of 0,
    credits nothing): once all are in, 3 s more bring nothing."""
    expected = args.keys
    deadline = time.time() + 60
    while time.time() < deadline and len(deliveries) < expected:
        time.sleep(0.1)
    time.sleep(3)
    with delivered:
        seen = list(deliveries)
    keys = collections.Counter(key for key, _ in seen)
    amounts = collections.Counter(body["amount"] for _, body in seen if body["account_id"] == account)
    print(f"notifications: {len(seen)} delivered, {len(keys)} keys (expected {expected} of each)",
          flush=True)
    failures = [f"notification {key} delivered {n} times" for key, n in keys.items() if n > 1]
    if len(keys) != expected or amounts != {5: args.keys}:
        failures.append(f"{len(keys)} notifications, amounts {dict(amounts)}; expected {expected}")
    return failures


try:
    urls = [start(node) for node in args.nodes]
    status, _, body = post(urls[0], "/accounts", "account", {"name": "galera"})
    assert status == 201, (status, body)
    account = json.loads(body)["id"]
    path = f"/accounts/{account}/credits"
    # The account may not be applied on the second node yet: its first
    # credit is sent there alone until the account is found, then replayed.
    while post(urls[1], path, "warm-up", {"amount": 0})[0] == 404:
        pass
    tally, failures = collections.Counter(), []
    for k in range(args.keys):
        barrier, out = threading.Barrier(2), [None, None]

        def send(i, key=f"credit-{k}"):
            barrier.wait()
            out[i] = post(urls[i], path, key, {"amount": 5})

        threads = [threading.Thread(target=send, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fresh = [a for a in out if a[0] == 201 and not a[1]]
        for i, (status, replayed, body) in enumerate(out):
            tally[f"node {i + 1}: {status}{' replay' if replayed else ''}"] += 1
            if status >= 500 or status not in (201, 409):
                failures.append(f"credit-{k} on node {i + 1}: {status} {body}")
        if len(fresh) != 1:
            failures.append(f"credit-{k}: {len(fresh)} fresh 201s: {out}")
    with urllib.request.urlopen(urllib.request.Request(f"{urls[1]}/accounts/{account}",
                                                       headers=HEADERS)) as r:
        balance = json.loads(r.read())["balance"]
    print(f"{args.mode}: {dict(sorted(tally.items()))}; balance {balance} (expected {5 * args.keys})",
          flush=True)
    if balance != 5 * args.keys:
        failures.append(f"balance {balance}, expected {5 * args.keys}")
    if args.mode == "transactional":
        failures += audit_notifications(account)
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
finally:
    for proc in procs:
        proc.terminate()
    downstream.shutdown()
