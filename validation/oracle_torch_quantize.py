#!/usr/bin/env python3
"""Check `fp4sim quantize` (NVFP4, RN, 1x16 and 16x16) against an independent PyTorch oracle.

The oracle re-implements DESIGN.md section 5 on float32 tensors (GPU when available), one IEEE
operation at a time, with PyTorch's own float32 -> float8_e4m3fn cast for the block scales and its own
E2M1 round-to-nearest-even (thresholds at the midpoints of the E2M1 grid, ties to the even code); no
fp4sim code is used. It first passes a self-test (the contract's worked vector, E4M3 and E2M1 known
answers), then quantizes seeded test tensors (gaussian, heavy-tailed, zeros and all-zero rows, tiny
and subnormal values, huge values, NaN/Inf, exact E2M1 ties, data within ulps of the E4M3 and E2M1
rounding boundaries of the scale chain) and compares codes, scales and amax bit for bit with what
`fp4sim quantize IN.npy PREFIX [--2d] --backend B` writes: PREFIX.codes.npy uint8 [R, C/2] (low
nibble = even element), PREFIX.scales.npy uint8 E4M3 [R, C/16], PREFIX.amax.npy float32 [1].

Run (from the repository root, after building):
    python3 validation/oracle_torch_quantize.py --fp4sim build/fp4sim --backends emu,cuda \
        --out runs/oracle_torch
Exit status 1 on any mismatch or self-test failure.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

FLT_MAX = float(np.finfo(np.float32).max)
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # codes 0..7


def log(*a):
    print(*a, flush=True)


def full(v, dev):
    return torch.full((1,), v, dtype=torch.float32, device=dev)


def e2m1_rn(y):
    """E2M1 rn.satfinite of a float32 tensor, as uint8 codes: count the grid midpoints below |y|;
    at an exact midpoint round to the even code. |y| > 6 -> 7, NaN -> 0x7, sign bit -> 0x8."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.int32, device=y.device)
    for k in range(7):
        mid = (E2M1_GRID[k] + E2M1_GRID[k + 1]) / 2  # exact in float32
        code += (a >= mid if (k + 1) % 2 == 0 else a > mid).to(torch.int32)
    code = torch.where(torch.signbit(y), code + 8, code)
    code = torch.where(torch.isnan(y), torch.full_like(code, 7), code)
    return code.to(torch.uint8)


def global_scales(amax, dev):
    """S_enc, S_dec as numpy float32 scalars, computed twice (numpy and torch) and cross-checked."""
    with np.errstate(all="ignore"):
        s = np.float32(2688.0) / amax
    s = min(s, np.float32(FLT_MAX))
    if amax == 0 or s == 0:
        s = np.float32(1.0)
    d = np.float32(1.0) / s
    ts = torch.minimum(torch.div(full(2688.0, dev), full(float(amax), dev)), full(FLT_MAX, dev))
    if float(amax) == 0.0 or ts.item() == 0.0:
        ts = full(1.0, dev)
    td = torch.div(full(1.0, dev), ts)
    got = (np.float32(ts.item()).view(np.uint32), np.float32(td.item()).view(np.uint32))
    assert got == (s.view(np.uint32), d.view(np.uint32)), "torch/numpy S_enc or S_dec differ"
    return s, d


def oracle_quantize(x_np, two_d, dev):
    """Returns (packed codes uint8 [R, C/2], scales uint8 [R, C/16], amax float32 [1], info)."""
    R, C = x_np.shape
    x = torch.from_numpy(np.ascontiguousarray(x_np, dtype=np.float32)).to(dev)
    ax = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())  # NaN ignored
    amax = np.float32(ax.max().item())
    s_enc, s_dec = global_scales(amax, dev)
    c = np.float32(s_enc * (np.float32(1.0) / np.float32(6.0)))  # S_enc * (1.0f/6.0f), rounded
    if two_d:
        xb = x.view(R // 16, 16, C // 16, 16)
        amax_b = ax.view(R // 16, 16, C // 16, 16).amax(dim=(1, 3))  # [R/16, C/16]
    else:
        xb = x.view(R, C // 16, 16)
        amax_b = ax.view(R, C // 16, 16).amax(dim=2)  # [R, C/16]
    pre = amax_b * full(float(c), dev)  # one IEEE multiplication
    pre = torch.clamp(pre, max=448.0)  # satfinite (pre >= 0); torch's cast alone is not saturating
    s8 = pre.to(torch.float8_e4m3fn)
    s_bits = s8.view(torch.uint8)
    den = s8.to(torch.float32) * full(float(s_dec), dev)
    enc = torch.minimum(torch.div(torch.ones_like(den), den), torch.full_like(den, FLT_MAX))
    if two_d:
        y = xb * enc.view(R // 16, 1, C // 16, 1)
    else:
        y = xb * enc.view(R, C // 16, 1)
    q = e2m1_rn(y.reshape(R, C))
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    scales = s_bits.cpu().numpy()
    if two_d:
        scales = np.repeat(scales, 16, axis=0)  # one entry per row, repeated down the tile
    info = {"S_enc": float(s_enc), "S_dec": float(s_dec)}
    return packed.cpu().numpy(), scales, np.array([amax], dtype=np.float32), info


def worked_example():
    i = np.arange(16, dtype=np.float64)
    return np.concatenate([0.25 * i - 2.0, 0.001 * (i + 1)]).astype(np.float32).reshape(1, 32)


def self_test(dev):
    errs = []
    codes, scales, amax, info = oracle_quantize(worked_example(), False, dev)
    want = bytes.fromhex("FF EE CD AB 20 43 65 76 21 32 44 55 65 66 76 77")
    if amax[0] != 2.0 or info["S_enc"] != 1344.0:
        errs.append("worked example: amax %r S_enc %r" % (amax[0], info["S_enc"]))
    if scales.tobytes() != bytes([0x7E, 0x46]):
        errs.append("worked example scales %s, want 7e 46" % scales.tobytes().hex(" "))
    if codes.tobytes() != want:
        errs.append("worked example codes %s, want %s" % (codes.tobytes().hex(" "), want.hex(" ")))
    # torch's E4M3 cast: RN ties-to-even, subnormals
    e4 = {1.0: 0x38, 448.0: 0x7E, 2.0 ** -9: 0x01, 2.0 ** -10: 0x00, 3 * 2.0 ** -10: 0x02,
          1.0625: 0x38, 1.1875: 0x3A, 0.0: 0x00, 2.0 ** -6: 0x08, 15 * 2.0 ** -10: 0x08}
    got = torch.tensor(list(e4), dtype=torch.float32, device=dev).to(torch.float8_e4m3fn)
    for (v, w), g in zip(e4.items(), got.view(torch.uint8).cpu().tolist()):
        if g != w:
            errs.append("torch e4m3(%r) = 0x%02x, want 0x%02x" % (v, g, w))
    # E2M1: ties to even, satfinite, NaN, signed zero; then brute force nearest (float64) on a sweep
    e2 = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6, 7.0: 7, float("inf"): 7,
          float("nan"): 7, -0.0: 8, -0.25: 8, -5.0: 14, -1e30: 15, 1e-45: 0}
    got = e2m1_rn(torch.tensor(list(e2), dtype=torch.float32, device=dev)).cpu().tolist()
    for (v, w), g in zip(e2.items(), got):
        if g != w:
            errs.append("e2m1_rn(%r) = %d, want %d" % (v, g, w))
    grid = np.array(E2M1_GRID)
    mids = (grid[:-1] + grid[1:]) / 2
    ys = np.concatenate([np.linspace(0, 8, 100001), mids]).astype(np.float32)
    ys = np.concatenate([ys, np.nextafter(ys, np.float32(0)), np.nextafter(ys, np.float32(9))])
    d = np.abs(ys.astype(np.float64)[:, None] - grid[None, :])
    best = np.argmin(d, axis=1)  # on a tie argmin takes the lower code ...
    rows = np.arange(ys.size)
    tie = (d[rows, best] == d[rows, np.minimum(best + 1, 7)]) & (best < 7)
    best = np.where(tie & (best % 2 == 1), best + 1, best)  # ... moved to the even code
    got = e2m1_rn(torch.from_numpy(ys).to(dev)).cpu().numpy()
    n_bad = int(np.count_nonzero(got != best))
    if n_bad:
        errs.append("e2m1_rn disagrees with brute force on %d of %d values" % (n_bad, ys.size))
    return errs


def ulp_jitter(v, rng, k=2):
    """v (positive float32) moved by a random number of ulps in [-k, k]."""
    d = rng.integers(-k, k + 1, size=v.shape)
    return (v.view(np.int32).astype(np.int64) + d).astype(np.int32).view(np.float32)


def boundary_case(rng, shape=(256, 256), amax=3.7):
    """Rounding-boundary data for the whole arithmetic chain. amax is nudged until S_enc*(1.0f/6.0f)
    differs from S_enc/6.0f; every 16x16 tile (and so each of its 1x16 blocks) has an amax v such
    that v * (S_enc * (1/6)) lies within 2 ulps of an E4M3 midpoint, and its other elements x are
    within 2 ulps of t / enc_b for E2M1 midpoints t. Any other order of the operations (e.g.
    (amax_b / 6) * S_enc, or S_enc / s_b for enc_b) then changes some scales or codes."""
    f = np.float32
    amax = f(amax)
    while True:
        s_enc = f(2688.0) / amax
        if s_enc * (f(1.0) / f(6.0)) != s_enc / f(6.0):
            break
        amax = np.nextafter(amax, f(10))
    c, s_dec = s_enc * (f(1.0) / f(6.0)), f(1.0) / s_enc
    k = np.arange(127)  # E4M3 magnitudes: exponent field k >> 3, mantissa k & 7, bias 7
    e4 = np.where(k >> 3 == 0, (k & 7) * 2.0 ** -9, (8 + (k & 7)) * 2.0 ** ((k >> 3) - 10))
    mids = (e4[:-1] + e4[1:]) / 2
    R, C = shape
    v = ulp_jitter((rng.choice(mids[mids < 400], size=(R // 16, C // 16)) / float(c)).astype(f), rng)
    pre = torch.clamp(torch.from_numpy(v * c), max=448.0)
    s_f = pre.to(torch.float8_e4m3fn).to(torch.float32).numpy()
    with np.errstate(all="ignore"):
        enc = np.minimum(f(1.0) / (s_f * s_dec), f(np.finfo(f).max)).astype(f)
    t = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], size=shape)
    enc_full = np.repeat(np.repeat(enc, 16, axis=0), 16, axis=1).astype(np.float64)
    x = ulp_jitter((t / enc_full).astype(f), rng)
    x = np.minimum(x, np.repeat(np.repeat(v, 16, axis=0), 16, axis=1))  # keep the tile amax v
    pos = rng.integers(0, 16, size=(R, C // 16)) + 16 * np.arange(C // 16)[None, :]
    np.put_along_axis(x, pos, np.repeat(v, 16, axis=0), axis=1)  # each 1x16 block holds v
    x = x * np.where(rng.random(shape) < 0.5, f(-1), f(1))
    x[0, 0] = amax
    return x


def make_cases(seed):
    rng = np.random.default_rng(seed)
    f = np.float32
    cases = [("worked_example", worked_example())]
    cases.append(("gaussian", rng.standard_normal((64, 128)).astype(f)))
    h = rng.standard_normal((128, 256)) * np.exp(1.5 * rng.standard_normal((128, 256)))
    cases.append(("heavy_tailed", h.astype(f)))
    m = rng.standard_normal((48, 80)).astype(f)
    m[rng.random(m.shape) < 0.05] = 0.0
    m[rng.random(m.shape) < 0.02] = -0.0
    m[3], m[20] = 0.0, -0.0  # all-zero rows
    m[5] *= f(1e-30)  # tiny row
    m[7, :16] *= f(1e-38)  # subnormal-ish block
    sub = rng.integers(1, 1 << 23, size=80, dtype=np.uint32) | (
        rng.integers(0, 2, size=80, dtype=np.uint32) << np.uint32(31))
    m[9] = sub.view(f)  # FP32 subnormals
    cases.append(("zeros_tiny_subnormal", m))
    mh = m.copy()
    mh[30] *= f(1e30)  # huge row: everything else underflows
    mh[31, 5] = f(3e38)
    cases.append(("huge", mh))
    cases.append(("subnormal_only", (rng.integers(1, 1 << 23, size=(32, 64), dtype=np.uint32)
                                     | (rng.integers(0, 2, (32, 64), dtype=np.uint32) << np.uint32(31))
                                     ).view(f)))
    # Exact E2M1 ties: amax = 2688 so S_enc = 1; every block/tile of row group g has amax_b = 6*P
    # (P a power of two), so s_b = P and enc_b = 1/P exactly and x * enc_b = t exactly.
    t = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5] + E2M1_GRID, dtype=f)
    t = np.concatenate([t, np.nextafter(t, f(0)), np.nextafter(t, f(10))])
    t = t[t <= 6]  # keep every block's amax at exactly 6*P
    tt = np.zeros((64, 64), dtype=f)
    for r in range(64):
        p = f([2.0 ** -8, 0.5, 1.0, 4.0][r // 16])
        row = rng.choice(t, size=64) * np.where(rng.random(64) < 0.5, f(-1), f(1)) * p
        row[0::16] = 6 * p
        tt[r] = row
    tt[63, 63] = 2688.0
    cases.append(("ties", tt))
    cases.append(("rounding_boundaries", boundary_case(rng)))
    w = rng.standard_normal((64, 128)).astype(f)
    w[rng.random(w.shape) < 0.01] = np.nan
    cases.append(("nan", w))
    wi = rng.standard_normal((32, 64)).astype(f)
    wi[4, 7], wi[20, 33] = np.inf, -np.inf
    cases.append(("inf", wi))
    b = rng.standard_normal((256, 1024)) * np.exp(1.5 * rng.standard_normal((256, 1024)))
    b.ravel()[::997] *= 100.0
    cases.append(("large_heavy_outliers", b.astype(f)))
    return cases


def unpack(codes):
    return np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1)


def run_fp4sim(exe, x, two_d, backend, tmp):
    inp, prefix = os.path.join(tmp, "x.npy"), os.path.join(tmp, "q")
    np.save(inp, x)
    cmd = [exe, "quantize", inp, prefix, "--backend", backend] + (["--2d"] if two_d else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError("%s failed (rc %d):\n%s%s" % (" ".join(cmd), p.returncode, p.stdout,
                                                         p.stderr))
    return [np.load(prefix + s) for s in (".codes.npy", ".scales.npy", ".amax.npy")]


def compare(x, ref, got):
    """Per-case result: counts and the first mismatch of codes and scales."""
    (rc, rs, ra), (gc, gs, ga) = ref, got
    res = {"elements": int(x.size)}
    for name, r, g, want in (("codes", rc, gc, np.uint8), ("scales", rs, gs, np.uint8),
                             ("amax", ra, ga, np.float32)):
        if g.dtype != want or g.shape != r.shape:
            res[name + "_error"] = "fp4sim wrote %s %s, expected %s %s" % (g.dtype, g.shape,
                                                                          np.dtype(want), r.shape)
    if any(k.endswith("_error") for k in res):
        return res, False
    ru, gu = unpack(rc), unpack(gc)
    res["codes_match"] = int(np.count_nonzero(ru == gu))
    res["scales_total"], res["scales_match"] = int(rs.size), int(np.count_nonzero(rs == gs))
    res["amax_match"] = bool(ra.view(np.uint32)[0] == ga.view(np.uint32)[0])
    res["amax"] = "0x%08x fp4sim 0x%08x" % (ra.view(np.uint32)[0], ga.view(np.uint32)[0])
    bad = np.argwhere(ru != gu)
    if bad.size:
        r, c = (int(v) for v in bad[0])
        res["first_code_mismatch"] = {"row": r, "col": c, "x": "0x%08x" % x.view(np.uint32)[r, c],
                                      "x_value": repr(float(x[r, c])), "scale_ref": "0x%02x" % rs[r, c // 16],
                                      "fp4sim": "0x%x" % gu[r, c], "oracle": "0x%x" % ru[r, c]}
    bad = np.argwhere(rs != gs)
    if bad.size:
        r, b = (int(v) for v in bad[0])
        res["first_scale_mismatch"] = {"row": r, "block": b, "fp4sim": "0x%02x" % gs[r, b],
                                       "oracle": "0x%02x" % rs[r, b]}
    ok = res["codes_match"] == x.size and res["scales_match"] == rs.size and res["amax_match"]
    return res, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fp4sim", default="build/fp4sim", help="path to the fp4sim binary")
    ap.add_argument("--backends", default="emu", help="comma-separated: emu, cuda")
    ap.add_argument("--out", default="runs/oracle_torch_quantize", help="directory for the JSON report")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)
    log("oracle: torch %s on %s" % (torch.__version__, dev))
    report = {"torch": torch.__version__, "device": str(dev), "fp4sim": args.fp4sim, "cases": []}
    errs = self_test(dev)
    report["self_test"] = errs or "passed"
    for e in errs:
        log("SELF-TEST FAIL: " + e)
    log("self-test: %s" % ("passed" if not errs else "FAILED"))
    failed = bool(errs)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    log("%-22s %-10s %-5s %-5s %9s %9s %13s %5s" % ("case", "shape", "mode", "backend", "elements",
                                                  "codes ok", "scales ok", "amax"))
    with tempfile.TemporaryDirectory(prefix="oracle_torch_") as tmp:
        for name, x in make_cases(args.seed):
            for two_d in (False, True):
                if two_d and x.shape[0] % 16:
                    continue
                ref_c, ref_s, ref_a, info = oracle_quantize(x, two_d, dev)
                for be in backends:
                    row = {"case": name, "shape": list(x.shape), "mode": "16x16" if two_d else "1x16",
                           "backend": be, **info}
                    try:
                        got = run_fp4sim(args.fp4sim, x, two_d, be, tmp)
                        res, ok = compare(x, (ref_c, ref_s, ref_a), got)
                    except (RuntimeError, OSError, ValueError) as e:
                        res, ok = {"error": str(e)}, False
                    row.update(res)
                    row["ok"] = ok
                    failed |= not ok
                    report["cases"].append(row)
                    shape = "%dx%d" % x.shape
                    if "codes_match" in res:
                        log("%-22s %-10s %-5s %-5s %9d %9d %6d/%-6d %5s%s" % (
                            name, shape, row["mode"], be, x.size, res["codes_match"],
                            res["scales_match"], res["scales_total"],
                            "ok" if res["amax_match"] else "DIFF", "" if ok else "  MISMATCH"))
                        for k in ("first_code_mismatch", "first_scale_mismatch"):
                            if k in res:
                                log("    %s: %s" % (k, json.dumps(res[k])))
                        if not res["amax_match"]:
                            log("    amax oracle %s" % res["amax"])
                    else:
                        log("%-22s %-10s %-5s %-5s ERROR %s" % (name, shape, row["mode"], be,
                                                               json.dumps(res)))
    report["passed"] = not failed
    path = os.path.join(args.out, "oracle_torch_quantize.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
    n_ok = sum(r["ok"] for r in report["cases"])
    log("%d passed, %d failed" % (n_ok, len(report["cases"]) - n_ok))
    log("%s   report: %s" % ("PASS" if not failed else "FAIL", path))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
