#!/usr/bin/env python3
"""Draws BENCHMARKS.md's chart from the load benchmark's results JSON.

    python3 bench/chart.py [bench/results/latest.json] [bench/results/chart.svg]

Two panels of horizontal bars, in one SVG file:
  1. every HTTP scenario's requests/s as a ratio to the bare handler of the
     same run, with each target's threshold drawn on its bar;
  2. new-key writes per second as a ratio to the seed-style baseline
     (Python sqlite3, synchronous=FULL) of the same run.
Python 3.11 standard library only.
"""

import json
import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent

# Thresholds drawn on panel 1's bars (ratio to bare), from BENCHMARKS.md.
BARE_TARGETS = {"no_key": 0.97, "get": 0.97, "replay": 0.8, "new_sqlite_normal": 0.5}

WIDTH = 960
LABEL_W = 420
BAR_W = 440
ROW = 24
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def bar_panel(title, subtitle, rows, top, scale_max, unit, reference=None):
    """rows: (label, value, colour, threshold or None). Returns (svg parts, height)."""
    parts = [
        f"<text x='10' y='{top + 18}' {FONT} font-size='16' font-weight='bold'>{escape(title)}</text>",
        f"<text x='10' y='{top + 36}' {FONT} font-size='12' fill='#444'>{escape(subtitle)}</text>",
    ]
    y0 = top + 50
    x0 = LABEL_W

    def x(v):
        return x0 + BAR_W * min(v, scale_max) / scale_max

    for i, (label, value, colour, threshold) in enumerate(rows):
        y = y0 + i * ROW
        if i % 2 == 0:
            parts.append(f"<rect x='0' y='{y}' width='{WIDTH}' height='{ROW}' fill='#f4f4f4'/>")
        parts.append(
            f"<text x='{x0 - 8}' y='{y + 16}' {FONT} font-size='12' text-anchor='end'>{escape(label)}</text>"
        )
        w = max(x(value) - x0, 1)
        parts.append(f"<rect x='{x0}' y='{y + 4}' width='{w:.1f}' height='{ROW - 8}' fill='{colour}'/>")
        parts.append(
            f"<text x='{x0 + w + 6:.1f}' y='{y + 16}' {FONT} font-size='12'>{value:.2f}{unit}</text>"
        )
        if threshold is not None:
            tx = x(threshold)
            parts.append(
                f"<line x1='{tx:.1f}' x2='{tx:.1f}' y1='{y + 1}' y2='{y + ROW - 1}' stroke='#c00' stroke-width='2'/>"
            )
    bottom = y0 + len(rows) * ROW
    if reference is not None:
        rx = x(reference)
        parts.append(
            f"<line x1='{rx:.1f}' x2='{rx:.1f}' y1='{y0}' y2='{bottom}' stroke='#222' stroke-dasharray='4 3'/>"
        )
    # axis
    parts.append(f"<line x1='{x0}' x2='{x0}' y1='{y0}' y2='{bottom}' stroke='#222'/>")
    ticks = 4
    for t in range(ticks + 1):
        v = scale_max * t / ticks
        tx = x(v)
        parts.append(f"<line x1='{tx:.1f}' x2='{tx:.1f}' y1='{bottom}' y2='{bottom + 4}' stroke='#222'/>")
        parts.append(
            f"<text x='{tx:.1f}' y='{bottom + 16}' {FONT} font-size='11' text-anchor='middle'>{v:.3g}</text>"
        )
    return parts, bottom + 24 - top


def nice_ceiling(v):
    """The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten at least v."""
    power = 10 ** math.floor(math.log10(v))
    for step in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if step * power >= v:
            return step * power
    return 10 * power


def colour(scenario_id):
    if scenario_id.startswith("ai_"):
        return "#8a8a8a"
    if scenario_id.startswith("bare"):
        return "#3a3a3a"
    if scenario_id.startswith(("new_sqlite", "tx_sqlite")):
        return "#2f7d4f"
    return "#2b6cb0"


def main():
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results" / "latest.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_name("chart.svg")
    r = json.loads(src.read_text())
    m, cfg = r["machine"], r["config"]

    rows1 = [
        (s["label"], s["ratio_to_bare"], colour(s["id"]), BARE_TARGETS.get(s["id"]))
        for s in r["scenarios"]
    ]
    rows1 += [(s["label"] + " (credits/s)", s["ratio_to_bare"], "#b7791f", None) for s in r["seed"]]
    max1 = nice_ceiling(max([1.0] + [v for _, v, _, _ in rows1]) * 1.08)
    parts, h1 = bar_panel(
        "Requests per second, as a ratio to the bare handler (1.0 = bare)",
        f"bare = {r['bare_rps']:.0f} req/s; red tick: target; {cfg['connections']} connections, "
        f"{cfg['window_s']:g} s window; {m['nproc']} CPUs ({m['cpu_model']}); {m['date']}",
        rows1,
        0,
        max1,
        "x",
        reference=1.0,
    )

    seeds = {s["id"]: s for s in r["seed"]}
    body = parts
    height = h1
    if "seed_full" in seeds:
        base = seeds["seed_full"]["credits_per_s"]
        rows2 = []
        for s in r["scenarios"]:
            if s["id"].startswith(("new_", "tx_sqlite", "ai_new")):
                threshold = 10.0 if s["id"] == "tx_sqlite_full" else None
                rows2.append((s["label"], s["rps"] / base, colour(s["id"]), threshold))
        for s in r["seed"]:
            rows2.append((s["label"], s["credits_per_s"] / base, "#b7791f", None))
        max2 = nice_ceiling(max([1.0] + [v for _, v, _, _ in rows2]) * 1.08)
        p2, h2 = bar_panel(
            "New keys per second, as a ratio to the seed-style baseline (Python sqlite3, FULL)",
            f"seed FULL = {base:.0f} credits/s with {seeds['seed_full']['threads']} threads; "
            "red tick: target (durable transactional FULL >= 10x)",
            rows2,
            h1 + 10,
            max2,
            "x",
            reference=1.0,
        )
        body += p2
        height += 10 + h2

    svg = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
        f"viewBox='0 0 {WIDTH} {height}'>",
        f"<rect width='{WIDTH}' height='{height}' fill='white'/>",
        *body,
        "</svg>",
    ]
    out.write_text("\n".join(svg) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
