#!/usr/bin/env python3
"""Dynamic SASS instruction mix of profiled kernels, from ncu's source page.

usage: ncu -i REPORT --page source --csv --print-source sass > k.csv
       python3 scripts/ncu_opmix.py k.csv [--top N]

For each kernel section of the CSV (ncu prints one header row per profiled launch), sums the
"Instructions Executed" (warp instructions) of every SASS line by opcode (the mnemonic up to its
first '.', predicates dropped) and prints the top opcodes with their share, so a profile says which
instructions a kernel spends its issue slots on without copying the whole listing off the machine.
"""
import argparse
import collections
import csv
import sys


def opcode(sass: str) -> str:
    s = sass.strip()
    if s.startswith("@"):
        s = s.split(None, 1)[1] if " " in s else s
    return s.split(None, 1)[0].split(".")[0] if s else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="opcodes to print per kernel (default 25)")
    args = ap.parse_args()
    sections = []  # [name, Counter]
    name = "?"
    src_col = exe_col = None
    with open(args.csv, newline="", errors="replace") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":  # each launch's section starts with its kernel's name
                name = row[1] if len(row) > 1 else "?"
                continue
            if "Source" in row and any(c.startswith("Instructions Executed") for c in row):
                src_col = row.index("Source")
                exe_col = next(i for i, c in enumerate(row) if c.startswith("Instructions Executed"))
                sections.append([f"launch {len(sections) + 1}: {name}", collections.Counter()])
                continue
            if src_col is None or len(row) <= max(src_col, exe_col):
                continue
            try:
                n = float(row[exe_col].replace(",", "") or 0)
            except ValueError:
                continue
            if sections and sections[-1][1] is not None:
                sections[-1][1][opcode(row[src_col])] += n
    shown = 0
    for name, counts in sections:
        total = sum(counts.values())
        if total == 0:
            continue
        shown += 1
        print(f"== {name[:150]}: {total / 1e6:.2f} M warp instructions")
        for op, n in counts.most_common(args.top):
            print(f"  {op:<10} {n / 1e6:8.3f} M  {100 * n / total:5.1f}%")
    if shown == 0:
        print("ncu_opmix: no 'Source' / 'Instructions Executed' columns found", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
