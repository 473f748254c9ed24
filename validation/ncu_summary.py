#!/usr/bin/env python3
"""Sum an `ncu --csv --metrics gpu__time_duration.sum` log per kernel name: time share table.

usage: ncu_summary.py PROFILE.csv              per-kernel time, largest first (40 rows)
       ncu_summary.py BASE.csv OTHER.csv       per-kernel difference OTHER - BASE, largest |difference|
                                               first (e.g. a BF16 step against an NVFP4 step)
"""
import collections
import csv
import signal
import sys

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`

SCALE = {"ns": 1e-3, "nsecond": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3, "ms": 1e3, "second": 1e6}


def load(path):
    rows = [r for r in csv.reader(l for l in open(path) if l.startswith('"'))]
    hdr = rows[0]
    ki, vi, ui = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("Metric Unit")
    tot, cnt = collections.Counter(), collections.Counter()
    for r in rows[1:]:
        name = r[ki].split("(")[0][:90]
        tot[name] += float(r[vi].replace(",", "")) * SCALE.get(r[ui], 1)
        cnt[name] += 1
    return tot, cnt


if len(sys.argv) not in (2, 3):
    sys.exit(__doc__)
tot, cnt = load(sys.argv[1])
all_us = sum(tot.values())
print(f"total kernel time {all_us/1e3:.1f} ms over {sum(cnt.values())} launches")
if len(sys.argv) == 2:
    for name, us in tot.most_common(40):
        print(f"{us/1e3:9.2f} ms {100*us/all_us:5.1f}% {cnt[name]:6d}x  {name}")
else:
    tot2, cnt2 = load(sys.argv[2])
    print(f"other: total kernel time {sum(tot2.values())/1e3:.1f} ms over {sum(cnt2.values())} launches")
    names = sorted(set(tot) | set(tot2), key=lambda n: -abs(tot2[n] - tot[n]))
    print(f"{'other-base':>10}  {'base ms (n)':>14}  {'other ms (n)':>14}  kernel")
    for n in names[:40]:
        print(f"{(tot2[n]-tot[n])/1e3:10.2f}  {tot[n]/1e3:7.2f} ({cnt[n]:4d})  {tot2[n]/1e3:7.2f} ({cnt2[n]:4d})  {n}")
