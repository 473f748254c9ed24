#!/usr/bin/env python3
"""Where a training step's GPU sits idle: read a tools/cupti_trace.cpp timeline (CSV) and print, per
step, the GPU's busy time against the step's span, then the last whole step's largest idle gaps
with the work on either side and the CUDA runtime calls the host was in meanwhile.

usage: trace_gaps.py TRACE.csv [--marker-bytes N | --marker-kernel REGEX] [--gaps K]

Steps are cut at a host-to-device copy that happens once a step (the batch upload): by default the
most frequent H2D copy size, or --marker-bytes; or, for a program that copies nothing each step
(PyTorch), at the kernels matching --marker-kernel that follow 5 ms without a match. The GPU is busy while any kernel, memcpy or memset
runs (intervals merged), so busy + idle = span.
"""
import argparse
import bisect
import collections
import csv
import re
import signal
import sys

signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def short(name, n=70):
    name = name.split("(")[0]
    return name if len(name) <= n else name[: n - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--marker-bytes", type=int, default=0)
    ap.add_argument("--marker-kernel", default="")
    ap.add_argument("--gaps", type=int, default=15)
    a = ap.parse_args()
    gpu, api = [], []
    with open(a.trace) as f:
        for r in csv.DictReader(f):
            e = (int(r["start_ns"]), int(r["end_ns"]), r["kind"], r["name"], int(r["bytes"]))
            (api if r["kind"] == "runtime" else gpu).append(e)
    if not gpu:
        sys.exit(f"{a.trace}: no GPU activity recorded")
    gpu.sort()
    api.sort()
    if a.marker_kernel:
        rx, starts, seen = re.compile(a.marker_kernel), [], None
        for e in gpu:
            if e[2] == "kernel" and rx.search(e[3]):
                if seen is None or e[0] - seen > 5_000_000:
                    starts.append(e[0])
                seen = e[0]
        what = f"kernels matching '{a.marker_kernel}'"
    else:
        h2d = collections.Counter(e[4] for e in gpu if e[2] == "memcpy_htod")
        marker = a.marker_bytes or (max(h2d, key=lambda b: (h2d[b], b)) if h2d else 0)
        starts = [e[0] for e in gpu if e[2] == "memcpy_htod" and e[4] == marker]
        what = f"H2D copies of {marker} bytes (sizes seen: {dict(h2d)})"
    if len(starts) < 2:
        sys.exit(f"{a.trace}: fewer than two step markers ({what})")
    print(f"steps cut at {what}: {len(starts)} markers, {len(starts) - 1} whole steps")
    print(f"{'step':>4} {'span ms':>9} {'busy ms':>9} {'idle ms':>9} {'kernels':>8} {'gaps>10us':>10} {'idle in gaps>10us':>18}")
    gstarts = [e[0] for e in gpu]
    last = None
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        ev = gpu[bisect.bisect_left(gstarts, lo): bisect.bisect_left(gstarts, hi)]
        busy, cur_s, cur_e, gaps = 0, None, None, []
        prev = None
        for e in ev:
            s, t = e[0], min(e[1], hi)
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                    gaps.append((s - cur_e, prev, e, cur_e, s))
                cur_s, cur_e = s, t
            else:
                cur_e = max(cur_e, t)
            prev = e
        busy += cur_e - cur_s
        span = hi - lo
        big = [g for g in gaps if g[0] > 10_000]
        print(f"{i + 1:4d} {span / 1e6:9.3f} {busy / 1e6:9.3f} {(span - busy) / 1e6:9.3f} "
              f"{sum(e[2] == 'kernel' for e in ev):8d} {len(big):10d} {sum(g[0] for g in big) / 1e6:18.3f}")
        last = (lo, hi, gaps)
    lo, hi, gaps = last
    astarts = [e[0] for e in api]
    print(f"\nthe last whole step's {a.gaps} largest idle gaps (us), the work on either side, and the runtime"
          " calls the host made during the gap (count x name, total us)")
    for g, before, after, gs, ge in sorted(gaps, key=lambda g: -g[0])[: a.gaps]:
        calls = collections.defaultdict(lambda: [0, 0])
        for e in api[max(0, bisect.bisect_left(astarts, gs) - 50): bisect.bisect_left(astarts, ge)]:
            if e[1] < gs:
                continue
            c = calls[e[3]]
            c[0] += 1
            c[1] += min(e[1], ge) - max(e[0], gs)
        host = ", ".join(f"{n}x {k} {t / 1e3:.0f}" for k, (n, t) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:3])
        print(f"{g / 1e3:8.1f}  after {before[2]} {short(before[3], 40) if before[3] else before[4]}"
              f"  before {after[2]} {short(after[3], 40) if after[3] else after[4]}  | host: {host}")
    # the host's runtime calls in the last whole step, by total time
    tot = collections.defaultdict(lambda: [0, 0])
    for e in api[bisect.bisect_left(astarts, lo): bisect.bisect_left(astarts, hi)]:
        tot[e[3]][0] += 1
        tot[e[3]][1] += e[1] - e[0]
    print("\nthe last whole step's runtime calls, by host time")
    for k, (n, t) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"{t / 1e3:10.1f} us {n:6d}x  {k}")


if __name__ == "__main__":
    main()
