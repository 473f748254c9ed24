"""fp4sim from Python: the CLI's bit-exact quantizers, GEMM and MMA on arrays (DESIGN.md §15).

    import numpy as np, fp4sim
    q = fp4sim.quantize(np.random.randn(128, 256).astype(np.float32), format="nvfp4", block_2d=True)
    q["codes"], q["scales"], q["amax"], q["dequant"], q["meta"]
    x = fp4sim.dequantize(q["codes"], q["scales"], q["amax"], format="nvfp4")  # == q["dequant"]
    fp4sim.convert(np.float32([0.3, 7.0]), format="e2m1")  # codes, as `fp4sim convert`

The keyword arguments are the `fp4sim quantize` flags (format, block_2d, columnwise, rht, sr, seed,
stream, four_over_six, error, mx_rule, backend); the results are the bits the CLI writes (tested in
tests/python). Array arguments are numpy arrays or host (CPU) DLPack tensors (PyTorch, JAX),
taken without a copy; a tensor on a GPU is refused (not yet taken). fp4sim.testing loads golden
packs and compares bit for bit. docs/python.md has the API and what is not there yet.
"""
import numpy as _np

from . import _fp4sim
from ._fp4sim import contract_version, info  # noqa: F401

__all__ = ["quantize", "dequantize", "convert", "gemm", "mma", "info", "contract_version"]

_KDLCPU = 1  # DLPack's device type of host memory


def _host(x, fn, name):
    """x as a numpy array: itself, or a host DLPack tensor's memory (no copy). Anything else is
    passed on (the module refuses what is not an array of the right dtype)."""
    if x is None or isinstance(x, _np.ndarray) or not hasattr(x, "__dlpack_device__"):
        return x
    device, index = x.__dlpack_device__()
    if int(device) != _KDLCPU:
        raise ValueError(f"fp4sim.{fn}: {name} is a DLPack tensor on device type {int(device)} "
                         f"(index {index}); only host (CPU) tensors are taken yet: copy it to "
                         "the host first (e.g. tensor.cpu())")
    try:
        return _np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError) as e:  # e.g. bfloat16, which numpy lacks
        raise TypeError(f"fp4sim.{fn}: {name}: numpy cannot view this DLPack tensor ({e}); "
                        "pass bfloat16 as its uint16 bit patterns") from None


def quantize(x, **kwargs):
    return _fp4sim.quantize(_host(x, "quantize", "x"), **kwargs)


def dequantize(codes, scales, amax, **kwargs):
    return _fp4sim.dequantize(_host(codes, "dequantize", "codes"),
                              _host(scales, "dequantize", "scales"),
                              _host(amax, "dequantize", "amax"), **kwargs)


def convert(x, **kwargs):
    return _fp4sim.convert(_host(x, "convert", "x"), **kwargs)


def gemm(a, b, c=None, **kwargs):
    return _fp4sim.gemm(_host(a, "gemm", "a"), _host(b, "gemm", "b"), c=_host(c, "gemm", "c"),
                        **kwargs)


def mma(a, b, sfa, sfb, **kwargs):
    return _fp4sim.mma(_host(a, "mma", "a"), _host(b, "mma", "b"), _host(sfa, "mma", "sfa"),
                       _host(sfb, "mma", "sfb"), **kwargs)


for _f in (quantize, dequantize, convert, gemm, mma):
    _f.__doc__ = getattr(_fp4sim, _f.__name__).__doc__
