#!/usr/bin/env python3
"""The ledger-against-naive tables from compare.sh's raw results.

    python3 bench/ledger/table.py RESULTS

RESULTS has one line per wrk window: ROUND BACKEND SERVER PATH VALUE CONNS
(VALUE is requests/s, or ms for p50ms). Prints, per number of connections,
one table of every backend: the medians over the rounds and each mode's
ratio to the naive ledger, as Markdown. Python 3 standard library only.
"""

import statistics
import sys
from collections import defaultdict

ROWS = (
    ("GET /accounts/1 (passed through), req/s", "get", "get"),
    ("credit, new key, req/s", "credit", "credit"),
    ("replayed credit vs naive GET, req/s", "replay", "get"),
)


# compare.sh's backends (the BACKEND of its server names), in the order of
# the tables, with the names they are printed under; another backend follows
# them under its own name.
BACKENDS = {
    "sqlite": "SQLite",
    "postgres": "PostgreSQL",
    "sqlxpg": "PostgreSQL (sqlx)",
    "mysql": "MySQL",
    "redis": "Redis records, SQLite data",
}


def backend_order(backend):
    """Sorts compare.sh's backends in BACKENDS' order, then any other by name."""
    return (list(BACKENDS).index(backend) if backend in BACKENDS else len(BACKENDS), backend)


def backend_name(backend):
    return BACKENDS.get(backend, backend)


def medians(path):
    v = defaultdict(list)
    for line in open(path):
        f = line.split()
        if len(f) < 5:
            continue
        conns = f[5] if len(f) > 5 else "32"
        v[(f[1], conns, f[2], f[3])].append(float(f[4]))
    return {k: (statistics.median(x), len(x)) for k, x in v.items()}


def main():
    med = medians(sys.argv[1])
    # One table per number of connections, every backend in it.
    for conns in sorted({c for _, c, _, _ in med}, key=int):
        backends = sorted({b for b, c, _, _ in med if c == conns}, key=backend_order)
        rounds = max(n for (_, c, _, _), (_, n) in med.items() if c == conns)
        print(f"\n### Every backend, wrk -c{conns}, median of {rounds} round(s)\n")
        print("| path | naive | transactional | ratio | separate | ratio |")
        print("|---|---|---|---|---|---|")
        for backend in backends:
            def m(label, metric):
                return med.get((backend, conns, label, metric), (None, 0))[0]
            prefix = backend_name(backend)
            for name, metric, base in ROWS:
                n = m("naive", base)
                if n is None:
                    continue
                cells = [f"{n:,.0f}"]
                for mode in ("transactional", "separate"):
                    x = m(mode, metric)
                    cells += ["", ""] if x is None else [f"{x:,.0f}", f"**{x / n:.2f}**"]
                print(f"| {prefix}: {name} | " + " | ".join(cells) + " |")
            n = m("naive", "p50ms")
            if n is not None:
                cells = [f"{n:.3f}"]
                for mode in ("transactional", "separate"):
                    x = m(mode, "p50ms")
                    cells += ["", ""] if x is None else [f"{x:.3f}", f"**{x - n:+.3f} ms**"]
                print(f"| {prefix}: one client, credit p50 latency, ms (difference) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
