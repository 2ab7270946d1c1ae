#!/usr/bin/env python3
"""Summarizes results/*.txt: for each thread count, size and variant, the
median over runs of each run's median, with the range over runs."""
import glob
import re
import statistics as st
import sys
from pathlib import Path

rows = {}
setup = {}
for f in sorted(glob.glob(str(Path(__file__).parent / "results" / "*.txt"))):
    threads = "1" if Path(f).name.startswith("1-") else "all"
    size, section = None, None
    for line in open(f):
        m = re.match(r"B3 over (\d+) f32", line.strip())
        if m:
            size, section = int(m.group(1)), "run"
            continue
        if line.startswith("Setup"):
            section = "setup"
            continue
        if line.startswith("Break"):
            section = None
            continue
        if not line.startswith("| ") or line.startswith(("| variant", "| program")) or not section:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if section == "run":
            rows.setdefault((threads, size, cells[0]), []).append(
                [float(cells[i]) for i in (1, 3, 5, 6)]
            )
        else:
            medians = [float(c.split()[0]) for c in cells[1:]]
            setup.setdefault(cells[0], []).append(medians)


def fmt(values, digits):
    return f"{st.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


print("| threads | elements | variant | ms | ns/element | x copy | speed-up over interpreter |")
print("|---|---|---|---|---|---|---|")
for (threads, size, name), v in rows.items():
    cols = list(zip(*v))
    print(
        f"| {threads} | {size} | {name} | {fmt(cols[0], 3)} | {fmt(cols[1], 3)} "
        f"| {fmt(cols[2], 2)} | {fmt(cols[3], 2)} |"
    )
print()
print("| program | interpreter factory µs | cranelift module µs | compile unroll 1 µs | unroll 2 µs | unroll 4 µs |")
print("|---|---|---|---|---|---|")
for name, v in setup.items():
    cols = list(zip(*v))
    print(f"| {name} | " + " | ".join(fmt(c, 1) for c in cols) + " |")
sys.exit(0)
