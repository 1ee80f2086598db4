#!/usr/bin/env python3
"""CPU seconds spent by one process and by PostgreSQL, between two snapshots.

cpu.py snapshot OUT PID   writes the CPU ticks of PID and of every process
                          named "postgres" to OUT (JSON)
cpu.py diff A B           prints "APP PG": the seconds PID and the postgres
                          processes spent between snapshots A and B (a
                          backend started after A counts from zero)
"""
import json
import os
import sys


def ticks(pid):
    """utime + stime of PID in clock ticks, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def postgres():
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != "postgres":
                    continue
        except OSError:
            continue
        t = ticks(pid)
        if t is not None:
            found[pid] = t
    return found


if sys.argv[1] == "snapshot":
    with open(sys.argv[2], "w") as f:
        json.dump({"app": ticks(sys.argv[3]), "pg": postgres()}, f)
else:
    with open(sys.argv[2]) as f:
        a = json.load(f)
    with open(sys.argv[3]) as f:
        b = json.load(f)
    hz = os.sysconf("SC_CLK_TCK")
    app = (b["app"] - a["app"]) / hz
    pg = sum(t - a["pg"].get(p, 0) for p, t in b["pg"].items()) / hz
    print(f"{app:.2f} {pg:.2f}")
