"""fp4sim from Python: the CLI's bit-exact quantizers, GEMM and MMA on arrays (DESIGN.md §15).

    import numpy as np, fp4sim
    q = fp4sim.quantize(np.random.randn(128, 256).astype(np.float32), format="nvfp4", block_2d=True)
    q["codes"], q["scales"], q["amax"], q["dequant"], q["meta"]
    x = fp4sim.dequantize(q["codes"], q["scales"], q["amax"], format="nvfp4")  # == q["dequant"]
    fp4sim.convert(np.float32([0.3, 7.0]), format="e2m1")  # codes, as `fp4sim convert`

The keyword arguments are the `fp4sim quantize` flags (format, block_2d, columnwise, rht, sr, seed,
stream, four_over_six, error, mx_rule, backend); the results are the bits the CLI writes (tested in
tests/python). Array arguments are numpy arrays or DLPack tensors (PyTorch, JAX), taken without
a copy: host tensors run as numpy arrays, CUDA tensors of quantize, dequantize and gemm on the
CUDA backend (on a torch tensor's current stream), their results on the GPU as the input's
framework's tensors. fp4sim.torch replaces PyTorch linear layers; fp4sim.testing loads golden
packs and compares bit for bit. docs/python.md has the API.
"""
import numpy as _np

from . import _fp4sim
from ._fp4sim import contract_version, info  # noqa: F401

__all__ = ["quantize", "Quantizer", "Gemm", "dequantize", "convert", "gemm", "mma", "info", "contract_version"]

_KDLCPU = 1  # DLPack's device types: host memory, a CUDA GPU
_KDLCUDA = 2


def _device_type(x):
    if x is None or isinstance(x, _np.ndarray) or not hasattr(x, "__dlpack_device__"):
        return _KDLCPU
    return int(x.__dlpack_device__()[0])


def _host(x, fn, name):
    """x as a numpy array: itself, or a host DLPack tensor's memory (no copy). Anything else is
    passed on (the module refuses what is not an array of the right dtype)."""
    if _device_type(x) == _KDLCPU and x is not None and not isinstance(x, _np.ndarray) \
            and hasattr(x, "__dlpack_device__"):
        try:
            return _np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as e:  # e.g. bfloat16, which numpy lacks
            raise TypeError(f"fp4sim.{fn}: {name}: numpy cannot view this DLPack tensor ({e}); "
                            "pass bfloat16 as its uint16 bit patterns") from None
    if _device_type(x) != _KDLCPU:
        device, index = x.__dlpack_device__()
        raise ValueError(f"fp4sim.{fn}: {name} is a DLPack tensor on device type {int(device)} "
                         f"(index {index}); {fn} takes it on the host here (e.g. tensor.cpu()); "
                         "CUDA tensors are taken by quantize, dequantize and gemm (float "
                         "operands)")
    return x


def _cuda_args(fn, named):
    """Whether the call runs on CUDA tensors (all of `named` on a GPU; a mix is refused), and
    the (capsule-or-tensor, stream) plumbing: a torch tensor's current stream, else the legacy
    default stream (DLPack's stream 1; the producer orders its work before it)."""
    kinds = {n: _device_type(x) for n, x in named.items() if x is not None}
    on_gpu = [n for n, k in kinds.items() if k == _KDLCUDA]
    if not on_gpu:
        return False
    if len(on_gpu) != len(kinds):
        host = [n for n in kinds if n not in on_gpu]
        raise ValueError(f"fp4sim.{fn}: {', '.join(on_gpu)} on a CUDA GPU and {', '.join(host)} "
                         "on the host: pass all on one device")
    return True


def _prepare_cuda(x):
    """(DLPack capsule, cudaStream_t as int) for a CUDA tensor: torch tensors on their current
    stream (no synchronization needed), other producers exported for the legacy default stream."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        import torch
        s = torch.cuda.current_stream(x.device).cuda_stream
        return torch.utils.dlpack.to_dlpack(x.detach()), s
    return x.__dlpack__(stream=1), 0


def _wrap(result, like):
    """DeviceArrays as the input's framework's tensors (torch or JAX, no copy), else as they are."""
    mod = type(like).__module__.split(".")[0]
    if mod == "torch":
        import torch
        conv = torch.utils.dlpack.from_dlpack
    elif mod in ("jax", "jaxlib"):
        import jax.dlpack
        conv = jax.dlpack.from_dlpack
    else:
        return result
    if isinstance(result, dict):
        return {k: conv(v) if isinstance(v, _fp4sim.DeviceArray) else v for k, v in result.items()}
    return conv(result)


_BLOCK = {"nvfp4": 16, "mxfp4": 32, "fp8": 128}


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _torch_outputs(x, shapes):
    """torch tensors of (shape, torch dtype name) on x's device (torch's caching allocator, no
    DLPack export afterwards), and their capsules for the C++ call."""
    import torch
    ts = [torch.empty(shape, dtype=getattr(torch, dt), device=x.device) for shape, dt in shapes]
    return ts, tuple(torch.utils.dlpack.to_dlpack(t) for t in ts)


def _quantize_cuda_args(x, kwargs):
    """(capsule, stream, kwargs for the C++ call, torch outputs or None) for quantize on CUDA."""
    if kwargs.pop("backend", "cuda") not in (None, "cuda"):
        raise ValueError("fp4sim.quantize: x is a CUDA tensor: it runs on the cuda backend")
    cap, s = _prepare_cuda(x)
    if "stream" in kwargs:  # (the SR stream; `stream` of the C++ call is the CUDA stream)
        kwargs["sr_stream"] = kwargs.pop("stream")
    fmt = kwargs.get("format", "nvfp4")
    if not (_is_torch(x) and x.dim() == 2 and fmt in _BLOCK):
        return cap, s, kwargs, None
    # the outputs from torch's allocator (the C++ call checks their shapes)
    r, c = x.shape[::-1] if kwargs.get("columnwise") else x.shape
    fp8 = fmt == "fp8"
    return cap, s, kwargs, _torch_outputs(x, [((r, c if fp8 else c // 2), "uint8"),
                                              ((r, c // _BLOCK[fmt]), "float32" if fp8 else "uint8"),
                                              ((1,), "float32"), ((r, c), "float32")])


def quantize(x, **kwargs):
    if _cuda_args("quantize", {"x": x}):
        cap, s, kwargs, outs = _quantize_cuda_args(x, kwargs)
        if outs is None:
            return _wrap(_fp4sim._quantize_device(cap, s, **kwargs), x)
        out = _fp4sim._quantize_device(cap, s, outs=outs[1], **kwargs)
        out.update(zip(("codes", "scales", "amax", "dequant"), outs[0]))
        return out
    return _fp4sim.quantize(_host(x, "quantize", "x"), **kwargs)


def _refuse_jax(x, name):
    if type(x).__module__.split(".")[0] in ("jax", "jaxlib"):
        raise TypeError(f"fp4sim.{name}: JAX arrays are immutable, and {name} overwrites its "
                        f"outputs on every call: use fp4sim.{name.lower()} with JAX")


class Quantizer:
    """fp4sim.quantize for repeated calls on CUDA tensors of one shape and dtype (a training
    loop's): the options are checked once and the outputs made once; each call enqueues the
    quantization and dequantization on the tensor's current stream and returns at once (no
    synchronization, no allocation, no meta), the bits fp4sim.quantize gives.

        qz = fp4sim.Quantizer(x, format="nvfp4", sr=True)   # x: a CUDA tensor (shape, dtype)
        codes, scales, amax, dequant = qz(x)                # overwritten by the next call
        qz(x, stream=7)                                     # this call's SR stream

    The keyword arguments are fp4sim.quantize's; the outputs are torch tensors for torch input,
    else DeviceArrays (CuPy takes them through __dlpack__); JAX arrays are refused (immutable).
    Every call runs on the stream the quantizer was made on (another is refused: the outputs
    belong to it).
    """

    def __init__(self, like, **kwargs):
        if not _cuda_args("Quantizer", {"like": like}):
            raise ValueError("fp4sim.Quantizer: like: not a CUDA tensor (host arrays: "
                             "fp4sim.quantize)")
        _refuse_jax(like, "Quantizer")
        cap, s, kwargs, outs = _quantize_cuda_args(like, kwargs)
        self._torch = _is_torch(like)
        if outs is None:  # (other producers: DeviceArrays, which they take through __dlpack__)
            self._impl = _fp4sim._CudaQuantizer(cap, s, **kwargs)
            self.outputs = tuple(self._impl.outputs())
        else:
            self._impl = _fp4sim._CudaQuantizer(cap, s, outs=outs[1], **kwargs)
            self.outputs = tuple(outs[0])

    def __call__(self, x, stream=None):
        if self._torch:
            import torch
            self._impl(torch.utils.dlpack.to_dlpack(x.detach()),
                       torch.cuda.current_stream(x.device).cuda_stream, stream)
        else:
            cap, s = _prepare_cuda(x)
            self._impl(cap, s, stream)
        return self.outputs


def dequantize(codes, scales, amax, **kwargs):
    if _cuda_args("dequantize", {"codes": codes, "scales": scales, "amax": amax}):
        if kwargs.pop("backend", "cuda") not in (None, "cuda"):
            raise ValueError("fp4sim.dequantize: CUDA tensors run on the cuda backend")
        caps = [_prepare_cuda(t) for t in (codes, scales, amax)]
        if _is_torch(codes) and codes.dim() == 2:
            fmt = kwargs.get("format", "nvfp4")
            cols = codes.shape[1] * (1 if fmt == "fp8" else 2)
            ts, outs = _torch_outputs(codes, [((codes.shape[0], cols), "float32")])
            _fp4sim._dequantize_device(caps[0][0], caps[1][0], caps[2][0], caps[0][1],
                                       out=outs[0], **kwargs)
            return ts[0]
        return _wrap(_fp4sim._dequantize_device(caps[0][0], caps[1][0], caps[2][0], caps[0][1],
                                                **kwargs), codes)
    return _fp4sim.dequantize(_host(codes, "dequantize", "codes"),
                              _host(scales, "dequantize", "scales"),
                              _host(amax, "dequantize", "amax"), **kwargs)


def convert(x, **kwargs):
    return _fp4sim.convert(_host(x, "convert", "x"), **kwargs)


def gemm(a, b, c=None, **kwargs):
    if not isinstance(a, dict) and _cuda_args("gemm", {"a": a, "b": b, "c": c}):
        if kwargs.pop("backend", "cuda") not in (None, "cuda"):
            raise ValueError("fp4sim.gemm: CUDA tensors run on the cuda backend")
        ca, s = _prepare_cuda(a)
        cb, _ = _prepare_cuda(b)
        cc = None if c is None else _prepare_cuda(c)[0]
        if _is_torch(a) and a.dim() == 2 and b.dim() == 2:
            dt = "bfloat16" if kwargs.get("out_dtype") == "bf16" else "float32"
            ts, outs = _torch_outputs(a, [((a.shape[0], b.shape[0]), dt)])
            out = _fp4sim._gemm_device(ca, cb, cc, s, out=outs[0], **kwargs)
            out["d"] = ts[0]
            return out
        return _wrap(_fp4sim._gemm_device(ca, cb, cc, s, **kwargs), a)
    return _fp4sim.gemm(_host(a, "gemm", "a"), _host(b, "gemm", "b"), c=_host(c, "gemm", "c"),
                        **kwargs)


class Gemm:
    """fp4sim.gemm for repeated calls on CUDA tensors of fixed shapes: the options checked once,
    the operands' quantized copies and D made once; each call quantizes a and b and enqueues the
    GEMM on a's current stream, returning at once (no synchronization, no allocation, and none of
    gemm's warnings, which need the amaxes on the host), the bits fp4sim.gemm gives.

        g = fp4sim.Gemm(a, b, format="nvfp4")   # a [M, K], b [N, K] CUDA tensors; c=c for beta
        d = g(a, b)                              # D = alpha * a b^T (+ beta c), overwritten by the next call

    The keyword arguments are fp4sim.gemm's (format, gemm, out_dtype, alpha, beta, split_k),
    checked once with the GEMM's own checks. D is a torch tensor for torch input, else a
    DeviceArray; JAX arrays are refused (immutable). Every call runs on the stream the Gemm was
    made on (another is refused).
    """

    def __init__(self, a, b, c=None, **kwargs):
        if not _cuda_args("Gemm", {"a": a, "b": b, "c": c}):
            raise ValueError("fp4sim.Gemm: a and b: not CUDA tensors (host arrays: fp4sim.gemm)")
        if kwargs.pop("backend", "cuda") not in (None, "cuda"):
            raise ValueError("fp4sim.Gemm: CUDA tensors run on the cuda backend")
        _refuse_jax(a, "Gemm")
        ca, s = _prepare_cuda(a)
        cb, _ = _prepare_cuda(b)
        cc = None if c is None else _prepare_cuda(c)[0]
        self._torch = _is_torch(a)
        if self._torch and a.dim() == 2 and b.dim() == 2:
            dt = "bfloat16" if kwargs.get("out_dtype") == "bf16" else "float32"
            ts, outs = _torch_outputs(a, [((a.shape[0], b.shape[0]), dt)])
            self._impl = _fp4sim._CudaGemm(ca, cb, cc, s, out=outs[0], **kwargs)
            self.d = ts[0]
        else:  # (other producers: a DeviceArray)
            self._impl = _fp4sim._CudaGemm(ca, cb, cc, s, **kwargs)
            self.d = self._impl.output()

    def __call__(self, a, b, c=None):
        if self._torch:
            import torch
            dl = torch.utils.dlpack.to_dlpack
            self._impl(dl(a.detach()), dl(b.detach()), None if c is None else dl(c.detach()),
                       torch.cuda.current_stream(a.device).cuda_stream)
        else:
            ca, s = _prepare_cuda(a)
            self._impl(ca, _prepare_cuda(b)[0], None if c is None else _prepare_cuda(c)[0], s)
        return self.d


def mma(a, b, sfa, sfb, **kwargs):
    return _fp4sim.mma(_host(a, "mma", "a"), _host(b, "mma", "b"), _host(sfa, "mma", "sfa"),
                       _host(sfb, "mma", "sfb"), **kwargs)


for _f in (quantize, dequantize, convert, gemm, mma):
    _f.__doc__ = getattr(_fp4sim, _f.__name__).__doc__
