"""fp4sim.testing against a pack `fp4sim golden write` makes: the module's own quantize, gemm
and mma pass every case of the pack through assert_bitwise_equal; a changed bit, a corrupted file and
another contract_version are refused with their names."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import fp4sim
from fp4sim.testing import PackError, assert_bitwise_equal, load_pack

CLI = os.environ.get("FP4SIM_CLI", "build/fp4sim")


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden") / "pack"
    subprocess.run([CLI, "golden", "write", str(path)], check=True, capture_output=True)
    return str(path)


def test_quantize_cases_pass(pack):
    p = load_pack(pack)
    cases = p.cases("quantize")
    assert len(cases) > 20
    for case in cases:
        q = fp4sim.quantize(case.inputs["x.npy"], backend="emu", **case.quantize_kwargs())
        for key in ("codes", "scales", "amax", "dequant"):
            assert_bitwise_equal(q[key], case.expected[f"q.{key}.npy"], f"{case.name} {key}")


def test_mma_cases_pass(pack):
    cases = load_pack(pack).cases("mma")
    assert len(cases) > 10
    for case in cases:
        i = case.inputs
        got = fp4sim.mma(i["a.npy"], i["b.npy"], i["sfa.npy"], i["sfb.npy"],
                         scale=case.meta["scale_kind"], c=float(i["c.npy"][0]))
        d = np.array([got["bits"]], np.uint32).view(np.float32)
        assert_bitwise_equal(d, case.expected["d.npy"], case.name)


def test_gemm_cases_pass(pack):
    cases = load_pack(pack).cases("gemm")
    assert len(cases) > 10
    for case in cases:
        m = case.meta
        a, b = case.operand("a"), case.operand("b")
        kw = {} if isinstance(a, dict) else {"format": m["format"]}
        got = fp4sim.gemm(a, b, c=case.inputs.get("c.npy"), alpha=m.get("alpha", 1.0),
                          beta=m.get("beta", 0.0), split_k=m.get("split_k", 1),
                          out_dtype=m.get("out_dtype", "fp32"), backend="emu", **kw)
        assert_bitwise_equal(got["d"], case.expected["d.npy"], case.name)


def test_a_changed_bit_is_named():
    e = np.arange(6, dtype=np.float32).reshape(2, 3)
    g = e.copy()
    g[1, 2] = np.nextafter(g[1, 2], np.float32(9))
    with pytest.raises(AssertionError, match=r"t: 1 of 6 elements differ; first at flat index 5 \(1, 2\): "
                                             r"expected 0x40A00000, got 0x40A00001"):
        assert_bitwise_equal(g, e, "t")
    with pytest.raises(AssertionError, match="dtype float64, expected float32"):
        assert_bitwise_equal(e.astype(np.float64), e)
    with pytest.raises(AssertionError, match=r"shape \(3, 2\), expected \(2, 3\)"):
        assert_bitwise_equal(e.reshape(3, 2), e)
    nan = np.array([np.nan], np.float32)
    with pytest.raises(AssertionError, match="0x7FC00000"):
        assert_bitwise_equal(-nan, nan)  # NaN by its bits


def test_bad_packs_are_refused(pack, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(pack, bad)
    case = load_pack(str(bad)).cases("mma")[0].name
    with open(bad / case / "expected" / "d.npy", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(PackError, match="d.npy: size or SHA-256 differs"):
        load_pack(str(bad))
    m = json.loads((bad / "manifest.json").read_text())
    m["contract_version"] = 99
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackError, match="contract_version 99"):
        load_pack(str(bad))
    with pytest.raises(PackError, match="not a pack"):
        load_pack(str(tmp_path))
