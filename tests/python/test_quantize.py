"""fp4sim.quantize, dequantize and convert against the CLI: the same bits for every option, and clear errors.

Run by ctest (python.quantize) with PYTHONPATH at the build's python/ folder and FP4SIM_CLI the
CLI binary; on the emulator backend (the CLI's default would pick CUDA on a GPU machine).
"""
import os
import subprocess

import numpy as np
import pytest

import fp4sim

CLI = os.environ.get("FP4SIM_CLI", "build/fp4sim")

# (name, CLI flags, keyword arguments, input dtype)
CASES = [
    ("nvfp4 1x16 RN", [], {}, "f32"),
    ("nvfp4 16x16", ["--2d"], {"block_2d": True}, "f32"),
    ("nvfp4 bf16 input", [], {}, "bf16"),
    ("nvfp4 column-wise RHT", ["--columnwise", "--rht"], {"columnwise": True, "rht": True}, "f32"),
    ("nvfp4 SR", ["--sr", "--seed", "7", "--stream", "3"], {"sr": True, "seed": 7, "stream": 3}, "f32"),
    ("nvfp4 SR column-wise RHT", ["--sr", "--seed", "11", "--columnwise", "--rht"],
     {"sr": True, "seed": 11, "columnwise": True, "rht": True}, "f32"),
    ("nvfp4 4/6 mae", ["--four-over-six"], {"four_over_six": True}, "f32"),
    ("nvfp4 4/6 mse 16x16", ["--four-over-six", "--error", "mse", "--2d"],
     {"four_over_six": True, "error": "mse", "block_2d": True}, "f32"),
    ("mxfp4 floor", ["--format", "mxfp4"], {"format": "mxfp4"}, "f32"),
    ("mxfp4 ceil", ["--format", "mxfp4", "--mx-rule", "ceil"], {"format": "mxfp4", "mx_rule": "ceil"}, "f32"),
    ("fp8 1x128", ["--format", "fp8"], {"format": "fp8"}, "f32"),
    ("fp8 128x128 column-wise", ["--format", "fp8", "--2d", "--columnwise"],
     {"format": "fp8", "block_2d": True, "columnwise": True}, "f32"),
]


def sample(dtype, rows=128, cols=256, seed=5):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * np.exp(rng.standard_normal((rows, cols)))).astype(np.float32)
    x[3, 17] = 0.0
    x[7, :16] = 1e-30  # a block that underflows
    x[9, 40] = 300.0  # an outlier
    if dtype == "bf16":  # round to nearest even, kept as bit patterns
        b = x.view(np.uint32)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return x


def run_cli(x, flags, tmp_path):
    np.save(tmp_path / "x.npy", x)
    prefix = tmp_path / "q"
    subprocess.run([CLI, "quantize", str(tmp_path / "x.npy"), str(prefix), "--backend", "emu", *flags],
                   check=True, capture_output=True)
    out = {k: np.load(f"{prefix}.{k}.npy") for k in ("codes", "scales", "amax", "dequant")}
    import json
    with open(f"{prefix}.meta.json") as f:
        out["meta"] = json.load(f)
    return out


@pytest.mark.parametrize("name,flags,kwargs,dtype", CASES, ids=[c[0] for c in CASES])
def test_bitwise_equal_to_the_cli(name, flags, kwargs, dtype, tmp_path):
    x = sample(dtype)
    cli = run_cli(x, flags, tmp_path)
    py = fp4sim.quantize(x, backend="emu", **kwargs)
    for k in ("codes", "scales", "amax", "dequant"):
        assert py[k].dtype == cli[k].dtype, (name, k)
        assert py[k].shape == cli[k].shape, (name, k)
        assert py[k].tobytes() == cli[k].tobytes(), f"{name}: {k} differs from the CLI's"
    for meta in (cli["meta"], py["meta"]):
        meta.pop("input", None)
        meta.pop("generator")
    assert py["meta"] == cli["meta"]


def test_info():
    i = fp4sim.info()
    assert i["contract_version"] == fp4sim.contract_version == 2
    assert "emu" in i["backends"]


@pytest.mark.parametrize("x,exc,words", [
    (np.zeros((16, 32), np.float64), TypeError, "x: dtype float64"),
    (np.zeros(32, np.float32), ValueError, "2-D"),
    (np.zeros((32, 16), np.float32).T, ValueError, "C-contiguous"),
    (np.zeros((16, 24), np.float32), ValueError, "24"),
])
def test_bad_arrays_are_named(x, exc, words):
    with pytest.raises(exc, match=words):
        fp4sim.quantize(x, backend="emu")


@pytest.mark.parametrize("kwargs,words", [
    ({"format": "nvfp8"}, "format 'nvfp8'"),
    ({"rht": True}, "column-wise"),
    ({"seed": 3}, "sr=True"),
    ({"mx_rule": "ceil"}, "mxfp4"),
    ({"error": "mse"}, "four_over_six"),
    ({"backend": "tpu"}, "tpu"),
])
def test_bad_options_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        fp4sim.quantize(np.zeros((16, 32), np.float32), **kwargs)


@pytest.mark.parametrize("name,flags,kwargs,dtype", CASES, ids=[c[0] for c in CASES])
def test_dequantize_gives_the_cli_dequant(name, flags, kwargs, dtype, tmp_path):
    x = sample(dtype)
    cli = run_cli(x, flags, tmp_path)
    fmt = kwargs.get("format", "nvfp4")
    got = fp4sim.dequantize(cli["codes"], cli["scales"], cli["amax"], format=fmt,
                            four_over_six=kwargs.get("four_over_six", False), backend="emu")
    assert got.dtype == np.float32 and got.shape == cli["dequant"].shape
    assert got.tobytes() == cli["dequant"].tobytes(), f"{name}: dequantize differs from the CLI's"


def test_dequantize_bad_input_is_named():
    q = fp4sim.quantize(np.ones((16, 32), np.float32), backend="emu")
    with pytest.raises(ValueError, match="scales: shape"):
        fp4sim.dequantize(q["codes"], np.ascontiguousarray(q["scales"][:, :1]), q["amax"], backend="emu")
    with pytest.raises(TypeError, match="amax: dtype float64"):
        fp4sim.dequantize(q["codes"], q["scales"], q["amax"].astype(np.float64), backend="emu")
    with pytest.raises(ValueError, match="format 'nvfp8'"):
        fp4sim.dequantize(q["codes"], q["scales"], q["amax"], format="nvfp8", backend="emu")


CONVERT = ["e2m1", "e4m3", "e5m2", "bf16", "ue8m0_rz", "ue8m0_rp"]


@pytest.mark.parametrize("fmt", CONVERT)
def test_convert_is_the_cli_convert(fmt, tmp_path):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(4099) * np.exp(3 * rng.standard_normal(4099))).astype(np.float32)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40]
    np.save(tmp_path / "x.npy", x)
    subprocess.run([CLI, "convert", str(tmp_path / "x.npy"), str(tmp_path / "c.npy"), "--format", fmt],
                   check=True, capture_output=True)
    codes = fp4sim.convert(x, format=fmt)
    cli = np.load(tmp_path / "c.npy")
    assert codes.dtype == cli.dtype and codes.tobytes() == cli.tobytes(), fmt
    dec = "ue8m0" if fmt.startswith("ue8m0") else fmt
    subprocess.run([CLI, "convert", str(tmp_path / "c.npy"), str(tmp_path / "d.npy"), "--format", dec,
                    "--decode"], check=True, capture_output=True)
    back = fp4sim.convert(codes, format=dec, decode=True)
    assert back.tobytes() == np.load(tmp_path / "d.npy").tobytes(), fmt


def test_convert_bad_input_is_named():
    with pytest.raises(TypeError, match="x: dtype float64"):
        fp4sim.convert(np.zeros(4), format="e4m3")
    with pytest.raises(ValueError, match="cannot encode"):
        fp4sim.convert(np.zeros(4, np.float32), format="ue8m0")
    with pytest.raises(ValueError, match="E2M1 code 16 > 15"):
        fp4sim.convert(np.uint8([1, 16]), format="e2m1", decode=True)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MMA_CASES = [  # (scale kind, sfa bytes, sfb bytes, c)
    ("ue8m0-16", [127, 127, 127, 127], [127, 128, 126, 127], "0"),
    ("ue4m3", [0x38, 0x40, 0x30, 0x7E], [0x38, 0x01, 0x00, 0x44], "1.5"),
    ("ue8m0-32", [130, 120], [127, 140], "-2"),
    ("ue4m3", [0x7F, 0x38, 0x38, 0x38], [0x38, 0x38, 0x38, 0x38], "0"),  # a NaN scale
    ("ue8m0-16", [127, 127, 127, 127], [127, 127, 127, 127], "inf"),
    ("ue8m0-16", [254, 254, 254, 254], [254, 254, 254, 254], "1e-40"),  # saturating scales
]


@pytest.mark.parametrize("kind,sfa,sfb,c", MMA_CASES, ids=[f"{k} {c}" for k, _, _, c in MMA_CASES])
def test_mma_is_the_cli_mma(kind, sfa, sfb, c):
    rng = np.random.default_rng(len(sfa) + int(sfa[0]))
    a = (rng.choice(E2M1, 64) * rng.choice([-1.0, 1.0], 64)).astype(np.float32)
    b = (rng.choice(E2M1, 64) * rng.choice([-1.0, 1.0], 64)).astype(np.float32)
    if c == "0":
        b[:16] = -a[:16]  # cancellation in a group
    out = subprocess.run([CLI, "mma", "--a", ",".join(repr(float(x)) for x in a),
                          "--b", ",".join(repr(float(x)) for x in b),
                          "--sfa", ",".join(f"0x{s:02x}" for s in sfa),
                          "--sfb", ",".join(f"0x{s:02x}" for s in sfb), "--scale", kind, "--c", c],
                         check=True, capture_output=True, text=True).stdout
    want = int(out.split("result 0x")[1].split()[0], 16)
    got = fp4sim.mma(a, b, np.uint8(sfa), np.uint8(sfb), scale=kind, c=float(c))
    assert got["bits"] == want, (kind, hex(got["bits"]), hex(want))
    assert len(got["group_sums"]) == 4 and len(got["terms_on_grid"]) == 5


def test_mma_bad_input_is_named():
    a = np.zeros(64, np.float32)
    s = np.uint8([127] * 4)
    with pytest.raises(ValueError, match=r"a\[3\] = 0.700000 is not an E2M1 value"):
        fp4sim.mma(np.where(np.arange(64) == 3, 0.7, 0).astype(np.float32), a, s, s)
    with pytest.raises(ValueError, match=r"sfa: shape \(4,\), expected \(2,\)"):
        fp4sim.mma(a, a, s, s, scale="ue8m0-32")
    with pytest.raises(ValueError, match="sign bit"):
        fp4sim.mma(a, a, np.uint8([0x80, 0, 0, 0]), s, scale="ue4m3")
    with pytest.raises(ValueError, match="scale 'e8m0'"):
        fp4sim.mma(a, a, s, s, scale="e8m0")
    with pytest.raises(TypeError, match="b: dtype float64"):
        fp4sim.mma(a, np.zeros(64), s, s)


GEMM_CASES = [  # (name, CLI flags, keyword arguments, with C)
    ("nvfp4 exact", [], {}, False),
    ("nvfp4 alpha beta C", ["--alpha", "0.5", "--beta", "2"], {"alpha": 0.5, "beta": 2.0}, True),
    ("nvfp4 split-k 2", ["--split-k", "2"], {"split_k": 2}, False),
    ("nvfp4 bf16 out", ["--out-dtype", "bf16"], {"out_dtype": "bf16"}, False),
    ("mxfp4", ["--format", "mxfp4"], {"format": "mxfp4"}, False),
    ("fp8", ["--format", "fp8"], {"format": "fp8"}, False),
]


@pytest.mark.parametrize("name,flags,kwargs,with_c", GEMM_CASES, ids=[g[0] for g in GEMM_CASES])
def test_gemm_is_the_cli_gemm(name, flags, kwargs, with_c, tmp_path):
    rng = np.random.default_rng(11)
    a = (rng.standard_normal((48, 256)) * np.exp(rng.standard_normal((48, 256)))).astype(np.float32)
    b = rng.standard_normal((40, 256)).astype(np.float32)
    c = rng.standard_normal((48, 40)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    np.save(tmp_path / "c.npy", c)
    cmd = [CLI, "gemm", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), str(tmp_path / "d.npy"),
           "--backend", "emu", *flags] + (["--c", str(tmp_path / "c.npy")] if with_c else [])
    subprocess.run(cmd, check=True, capture_output=True)
    want = np.load(tmp_path / "d.npy")
    got = fp4sim.gemm(a, b, c=c if with_c else None, backend="emu", **kwargs)
    assert got["d"].dtype == want.dtype and got["d"].shape == want.shape, name
    assert got["d"].tobytes() == want.tobytes(), f"{name}: D differs from the CLI's"
    assert got["warnings"] == [] and got["backend"] == "emu"


def test_gemm_warns_and_refuses_as_the_cli():
    a = np.ones((16, 64), np.float32)
    a[0, 0] = np.nan
    got = fp4sim.gemm(a, np.ones((16, 64), np.float32), backend="emu")
    assert any("A (a) holds 1 NaN and 0 Inf" in w for w in got["warnings"]), got["warnings"]
    ok = np.ones((16, 64), np.float32)
    with pytest.raises(ValueError, match="K differs"):
        fp4sim.gemm(ok, np.ones((16, 32), np.float32), backend="emu")
    with pytest.raises(ValueError, match="would not contribute"):
        fp4sim.gemm(ok, ok, c=np.zeros((16, 16), np.float32), backend="emu")
    with pytest.raises(ValueError, match=r"c: shape \(16, 8\), expected \(16, 16\)"):
        fp4sim.gemm(ok, ok, c=np.zeros((16, 8), np.float32), beta=1.0, backend="emu")
    with pytest.raises(ValueError, match="gemm 'fast'"):
        fp4sim.gemm(ok, ok, gemm="fast")
    with pytest.raises(ValueError, match="needs --backend cuda"):
        fp4sim.gemm(ok, ok, gemm="cublaslt", backend="emu")
    with pytest.raises(TypeError, match="b: dtype float64"):
        fp4sim.gemm(ok, np.ones((16, 64)), backend="emu")


class HostTensor:
    """A foreign tensor that only speaks DLPack (as a CPU torch or JAX array does)."""

    def __init__(self, a, device=(1, 0)):
        self._a = a
        self._device = device

    def __dlpack__(self, stream=None):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return self._device


def test_dlpack_host_tensors_are_taken():
    x = sample("f32")
    want = fp4sim.quantize(x, backend="emu")
    got = fp4sim.quantize(HostTensor(x), backend="emu")
    assert got["codes"].tobytes() == want["codes"].tobytes()
    d = fp4sim.dequantize(HostTensor(want["codes"]), HostTensor(want["scales"]), HostTensor(want["amax"]),
                          backend="emu")
    assert d.tobytes() == want["dequant"].tobytes()
    a = x[:32].copy()
    assert fp4sim.gemm(HostTensor(a), HostTensor(a), backend="emu")["d"].tobytes() == \
        fp4sim.gemm(a, a, backend="emu")["d"].tobytes()
    assert fp4sim.convert(HostTensor(x[0].copy()), format="e4m3").tobytes() == \
        fp4sim.convert(x[0].copy(), format="e4m3").tobytes()


def test_dlpack_device_tensors_are_refused_where_not_taken():
    cuda = HostTensor(sample("f32"), device=(2, 0))  # (claims to be on a CUDA GPU)
    with pytest.raises(ValueError, match="x is a CUDA tensor: it runs on the cuda backend"):
        fp4sim.quantize(cuda, backend="emu")
    with pytest.raises(ValueError, match="a on a CUDA GPU and b on the host"):
        fp4sim.gemm(cuda, sample("f32"))
    with pytest.raises(ValueError, match="device type 4 .* on the host here"):
        fp4sim.convert(HostTensor(sample("f32"), device=(4, 0)), format="e2m1")
    with pytest.raises(ValueError, match="device type 2 .* CUDA tensors are taken by quantize"):
        fp4sim.convert(cuda, format="e2m1")


@pytest.mark.parametrize("qflags,qkw", [
    ([], {}),
    (["--four-over-six"], {"four_over_six": True}),
    (["--format", "mxfp4"], {"format": "mxfp4"}),
    (["--columnwise", "--rht"], {"columnwise": True, "rht": True}),
], ids=["nvfp4", "nvfp4 4/6", "mxfp4", "nvfp4 rht"])
def test_gemm_of_quantized_operands_is_the_cli_gemm(qflags, qkw, tmp_path):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((32, 128)).astype(np.float32)
    b = rng.standard_normal((48, 128)).astype(np.float32)
    if qkw.get("columnwise"):  # (the column-wise copies are the K-major operands: transpose)
        a, b = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    for name, x in (("a", a), ("b", b)):
        np.save(tmp_path / f"{name}.npy", x)
        subprocess.run([CLI, "quantize", str(tmp_path / f"{name}.npy"), str(tmp_path / f"q{name}"),
                        "--backend", "emu", *qflags], check=True, capture_output=True)
    subprocess.run([CLI, "gemm", "--a-prefix", str(tmp_path / "qa"), "--b-prefix", str(tmp_path / "qb"),
                    str(tmp_path / "d.npy"), "--backend", "emu", "--alpha", "0.5"],
                   check=True, capture_output=True)
    qa = fp4sim.quantize(a, backend="emu", **qkw)
    qb = fp4sim.quantize(b, backend="emu", **qkw)
    got = fp4sim.gemm(qa, qb, alpha=0.5, backend="emu")
    assert got["d"].tobytes() == np.load(tmp_path / "d.npy").tobytes()


def test_gemm_of_quantized_operands_refuses_mixtures():
    x = np.ones((16, 64), np.float32)
    q = fp4sim.quantize(x, backend="emu")
    with pytest.raises(ValueError, match="both be arrays or both"):
        fp4sim.gemm(q, x, backend="emu")
    with pytest.raises(ValueError, match="format does not go with quantized operands"):
        fp4sim.gemm(q, q, format="nvfp4", backend="emu")
    r = fp4sim.quantize(np.ones((64, 16), np.float32), columnwise=True, rht=True, backend="emu")
    with pytest.raises(ValueError, match="b is an RHT copy and a is not"):
        fp4sim.gemm(q, r, backend="emu")
    with pytest.raises(ValueError, match="a: no 'meta'"):
        fp4sim.gemm({"codes": q["codes"], "scales": q["scales"], "amax": q["amax"]}, q, backend="emu")


def test_quantizer_takes_cuda_tensors_only():
    with pytest.raises(ValueError, match="fp4sim.Quantizer: like: not a CUDA tensor"):
        fp4sim.Quantizer(np.zeros((16, 16), np.float32))


def test_gemm_object_takes_cuda_tensors_only():
    with pytest.raises(ValueError, match="fp4sim.Gemm: a and b: not CUDA tensors"):
        fp4sim.Gemm(np.zeros((16, 16), np.float32), np.zeros((16, 16), np.float32))
