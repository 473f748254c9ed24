#!/usr/bin/env python3
"""Issue 38's speed bar: what fp4sim.quantize and fp4sim.gemm cost from Python over the C++ work
behind them (the module's _cpp_seconds: the same functions on a backend made once, no Python
objects), for tensors of >= 1M elements, in one process.

usage: PYTHONPATH=build/python /usr/bin/python3 validation/bench_python.py [--backend emu|cuda]
       [--tensors numpy|torch-cuda] [--rounds R] [--repeats N]
--tensors torch-cuda (needs PyTorch and a GPU) passes torch CUDA tensors, which run on the CUDA
backend without a host copy; each timed Python call ends with torch.cuda.synchronize() and the C++
side (_cpp_seconds_device: the same quantize, dequantize and amax read, or both operands'
quantization and the exact GEMM, on device memory) with the stream's synchronization.
The "Quantizer" and "Gemm" rows (torch-cuda) time fp4sim.Quantizer and fp4sim.Gemm, the
repeated-call interfaces: N calls
enqueued back to back and one synchronization on each side (_cpp_seconds_device's
"quantize_stream": outputs made once, the same quantize + dequantize; "gemm_stream": both
operands' copies and D made once, two quantizations and the exact GEMM), the mean a call.
Each round times N calls of each side (median, or the mean of the back-to-back calls), the sides
alternating; the table gives each side's median over R rounds and the median of the rounds'
ratios (Python / C++).
"""
import argparse
import statistics
import time

import numpy as np

import fp4sim
from fp4sim import _fp4sim


def median_seconds(fn, repeats):
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return statistics.median(t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="emu")
    ap.add_argument("--tensors", choices=["numpy", "torch-cuda"], default="numpy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = [
        ("quantize nvfp4 1024x1024", "quantize", (1024, 1024)),
        ("quantize nvfp4 4096x1024", "quantize", (4096, 1024)),
        ("gemm nvfp4 exact 1024x1024x1024", "gemm", (1024, 1024)),
    ]
    cuda = a.tensors == "torch-cuda"
    stream_calls = 20 * a.repeats  # (back-to-back calls a Quantizer round)
    if cuda:  # (the GPU's calls take microseconds at 1M elements: larger tensors too)
        import torch
        a.backend = "cuda"
        cases[2:2] = [("quantize nvfp4 4096x4096", "quantize", (4096, 4096)),
                      ("quantize nvfp4 8192x8192", "quantize", (8192, 8192))]
        cases.append(("gemm nvfp4 exact 4096x4096x4096", "gemm", (4096, 4096)))
        cases += [(f"Quantizer nvfp4 {r}x{c}", "quantize_stream", (r, c))
                  for r, c in ((1024, 1024), (4096, 1024), (4096, 4096), (8192, 8192))]
        cases += [(f"Gemm nvfp4 exact {n}x{n}x{n}", "gemm_stream", (n, n)) for n in (1024, 4096)]
    print(f"fp4sim from Python against the C++ call, backend {a.backend}, {a.tensors} tensors, "
          f"{a.rounds} rounds x {a.repeats} calls")
    print(f"{'case':<34} {'python ms':>10} {'c++ ms':>10} {'python / c++':>13}")
    for name, op, shape in cases:
        x = rng.standard_normal(shape).astype(np.float32)
        if cuda:
            xt = torch.from_numpy(x).cuda()

            if op == "quantize_stream":
                qz = fp4sim.Quantizer(xt)
            if op == "gemm_stream":
                gm = fp4sim.Gemm(xt, xt)
                qz = lambda x: gm(x, x)  # noqa: E731
            if op.endswith("_stream"):
                def py_stream():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(stream_calls):
                        qz(xt)
                    torch.cuda.synchronize()
                    return (time.perf_counter() - t0) / stream_calls

            def py(op=op):
                if op.endswith("_stream"):
                    qz(xt)
                elif op == "quantize":
                    fp4sim.quantize(xt)
                else:
                    fp4sim.gemm(xt, xt)
                torch.cuda.synchronize()

            def cpp(op=op):
                return _fp4sim._cpp_seconds_device(
                    op, torch.utils.dlpack.to_dlpack(xt),
                    stream_calls if op.endswith("_stream") else a.repeats,
                    torch.cuda.current_stream().cuda_stream)
        elif op == "quantize":
            def py():
                fp4sim.quantize(x, backend=a.backend)
        else:
            def py():
                fp4sim.gemm(x, x, backend=a.backend)
        py()  # (warm-up: plans, allocations)
        pys, cpps, ratios = [], [], []
        for _ in range(a.rounds):
            p = py_stream() if op.endswith("_stream") else median_seconds(py, a.repeats)
            c = cpp() if cuda else _fp4sim._cpp_seconds(op, x, a.repeats, backend=a.backend)
            pys.append(p)
            cpps.append(c)
            ratios.append(p / c)
        print(f"{name:<34} {1e3 * statistics.median(pys):>10.2f} {1e3 * statistics.median(cpps):>10.2f} "
              f"{statistics.median(ratios):>12.3f}x   (rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
