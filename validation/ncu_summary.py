#!/usr/bin/env python3
"""Sum an `ncu --csv --metrics gpu__time_duration.sum` log per kernel name: time share table."""
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
hdr = rows[0]; ki = hdr.index("Kernel Name"); vi = hdr.index("Metric Value"); ui = hdr.index("Metric Unit")
tot = collections.Counter(); cnt = collections.Counter()
scale = {"ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3, "second": 1e6}
for r in rows[1:]:
    name = r[ki].split("(")[0][:90]
    tot[name] += float(r[vi].replace(",", "")) * scale.get(r[ui], 1); cnt[name] += 1
all_us = sum(tot.values())
print(f"total kernel time {all_us/1e3:.1f} ms over {sum(cnt.values())} launches")
for name, us in tot.most_common(40):
    print(f"{us/1e3:9.2f} ms {100*us/all_us:5.1f}% {cnt[name]:6d}x  {name}")
