#!/usr/bin/env python3
"""Draws BENCHMARKS.md's lead chart from compare.sh's raw results.

    python3 bench/ledger/chart.py RAW CHART.svg       # or: CHART=CHART.svg bench/ledger/compare.sh

One horizontal bar per backend, path and mode: the ledger's requests/s (the
median over the rounds) as a ratio to the naive ledger's, on a logarithmic
axis, with the issue's goal for that bar drawn as a tick and 1.0 (the naive
ledger) as a line. Backends in table.py's order and names; the issue set
credit goals for SQLite and PostgreSQL (tokio-postgres) only, so the other
backends' credit bars have no tick. Python 3 standard library only.
"""

import math
import statistics
import sys
from collections import defaultdict
from xml.sax.saxutils import escape

sys.dont_write_bytecode = True  # table.py, beside this file: no __pycache__ in bench/
from table import backend_name, backend_order  # noqa: E402

# (path, baseline path, label); goals per (backend, path, mode), from issue 14.
PATHS = (("get", "get", "GET, passed through"), ("credit", "credit", "credit, new key"),
         ("replay", "get", "replay vs naive GET"))
GOALS = {("get", m): 0.97 for m in ("transactional", "separate")}
GOALS.update({("replay", m): 1.0 for m in ("transactional", "separate")})
GOALS.update({("sqlite", "credit", "transactional"): 3.0, ("sqlite", "credit", "separate"): 1.0,
              ("postgres", "credit", "transactional"): 1.0, ("postgres", "credit", "separate"): 0.8})
COLOR = {"transactional": "#2b6cb0", "separate": "#dd6b20"}
LO, HI = 0.05, 5.0  # the axis, as ratios
# LABEL_W fits the longest label, "PostgreSQL (sqlx): replay vs naive GET, transactional".
LABEL_W, BAR_W, ROW, TOP = 370, 560, 22, 56


def x_of(ratio):
    r = min(max(ratio, LO), HI)
    return LABEL_W + BAR_W * (math.log(r) - math.log(LO)) / (math.log(HI) - math.log(LO))


def main():
    src, dst = sys.argv[1], sys.argv[2]
    v = defaultdict(list)
    for line in open(src):
        f = line.split()
        if len(f) >= 5 and (len(f) < 6 or f[5] == "32"):
            v[(f[1], f[2], f[3])].append(float(f[4]))
    med = {k: statistics.median(x) for k, x in v.items()}
    bars = []
    for backend in sorted({b for b, _, _ in med}, key=backend_order):
        for path, base, label in PATHS:
            n = med.get((backend, "naive", base))
            for mode in ("transactional", "separate"):
                x = med.get((backend, mode, path))
                if n and x:
                    goal = GOALS.get((backend, path, mode), GOALS.get((path, mode)))
                    bars.append((f"{backend_name(backend)}: {label}, {mode}", x / n, goal, mode))
    height = TOP + ROW * len(bars) + 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LABEL_W + BAR_W + 80}" height="{height}" '
           'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="10" y="20" font-size="15" font-weight="bold">The ledger against the naive ledger '
           f'(requests/s ratio, wrk -c32, log scale)</text>',
           '<text x="10" y="38" fill="#555">bar: the ledger / the naive ledger in the same run; '
           'black tick: the goal; grey line: 1.0</text>']
    for tick in (0.1, 0.25, 0.5, 1, 2, 3, 5):
        x = x_of(tick)
        out.append(f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{height - 40}" '
                   f'stroke="{"#888" if tick == 1 else "#e2e2e2"}"/>')
        out.append(f'<text x="{x:.1f}" y="{height - 26}" text-anchor="middle" fill="#555">{tick:g}</text>')
    for i, (label, ratio, goal, mode) in enumerate(bars):
        y = TOP + i * ROW
        out.append(f'<text x="{LABEL_W - 8}" y="{y + 14}" text-anchor="end">{escape(label)}</text>')
        out.append(f'<rect x="{LABEL_W}" y="{y + 3}" width="{x_of(ratio) - LABEL_W:.1f}" height="{ROW - 7}" '
                   f'fill="{COLOR[mode]}"/>')
        out.append(f'<text x="{x_of(ratio) + 4:.1f}" y="{y + 14}">{ratio:.2f}</text>')
        if goal:
            gx = x_of(goal)
            out.append(f'<line x1="{gx:.1f}" y1="{y + 1}" x2="{gx:.1f}" y2="{y + ROW - 2}" '
                       'stroke="black" stroke-width="2"/>')
    out.append("</svg>")
    open(dst, "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
