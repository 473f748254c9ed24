#!/usr/bin/env python3
"""Check fp4sim's scalar format conversions (DESIGN.md section 2) against ml_dtypes.

Decode: every code of e2m1, e4m3, e5m2, bf16 and ue8m0, decoded by `fp4sim convert --decode`, must
equal ml_dtypes' value bit for bit as float32 (any NaN matches any NaN).
Encode: FP32 inputs = every rounding boundary of each format with its +-1 ulp neighbours (both
signs), specials (+-0, +-Inf, NaNs, subnormals, extremes) and N random uint32 bit patterns, encoded by
`fp4sim convert --format F`. Compared with ml_dtypes' cast only where both define the result the
same way (ml_dtypes does not saturate): e2m1 |x| <= 6, e4m3 |x| <= 448, e5m2 |x| <= 57344, each
extended up to the overflow midpoint (7, 464, 61440, exclusive) when a probe shows that ml_dtypes
rounds that band to the largest finite value; bf16 everything (NaN: "is NaN"). Negative values
rounding to zero, NaNs and overflows are checked against the contract's satfinite rules instead
(-> sign-bit code; NaN -> 0x7 / 0x7F / an E5M2 NaN code / BF16 0x7FFF; overflow -> +-max).
UE8M0 rz/rp are checked against a numpy implementation of the contract (ml_dtypes' float8_e8m0fnu
rounds to nearest; its agreement with rz is reported for information only).

Run (from the repository root, after building):
    python3 validation/oracle_ml_dtypes.py --fp4sim build/fp4sim --n 20000000 --out runs/oracle
Exit status 1 on any disagreement inside a compared domain or any contract violation.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import ml_dtypes
import numpy as np

NARROW = {  # ml_dtypes type, sign-bit code, magnitude mask, largest finite magnitude code, NaN code
    "e2m1": (ml_dtypes.float4_e2m1fn, 0x8, 0x7, 0x7, 0x7),
    "e4m3": (ml_dtypes.float8_e4m3fn, 0x80, 0x7F, 0x7E, 0x7F),
    "e5m2": (ml_dtypes.float8_e5m2, 0x80, 0x7F, 0x7B, None),  # None: any E5M2 NaN code
}
DECODE = [("e2m1", ml_dtypes.float4_e2m1fn, 16), ("e4m3", ml_dtypes.float8_e4m3fn, 256),
          ("e5m2", ml_dtypes.float8_e5m2, 256), ("bf16", ml_dtypes.bfloat16, 65536),
          ("ue8m0", ml_dtypes.float8_e8m0fnu, 256)]
ENCODE = ["e2m1", "e4m3", "e5m2", "bf16", "ue8m0_rz", "ue8m0_rp"]
SPECIAL_BITS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                0xFF800001, 0x7FA00000, 0xFFA00000, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x00000001,
                0x80000001, 0x00000002, 0x007FFFFF, 0x807FFFFF, 0x00400000, 0x80400000, 0x00800000,
                0x80800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000]


def log(*a):
    print(*a, flush=True)


def f32_of(bits):
    return np.ascontiguousarray(bits, dtype=np.uint32).view(np.float32)


def bits_of(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def ml_cast(x, dt, mask=None):
    """ml_dtypes' cast of float32 values to dt, as raw codes."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        c = np.ascontiguousarray(x, dtype=np.float32).astype(dt)
    c = c.view(np.uint16 if dt == ml_dtypes.bfloat16 else np.uint8)
    return c & mask if mask is not None else c


def ml_decode(codes, dt):
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return np.ascontiguousarray(codes).view(dt).astype(np.float32)


class Fp4sim:
    def __init__(self, path, tmp):
        self.path, self.tmp = path, tmp

    def _run(self, args):
        p = subprocess.run([self.path, "convert"] + args, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError("fp4sim convert %s failed (rc %d):\n%s%s"
                               % (" ".join(args), p.returncode, p.stdout, p.stderr))

    def _load(self, path, dtype, n):
        y = np.load(path)
        if y.dtype != np.dtype(dtype) or y.shape != (n,):
            raise RuntimeError("%s: expected %s [%d], got %s %s" % (path, np.dtype(dtype), n,
                                                                   y.dtype, y.shape))
        return y

    def encode(self, fmt, in_path, n):
        out = os.path.join(self.tmp, "enc_%s.npy" % fmt)
        self._run(["--format", fmt, in_path, out])
        return self._load(out, np.uint16 if fmt == "bf16" else np.uint8, n)

    def decode(self, fmt, codes):
        inp, out = os.path.join(self.tmp, "dec_in.npy"), os.path.join(self.tmp, "dec_out.npy")
        np.save(inp, codes)
        self._run(["--decode", "--format", fmt, inp, out])
        return self._load(out, np.float32, codes.size)


class Section:
    """One comparison: count, agreements, first 10 disagreements in hex."""

    def __init__(self, fmt, name, fatal, width, labels=("fp4sim", "reference")):
        self.fmt, self.name, self.fatal, self.width = fmt, name, fatal, width
        self.labels = labels
        self.tested = self.agree = 0
        self.examples = []

    def add(self, xbits, got, ref, ok=None):
        if ok is None:
            ok = got == ref
        self.tested += int(xbits.size)
        self.agree += int(np.count_nonzero(ok))
        for i in np.flatnonzero(~ok)[: max(0, 10 - len(self.examples))]:
            self.examples.append({"input": "0x%08x" % int(xbits[i]),
                                  self.labels[0]: "0x%0*x" % (self.width, int(got[i])),
                                  self.labels[1]: "0x%0*x" % (self.width, int(ref[i]))})

    def json(self):
        return {"format": self.fmt, "check": self.name, "fatal": self.fatal, "tested": self.tested,
                "agree": self.agree, "disagree": self.tested - self.agree,
                "first_disagreements": self.examples}


def ue8m0_ref(xbits, rule):
    """UE8M0 from the contract, written independently of fp4sim (rp through frexp, not bit fields)."""
    a = xbits & np.uint32(0x7FFFFFFF)
    nan, inf = a > 0x7F800000, a == 0x7F800000
    if rule == "rz":
        r = (a >> np.uint32(23)).astype(np.int64)  # zero and subnormals: exponent field 0
    else:
        with np.errstate(all="ignore"):
            v = np.abs(f32_of(xbits).astype(np.float64))
            m, e = np.frexp(np.where(nan | inf, 1.0, v))
        r = np.where(m == 0.5, e - 1, e).astype(np.int64) + 127  # ceil(log2 v) + 127
        r = np.where(v == 0, 0, np.clip(r, 0, 0xFE))
    r = np.where(inf, 0xFE, np.where(nan, 0xFF, r))
    return r.astype(np.uint8)


def format_values(dt, ncodes):
    """Finite non-negative values of a format (float64, sorted, unique)."""
    v = ml_decode(np.arange(ncodes, dtype=np.uint16 if ncodes > 256 else np.uint8), dt)
    with np.errstate(all="ignore"):
        v = v.astype(np.float64)
    return np.unique(np.abs(v[np.isfinite(v)]))


def band_top(dt, ncodes):
    """(largest finite value, overflow midpoint = max + half the top ulp)."""
    v = format_values(dt, ncodes)
    return v[-1], v[-1] + (v[-1] - v[-2]) / 2


def edge_inputs(seed):
    pts = [np.ldexp(1.0, np.arange(-149, 128))]  # FP32 powers of two (UE8M0 boundaries)
    for _, dt, nc in DECODE:
        v = format_values(dt, nc)
        pts += [v, (v[:-1] + v[1:]) / 2, [v[-1] + (v[-1] - v[-2]) / 2]]  # values, midpoints, top
    p64 = np.concatenate([np.asarray(p, dtype=np.float64) for p in pts])
    p = p64.astype(np.float32)
    assert np.array_equal(p.astype(np.float64), p64), "a boundary is not exact in float32"
    p = np.concatenate([p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(-np.inf))])
    p = np.concatenate([p, -p])
    rng = np.random.default_rng(seed + 1)
    sub = rng.integers(1, 1 << 23, size=4096, dtype=np.uint32) | (
        rng.integers(0, 2, size=4096, dtype=np.uint32) << np.uint32(31))
    return np.unique(np.concatenate([bits_of(p), np.array(SPECIAL_BITS, dtype=np.uint32), sub]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fp4sim", default="build/fp4sim", help="path to the fp4sim binary")
    ap.add_argument("--n", type=int, default=20_000_000, help="random FP32 bit patterns")
    ap.add_argument("--out", default="runs/oracle_ml_dtypes", help="directory for the JSON report")
    ap.add_argument("--seed", type=int, default=20250101)
    ap.add_argument("--chunk", type=int, default=4_000_000)
    args = ap.parse_args()
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    report = {"fp4sim": args.fp4sim, "n_random": args.n, "seed": args.seed,
              "numpy": np.__version__, "ml_dtypes": getattr(ml_dtypes, "__version__", "?")}
    sections, secmap = [], {}

    def sec(fmt, name, fatal, width=2, labels=("fp4sim", "reference")):
        if (fmt, name) not in secmap:
            secmap[(fmt, name)] = Section(fmt, name, fatal, width, labels)
            sections.append(secmap[(fmt, name)])
        return secmap[(fmt, name)]

    # Compared domain for the narrow formats: include (max, overflow midpoint) only when ml_dtypes
    # rounds that band to +-max (it does not saturate beyond it).
    domain = {}
    for fmt, (dt, sign, mag, maxc, _) in NARROW.items():
        mx, top = band_top(dt, 16 if fmt == "e2m1" else 256)
        probe = np.array([np.nextafter(np.float32(mx), np.float32(np.inf)), (mx + top) / 2,
                          np.nextafter(np.float32(top), np.float32(0))], dtype=np.float32)
        probe = np.concatenate([probe, -probe])
        expect = np.where(probe < 0, maxc | sign, maxc).astype(np.uint8)
        band = bool(np.array_equal(ml_cast(probe, dt, 0xF if fmt == "e2m1" else None), expect))
        limit = bits_of(np.float32(top if band else mx)).reshape(-1)[0]
        domain[fmt] = (int(limit), band)
        report.setdefault("domain", {})[fmt] = {
            "max": float(mx), "overflow_midpoint": float(top), "band_included": band,
            "compared": ("|x| < %g" if band else "|x| <= %g") % (top if band else mx)}
        log("%-5s compared domain: %s (ml_dtypes rounds (%g, %g) to max: %s)"
            % (fmt, report["domain"][fmt]["compared"], mx, top, band))

    with tempfile.TemporaryDirectory(prefix="oracle_ml_dtypes_") as tmp:
        fp = Fp4sim(args.fp4sim, tmp)
        # ---- decode: every code ----
        for fmt, dt, nc in DECODE:
            codes = np.arange(nc, dtype=np.uint16 if fmt == "bf16" else np.uint8)
            got, ref = bits_of(fp.decode(fmt, codes)), bits_of(ml_decode(codes, dt))
            both_nan = ((got & 0x7FFFFFFF) > 0x7F800000) & ((ref & 0x7FFFFFFF) > 0x7F800000)
            sec(fmt, "decode vs ml_dtypes", True, 8).add(codes, got, ref, (got == ref) | both_nan)

        # ---- encode ----
        minus_zero = {}

        def check_chunk(xb):
            x = f32_of(xb)
            inp = os.path.join(tmp, "in.npy")
            np.save(inp, x)
            a = xb & np.uint32(0x7FFFFFFF)
            neg = (xb >> np.uint32(31)) == 1
            nan = a > 0x7F800000
            for fmt in ENCODE:
                got = fp.encode(fmt, inp, xb.size)
                if fmt in NARROW:
                    dt, sign, mag, maxc, nanc = NARROW[fmt]
                    ref = ml_cast(x, dt, 0xF if fmt == "e2m1" else None)
                    limit, band = domain[fmt]
                    inr = (a < limit) if band else (a <= limit)
                    negz = inr & neg & ((ref & mag) == 0)
                    main = inr & ~negz
                    sec(fmt, "vs ml_dtypes", True).add(xb[main], got[main], ref[main])
                    s = sec(fmt, "negative -> -0 (contract)", True)
                    s.add(xb[negz], got[negz], np.full(int(negz.sum()), sign, np.uint8))
                    sec(fmt, "negative -> -0: ml_dtypes keeps the sign (info)", False, 2,
                        ("ml_dtypes", "contract")).add(
                        xb[negz], ref[negz], np.full(int(negz.sum()), sign, np.uint8))
                    ov = ~nan & ~inr
                    exp = np.where(neg[ov], maxc | sign, maxc).astype(np.uint8)
                    sec(fmt, "overflow -> +-max (contract)", True).add(xb[ov], got[ov], exp)
                    gn = got[nan]
                    if nanc is None:  # E5M2: any NaN code (0x7D..0x7F, either sign)
                        sec(fmt, "NaN -> a NaN code (contract)", True).add(
                            xb[nan], gn, np.full(gn.size, 0x7F, np.uint8), (gn & mag) > 0x7C)
                    else:
                        sec(fmt, "NaN -> 0x%02x (contract)" % nanc, True).add(
                            xb[nan], gn, np.full(gn.size, nanc, np.uint8))
                    hit = np.flatnonzero(xb == 0x80000000)
                    if hit.size:
                        minus_zero[fmt] = {"fp4sim": "0x%02x" % int(got[hit[0]]),
                                           "ml_dtypes": "0x%02x" % int(ref[hit[0]]),
                                           "expected": "0x%02x" % sign}
                elif fmt == "bf16":
                    ref = ml_cast(x, ml_dtypes.bfloat16)
                    sec(fmt, "vs ml_dtypes (non-NaN)", True, 4).add(xb[~nan], got[~nan], ref[~nan])
                    gn, rn = got[nan], ref[nan]
                    isn = lambda c: (c & 0x7FFF) > 0x7F80  # noqa: E731
                    sec(fmt, "NaN: both NaN (vs ml_dtypes)", True, 4).add(xb[nan], gn, rn,
                                                                          isn(gn) & isn(rn))
                    sec(fmt, "NaN -> 0x7fff (contract)", True, 4).add(
                        xb[nan], gn, np.full(gn.size, 0x7FFF, np.uint16))
                else:
                    rule = fmt.split("_")[1]
                    sec(fmt, "vs numpy contract", True).add(xb, got, ue8m0_ref(xb, rule))
                    if rule == "rz":
                        sec(fmt, "same as ml_dtypes float8_e8m0fnu cast (info)", False, 2,
                            ("fp4sim", "ml_dtypes")).add(
                            xb, got, ml_cast(x, ml_dtypes.float8_e8m0fnu))

        edges = edge_inputs(args.seed)
        log("edge inputs: %d (boundaries +-1 ulp, both signs, specials, subnormals)" % edges.size)
        for i in range(0, edges.size, args.chunk):
            check_chunk(edges[i:i + args.chunk])
        rng = np.random.default_rng(args.seed)
        done = 0
        while done < args.n:
            m = min(args.chunk, args.n - done)
            check_chunk(np.frombuffer(rng.bytes(4 * m), dtype="<u4").astype(np.uint32))
            done += m
            log("random inputs: %d / %d  (%.0f s)" % (done, args.n, time.time() - t0))
        report["minus_zero"] = minus_zero

    failed = False
    log("\n%-9s %-50s %12s %12s %10s" % ("format", "check", "tested", "agree", "disagree"))
    for s in sections:
        bad = s.tested - s.agree
        mark = "" if bad == 0 else ("  FAIL" if s.fatal else "  (info)")
        failed |= s.fatal and bad > 0
        log("%-9s %-50s %12d %12d %10d%s" % (s.fmt, s.name, s.tested, s.agree, bad, mark))
        for e in s.examples:
            log("            input %s  %s %s  %s %s" % (e["input"], s.labels[0], e[s.labels[0]],
                                                        s.labels[1], e[s.labels[1]]))
    for fmt, mz in minus_zero.items():
        log("-0.0 -> %-5s fp4sim %s  ml_dtypes %s  (contract %s)" % (fmt, mz["fp4sim"],
                                                                     mz["ml_dtypes"], mz["expected"]))
    report["sections"] = [s.json() for s in sections]
    report["passed"] = not failed
    report["seconds"] = round(time.time() - t0, 1)
    path = os.path.join(args.out, "oracle_ml_dtypes.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    log("\n%s   report: %s" % ("PASS" if not failed else "FAIL", path))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
