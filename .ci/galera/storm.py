#!/usr/bin/env python3
"""The storm: ledgers on the three nodes of a Galera cluster (one database),
every credit sent to all three at once (a barrier, three sockets), several
keys at a time; a third of the way in, one node is killed (`kill -9`), and
two thirds in it is started again. Then every key is sent once more, to a
ledger on a live node, until it is answered 201 or the replay. Passes when
the balance, read on every node once all are synced, is exactly one credit
per key (0 doubled, 0 lost) and no key was answered 201 afresh twice. Each
run has a database of its own; with STORM_LOGS=DIR each ledger's stderr is
kept there.

    storm.py --bin LEDGER --mode separate --keys 60 --runs 10 \
        --nodes URL1 URL2 URL3 --victim-pidfile FILE --victim-start 'mariadbd ...'
"""
import argparse
import concurrent.futures
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

p = argparse.ArgumentParser()
p.add_argument("--bin", required=True)
p.add_argument("--mode", required=True, choices=["separate", "transactional"])
p.add_argument("--keys", type=int, default=60)
p.add_argument("--runs", type=int, default=1)
p.add_argument("--nodes", nargs=3, required=True, help="mysql:// URLs without a database; the last is killed")
p.add_argument("--victim-pidfile", required=True)
p.add_argument("--victim-start", required=True, help="the command that starts the last node again")
args = p.parse_args()
HEADERS = {"Authorization": "Bearer storm", "Content-Type": "application/json"}


def port(url):
    return url.rsplit(":", 1)[1]


def sql(url, statement):
    return subprocess.run(["mariadb", "-uroot", "-h127.0.0.1", "-P" + port(url), "-N", "-e", statement],
                          capture_output=True, text=True).stdout.strip()


def request(url, method="GET", key=None, body=None):
    headers = dict(HEADERS)
    if key:
        headers["Idempotency-Key"] = f'"{key}"'
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method,
                                                           headers=headers), timeout=60) as r:
            return r.status, r.headers.get("Idempotent-Replayed") == "true", r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, False, e.read().decode()
    except OSError as e:  # the ledger's own connection failed
        return 0, False, str(e)


def start_ledger(node, db):
    log = open(f"{os.environ['STORM_LOGS']}/{db}-{port(node)}.log", "w") if os.environ.get("STORM_LOGS") \
        else subprocess.DEVNULL
    proc = subprocess.Popen([args.bin, "--db", f"{node}/{db}", "--mode", args.mode, "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    for line in proc.stdout:
        m = re.search(r"listening on (http://[0-9.:]+)", line)
        if m:
            return proc, m.group(1)
    sys.exit(f"the ledger on {node} did not start")


def until(what, condition, limit=120):
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"timed out: {what}")
        time.sleep(0.2)


def one_run(run):
    db = f"storm_{args.mode}_{run}_{os.getpid()}"
    sql(args.nodes[0], f"CREATE DATABASE {db}")
    ledgers = [start_ledger(node, db) for node in args.nodes]
    urls = [url for _, url in ledgers]
    victim = None
    try:
        status, _, body = request(urls[0] + "/accounts", "POST", "account", {"name": "storm"})
        assert status == 201, (status, body)
        account = json.loads(body)["id"]
        path = f"/accounts/{account}"
        until("the account on every node", lambda: all(request(u + path)[0] == 200 for u in urls))
        fresh = {k: 0 for k in range(args.keys)}
        lock = threading.Lock()

        def storm(k):
            barrier, out = threading.Barrier(3), [None] * 3

            def send(i):
                barrier.wait()
                out[i] = request(urls[i] + path + "/credits", "POST", f"credit-{k}", {"amount": 5})

            threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            with lock:
                fresh[k] += sum(1 for s, replayed, _ in out if s == 201 and not replayed)
            return [s for s, _, _ in out]

        answers = {}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = {}
            for k in range(args.keys):
                if k == args.keys // 3:
                    with open(args.victim_pidfile) as f:
                        os.kill(int(f.read().strip()), signal.SIGKILL)
                if k == 2 * args.keys // 3:
                    victim = subprocess.Popen(shlex.split(args.victim_start),
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                futures[pool.submit(storm, k)] = k
            for f in concurrent.futures.as_completed(futures):
                answers[futures[f]] = f.result()
        # Every node, not only the restarted one: its state-transfer donor
        # serves stale reads while it catches up.
        until("every node synced", lambda: all(
            sql(node, "SHOW STATUS LIKE 'wsrep_local_state_comment'").endswith("Synced") for node in args.nodes))
        # Every key once more, until answered 201 or the replay.
        for k in range(args.keys):
            def settled():
                s, replayed, _ = request(urls[0] + path + "/credits", "POST", f"credit-{k}", {"amount": 5})
                if s == 201 and not replayed:
                    fresh[k] += 1
                return s == 201
            until(f"credit-{k} settled", settled, 60)
        # Read on every node, each read causal (`wsrep_sync_wait`): it sees
        # every write set committed anywhere before it.
        balances = [sql(node, f"SET SESSION wsrep_sync_wait = 1; "
                              f"SELECT balance FROM {db}.accounts WHERE id = {account}") for node in args.nodes]
        doubled = sum(1 for n in fresh.values() if n > 1)
        statuses = sorted({s for a in answers.values() for s in a})
        print(f"{args.mode} run {run}: balance on each node {balances} (expected {5 * args.keys}), "
              f"keys answered 201 twice: {doubled}, statuses in the storm: {statuses}")
        if balances != [str(5 * args.keys)] * 3:
            for node in args.nodes:
                print(f"  {db} on {node}: balance, credits, their sum: " + sql(node, (
                    f"SELECT a.balance, COUNT(c.id), SUM(c.amount) FROM {db}.accounts a "
                    f"LEFT JOIN {db}.credits c ON c.account_id = a.id WHERE a.id = {account}")))
        return balances == [str(5 * args.keys)] * 3 and doubled == 0
    finally:
        for proc, _ in ledgers:
            proc.terminate()
        if victim is not None:
            # Left running for the next run (and stopped by the caller).
            pass


failed = [run for run in range(args.runs) if not one_run(run)]
if failed:
    sys.exit(f"FAILED runs: {failed}")
