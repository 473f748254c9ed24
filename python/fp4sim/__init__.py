"""fp4sim from Python: the CLI's bit-exact quantizers on numpy arrays (DESIGN.md §15).

    import numpy as np, fp4sim
    q = fp4sim.quantize(np.random.randn(128, 256).astype(np.float32), format="nvfp4", block_2d=True)
    q["codes"], q["scales"], q["amax"], q["dequant"], q["meta"]
    x = fp4sim.dequantize(q["codes"], q["scales"], q["amax"], format="nvfp4")  # == q["dequant"]
    fp4sim.convert(np.float32([0.3, 7.0]), format="e2m1")  # codes, as `fp4sim convert`

The keyword arguments are the `fp4sim quantize` flags (format, block_2d, columnwise, rht, sr, seed,
stream, four_over_six, error, mx_rule, backend); the results are the bits the CLI writes (tested in
tests/python). fp4sim.testing loads golden packs and compares bit for bit. docs/python.md has the
API and what is not there yet.
"""
from ._fp4sim import contract_version, convert, dequantize, gemm, info, mma, quantize  # noqa: F401

__all__ = ["quantize", "dequantize", "convert", "gemm", "mma", "info", "contract_version"]
