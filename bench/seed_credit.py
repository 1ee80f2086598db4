#!/usr/bin/env python3
"""The seed-style baseline of BENCHMARKS.md: an idempotent credit as a plain
Python function over sqlite3, with no server and no HTTP.

Each call opens a new connection, sets WAL and the given `synchronous`, takes
the write lock (BEGIN IMMEDIATE), inserts its key into an inbox table whose
PRIMARY KEY rejects a repeat, adds to the balance, and commits. N threads call
it with fresh keys for a warm-up, then for a measuring window; a credit counts
when it started after the warm-up and committed before the window closed.

Prints one JSON object: credits, seconds, credits_per_s, p50_ms, p99_ms.
Exits non-zero if the inbox, the balance and the count of commits disagree,
or a repeated key is credited again. Python 3.11 standard library only.
"""

import argparse
import json
import sqlite3
import sys
import threading
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS inbox (key TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
INSERT OR IGNORE INTO accounts (id, balance) VALUES (1, 0);
"""

AMOUNT = 5


def credit(path, synchronous, key):
    """Credits AMOUNT once per key; returns False for a key already seen."""
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("INSERT INTO inbox (key) VALUES (?)", (key,))
        except sqlite3.IntegrityError:
            conn.execute("ROLLBACK")
            return False
        conn.execute("UPDATE accounts SET balance = balance + ? WHERE id = 1", (AMOUNT,))
        conn.execute("COMMIT")
        return True
    finally:
        conn.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", required=True, help="SQLite file (created)")
    p.add_argument("--synchronous", choices=["FULL", "NORMAL"], default="FULL")
    p.add_argument("--threads", type=int, default=32)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds, not measured")
    p.add_argument("--seconds", type=float, default=5.0, help="measuring window, seconds")
    a = p.parse_args()

    setup = sqlite3.connect(a.db, isolation_level=None)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.executescript(SCHEMA)
    setup.close()

    start = time.perf_counter()
    measure_from = start + a.warmup
    end = measure_from + a.seconds
    lock = threading.Lock()
    latencies = []  # seconds, measured credits only
    committed = [0]  # every credit, warm-up included

    def worker(n):
        mine, done, seq = [], 0, 0
        while time.perf_counter() < end:
            sent = time.perf_counter()
            if not credit(a.db, a.synchronous, f"t{n}-{seq}"):
                raise SystemExit(f"fresh key t{n}-{seq} was refused")
            finished = time.perf_counter()
            seq += 1
            done += 1
            if sent >= measure_from and finished <= end:
                mine.append(finished - sent)
        with lock:
            latencies.extend(mine)
            committed[0] += done

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(a.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # A repeat of a credited key is refused and changes nothing.
    if credit(a.db, a.synchronous, "t0-0"):
        sys.exit("a repeated key was credited twice")
    check = sqlite3.connect(a.db)
    inbox, balance = check.execute(
        "SELECT (SELECT count(*) FROM inbox), (SELECT balance FROM accounts WHERE id = 1)"
    ).fetchone()
    check.close()
    if inbox != committed[0] or balance != AMOUNT * committed[0]:
        sys.exit(f"{committed[0]} commits, but {inbox} inbox rows and balance {balance}")

    latencies.sort()

    def quantile(q):
        if not latencies:
            return float("nan")
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000.0

    print(json.dumps({
        "credits": len(latencies),
        "seconds": a.seconds,
        "credits_per_s": len(latencies) / a.seconds,
        "p50_ms": quantile(0.50),
        "p99_ms": quantile(0.99),
        "threads": a.threads,
        "synchronous": a.synchronous,
        "all_commits": committed[0],
    }))


if __name__ == "__main__":
    main()
