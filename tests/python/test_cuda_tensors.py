"""CUDA tensors in fp4sim.quantize, dequantize and gemm (DESIGN.md §15): run on the CUDA backend on
the tensor's memory and current stream, results on the GPU, bitwise the host (emulator) results,
which are the CLI's (test_quantize.py). Skipped without PyTorch or a CUDA GPU."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
import fp4sim  # noqa: E402

if "cuda" not in fp4sim.info()["backends"]:
    pytest.skip("this build has no CUDA backend", allow_module_level=True)


def sample(shape=(128, 256), seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x[0, :16] *= 1e3  # (a block with a large amax, another nearly empty)
    x[1, 16:32] *= 1e-4
    return x


GEMM_OPTIONS = pytest.mark.parametrize("kw", [
    {}, {"alpha": 0.5, "beta": 2.0, "with_c": True}, {"out_dtype": "bf16"}, {"split_k": 2},
    {"format": "mxfp4"}, {"format": "fp8"},
], ids=["nvfp4", "alpha beta c", "bf16 out", "split-k", "mxfp4", "fp8"])


def same_d(d, want, kw):
    """D (a torch tensor; torch.bfloat16 under out_dtype bf16) bit for bit the host's D."""
    if kw.get("out_dtype") == "bf16":
        assert d.dtype == torch.bfloat16
        same_bits(d.view(torch.int16), want.view(np.int16), "d")
    else:
        same_bits(d, want, "d")


def same_bits(got, want, what):
    g = got.cpu().numpy() if hasattr(got, "cpu") else np.asarray(got)
    assert g.dtype == want.dtype and g.shape == want.shape, \
        f"{what}: {g.dtype} {g.shape} != {want.dtype} {want.shape}"
    gv, wv = g.view(np.uint8), want.view(np.uint8)
    assert np.array_equal(gv, wv), f"{what}: {int((gv != wv).sum())} bytes differ"


@pytest.mark.parametrize("kw", [
    {}, {"block_2d": True}, {"sr": True, "seed": 7, "stream": 3}, {"columnwise": True, "rht": True},
    {"four_over_six": True}, {"format": "mxfp4"}, {"format": "fp8"}, {"format": "fp8", "block_2d": True},
], ids=["nvfp4", "2d", "sr", "rht", "4/6", "mxfp4", "fp8", "fp8 2d"])
def test_quantize_cuda_tensor_is_the_host_result(kw):
    x = sample()
    host = fp4sim.quantize(x, backend="emu", **kw)
    xt = torch.from_numpy(x).cuda()
    dev = fp4sim.quantize(xt, **kw)
    for k in ("codes", "scales", "amax", "dequant"):
        assert isinstance(dev[k], torch.Tensor) and dev[k].is_cuda, k
        same_bits(dev[k], host[k], k)
    assert dev["meta"]["backend"] == "cuda"
    back = fp4sim.dequantize(dev["codes"], dev["scales"], dev["amax"],
                             format=kw.get("format", "nvfp4"),
                             four_over_six=kw.get("four_over_six", False))
    same_bits(back, host["dequant"], "dequantize")


@pytest.mark.parametrize("kw", [
    {}, {"sr": True, "seed": 7, "stream": 3}, {"columnwise": True, "rht": True},
    {"four_over_six": True}, {"format": "mxfp4"}, {"format": "fp8", "block_2d": True},
], ids=["nvfp4", "sr", "rht", "4/6", "mxfp4", "fp8 2d"])
def test_quantizer_gives_the_bits_of_quantize(kw):
    x = sample()
    host = fp4sim.quantize(x, backend="emu", **kw)
    xt = torch.from_numpy(x).cuda()
    qz = fp4sim.Quantizer(xt, **kw)
    qz(torch.zeros_like(xt) + 3.0)  # (another input first: its outputs must be overwritten)
    out = qz(xt)
    torch.cuda.synchronize()
    for k, got in zip(("codes", "scales", "amax", "dequant"), out):
        assert isinstance(got, torch.Tensor) and got.is_cuda, k
        same_bits(got, host[k], k)


def test_quantizer_sr_stream_per_call_and_errors():
    x = sample()
    xt = torch.from_numpy(x).cuda()
    qz = fp4sim.Quantizer(xt, sr=True, seed=5)
    for stream in (0, 9):
        codes = qz(xt, stream=stream)[0].clone()
        same_bits(codes, fp4sim.quantize(x, backend="emu", sr=True, seed=5, stream=stream)["codes"],
                  f"codes of SR stream {stream}")
    with pytest.raises(ValueError, match=r"made for \[128, 256\]"):
        qz(torch.zeros((64, 256), device="cuda"))
    with pytest.raises(TypeError, match="dtype"):
        qz(torch.zeros((128, 256), device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match="stream applies to sr=True only"):
        fp4sim.Quantizer(xt)(xt, stream=3)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with pytest.raises(ValueError, match="make a Quantizer for each stream"):
            qz(xt)
        on_s = fp4sim.Quantizer(xt, sr=True, seed=5)  # (made on s: runs there)
        codes = on_s(xt, stream=9)[0].clone()
    torch.cuda.synchronize()
    same_bits(codes, fp4sim.quantize(x, backend="emu", sr=True, seed=5, stream=9)["codes"],
              "codes of a Quantizer made and called on a side stream")


def test_quantize_runs_on_the_current_stream():
    x = torch.from_numpy(sample()).cuda()
    want = fp4sim.quantize(x.cpu().numpy(), backend="emu")["codes"]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = x * 1.0  # (queued on s; fp4sim must read it after)
        got = fp4sim.quantize(y)["codes"]
        z = got.clone()
    torch.cuda.synchronize()
    same_bits(z, want, "codes on a side stream")


@GEMM_OPTIONS
def test_gemm_cuda_tensors_are_the_host_result(kw):
    kw = dict(kw)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal((96, 256)).astype(np.float32)
    c = rng.standard_normal((64, 96)).astype(np.float32) if kw.pop("with_c", False) else None
    host = fp4sim.gemm(a, b, c=c, backend="emu", **kw)
    dev = fp4sim.gemm(torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda(),
                      c=None if c is None else torch.from_numpy(c).cuda(), **kw)
    assert dev["d"].is_cuda
    same_d(dev["d"], host["d"], kw)
    if kw.get("format", "nvfp4") == "nvfp4":  # (cuBLASLt: its distance to the exact GEMM)
        cl = fp4sim.gemm(torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda(), gemm="cublaslt",
                         c=None if c is None else torch.from_numpy(c).cuda(),
                         **{k: v for k, v in kw.items() if k != "split_k"})
        assert cl["d"].is_cuda and cl["cublaslt_vs_exact"] >= 0


@GEMM_OPTIONS
def test_gemm_object_gives_the_bits_of_gemm(kw):
    kw = dict(kw)
    rng = np.random.default_rng(4)
    a = rng.standard_normal((128, 256)).astype(np.float32)
    b = rng.standard_normal((128, 256)).astype(np.float32)
    c = rng.standard_normal((128, 128)).astype(np.float32) if kw.pop("with_c", False) else None
    host = fp4sim.gemm(a, b, c=c, backend="emu", **kw)["d"]
    at, bt = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
    ct = None if c is None else torch.from_numpy(c).cuda()
    g = fp4sim.Gemm(at, bt, c=ct, **kw)
    g(bt, at, ct)  # (another call first: its D is overwritten)
    d = g(at, bt, ct)
    torch.cuda.synchronize()
    same_d(d, host, kw)


def test_gemm_object_refuses_other_shapes():
    a = torch.zeros((64, 128), device="cuda")
    g = fp4sim.Gemm(a, a)
    with pytest.raises(ValueError, match=r"made for \[64, 128\] and \[64, 128\]"):
        g(torch.zeros((32, 128), device="cuda"), a)
    with pytest.raises(ValueError, match="made without c"):
        g(a, a, torch.zeros((64, 64), device="cuda"))
    with pytest.raises(ValueError, match="fp4sim.Gemm: .*beta"):  # (checked when made)
        fp4sim.Gemm(a, a, beta=1.0)
    with pytest.raises(ValueError, match="cuda backend"):
        fp4sim.Gemm(a, a, backend="emu")


def test_cuda_errors_name_the_argument():
    x = torch.ones(16, 30, device="cuda")
    with pytest.raises(ValueError, match="x"):
        fp4sim.quantize(x)
    with pytest.raises(TypeError, match="float32"):
        fp4sim.quantize(torch.ones(16, 32, device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match="K differs"):
        fp4sim.gemm(torch.ones(16, 32, device="cuda"), torch.ones(16, 64, device="cuda"))
    with pytest.raises(ValueError, match="cuda backend"):
        fp4sim.quantize(torch.ones(16, 32, device="cuda"), backend="emu")


def test_jax_cuda_arrays():
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("JAX sees no GPU")
    import jax.numpy as jnp
    x = sample((64, 128), seed=2)
    host = fp4sim.quantize(x, backend="emu", block_2d=True)
    dev = fp4sim.quantize(jax.device_put(jnp.asarray(x), gpus[0]), block_2d=True)
    for k in ("codes", "scales", "amax", "dequant"):
        assert isinstance(dev[k], jax.Array), k
        same_bits(np.asarray(dev[k]), host[k], "jax " + k)


def test_other_producers_get_device_arrays():
    cupy = pytest.importorskip("cupy")
    x = sample((64, 128), seed=4)
    host = fp4sim.quantize(x, backend="emu", four_over_six=True)
    dev = fp4sim.quantize(cupy.asarray(x), four_over_six=True)
    for k in ("codes", "scales", "amax", "dequant"):
        assert isinstance(dev[k], fp4sim._fp4sim.DeviceArray), k
        same_bits(cupy.asnumpy(cupy.from_dlpack(dev[k])), host[k], "cupy " + k)
        same_bits(dev[k].numpy(), host[k], "numpy() " + k)
    d = fp4sim.gemm(cupy.asarray(x), cupy.asarray(x), out_dtype="bf16")["d"]
    assert d.dtype == "bfloat16" and d.shape == (64, 64)
    same_bits(d.numpy(), fp4sim.gemm(x, x, backend="emu", out_dtype="bf16")["d"], "cupy gemm")


def test_torch_linear_with_cublaslt_gemms_is_near_the_exact_one():
    import fp4sim.torch as ft
    torch.manual_seed(0)
    outs = {}
    for gemm in ("exact", "cublaslt"):
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.h = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(256, 512)) for _ in range(2)])
        m = m.cuda()
        ft.replace_linears(m, {"name": "nvfp4", "gemm": gemm, "hp_first": 0, "hp_last": 0})
        x = torch.randn(128, 256, device="cuda", requires_grad=True)
        y = m.h[0](x)
        y.backward(torch.randn(128, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(1)))
        outs[gemm] = (y.detach(), x.grad, m.h[0][0].weight.grad)
    for name, a, b in zip(("y", "dx", "dweight"), outs["exact"], outs["cublaslt"]):
        rel = float((a - b).norm() / a.norm())
        print(f"fp4sim.torch nvfp4 cuBLASLt vs exact {name}: rel. difference {rel:.2e} (bound 1e-3)")
        assert rel <= 1e-3, name
