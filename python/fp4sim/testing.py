"""Golden packs from Python: load a pack `fp4sim golden write` made, and compare a kernel's outputs
with its expected outputs bit for bit (DESIGN.md §15, docs/python.md).

    from fp4sim.testing import load_pack, assert_bitwise_equal
    pack = load_pack("pack")                      # verifies the manifest and every file's SHA-256
    for case in pack.cases("mma"):
        d = my_mma(**case.inputs)                 # the kernel under test
        assert_bitwise_equal(d, case.expected["d.npy"], case.name)

numpy only; the pack's layout and the checks are those of `fp4sim golden check` (docs/cli.md).
"""
import hashlib
import json
import os

import numpy as np

from ._fp4sim import contract_version

PACK_FORMAT = "fp4sim golden pack"
PACK_VERSION = 1


class PackError(ValueError):
    """A folder that is not a valid pack of this build's contract (named in the message)."""


def _flat_index(index, shape):
    return tuple(int(i) for i in np.unravel_index(index, shape)) if shape else ()


def assert_bitwise_equal(got, expected, name=""):
    """Raise AssertionError unless `got` has `expected`'s dtype, shape and every element's bits
    (NaN compared by its bits too). The message names the first differing element: its flat index,
    its index per dimension, and the expected and the got bits in hex, as `fp4sim golden check`."""
    got = np.asarray(got)
    expected = np.asarray(expected)
    where = f"{name}: " if name else ""
    if got.dtype != expected.dtype:
        raise AssertionError(f"{where}dtype {got.dtype}, expected {expected.dtype}")
    if got.shape != expected.shape:
        raise AssertionError(f"{where}shape {got.shape}, expected {expected.shape}")
    width = expected.dtype.itemsize
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    g = np.ascontiguousarray(got).view(view).reshape(-1)
    e = np.ascontiguousarray(expected).view(view).reshape(-1)
    bad = np.flatnonzero(g != e)
    if bad.size:
        i = int(bad[0])
        raise AssertionError(
            f"{where}{bad.size} of {e.size} elements differ; first at flat index {i} "
            f"{_flat_index(i, expected.shape)}: expected 0x{int(e[i]):0{2 * width}X}, "
            f"got 0x{int(g[i]):0{2 * width}X}")


class Case:
    """One case of a pack: `name` ("mma/ue4m3_c_inf"), `op`, `meta` (its case.json), `inputs`
    and `expected` (file name -> numpy array, read on first use)."""

    def __init__(self, root, meta):
        self.root = root
        self.meta = meta
        self.name = meta["name"]
        self.op = meta["op"]
        self._inputs = None
        self._expected = None

    def _load(self, sub, names):
        return {n: np.load(os.path.join(self.root, self.name, sub, n)) for n in names}

    @property
    def inputs(self):
        if self._inputs is None:
            self._inputs = self._load("inputs", [n for n in self.meta["inputs"] if n.endswith(".npy")])
        return self._inputs

    @property
    def expected(self):
        if self._expected is None:
            present = [o["file"] for o in self.meta["outputs"]
                       if not o["optional"] or os.path.exists(os.path.join(self.root, self.name, "expected", o["file"]))]
            self._expected = self._load("expected", present)
        return self._expected

    def operand(self, name):
        """A gemm case's operand `name` ("a" or "b"): the float32 array, or for a case of quantized
        operands a dict as fp4sim.quantize returns (codes, scales, amax, meta), which fp4sim.gemm
        takes as it is."""
        if self.op != "gemm":
            raise ValueError(f"{self.name}: a {self.op} case has no GEMM operands")
        if f"{name}.npy" in self.meta["inputs"]:
            return self.inputs[f"{name}.npy"]
        folder = os.path.join(self.root, self.name, "inputs")
        with open(os.path.join(folder, f"{name}.meta.json")) as f:
            meta = json.load(f)
        return {k: np.load(os.path.join(folder, f"{name}.{k}.npy")) for k in ("codes", "scales", "amax")} | {"meta": meta}

    def quantize_kwargs(self):
        """A quantize case's options as fp4sim.quantize's keyword arguments."""
        if self.op != "quantize":
            raise ValueError(f"{self.name}: a {self.op} case has no quantize options")
        opts, kw, i = self.meta["options"], {}, 0
        flags = {"--2d": "block_2d", "--columnwise": "columnwise", "--rht": "rht", "--sr": "sr",
                 "--four-over-six": "four_over_six"}
        values = {"--format": ("format", str), "--seed": ("seed", int), "--stream": ("stream", int),
                  "--error": ("error", str), "--mx-rule": ("mx_rule", str)}
        while i < len(opts):
            flag, value = opts[i].split("=", 1) if "=" in opts[i] else (opts[i], None)
            if flag in flags:
                kw[flags[flag]] = True
            elif flag in values:
                if value is None:
                    i += 1
                    value = opts[i]
                kw[values[flag][0]] = values[flag][1](value)
            else:
                raise ValueError(f"{self.name}: quantize option '{opts[i]}' unknown to fp4sim.testing")
            i += 1
        return kw


class Pack:
    """A verified pack: `manifest`, and its cases by op."""

    def __init__(self, root, manifest, cases):
        self.root = root
        self.manifest = manifest
        self._cases = cases

    def cases(self, op=None):
        return [c for c in self._cases if op is None or c.op == op]


def load_pack(path, verify=True):
    """The pack at `path`, refused (PackError naming the file) unless its manifest has this format,
    pack_version and this build's contract_version, and (verify) every file its size and SHA-256."""
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        raise PackError(f"{path}: not a pack (no manifest.json)")
    with open(mpath) as f:
        manifest = json.load(f)
    if manifest.get("format") != PACK_FORMAT:
        raise PackError(f"{mpath}: format {manifest.get('format')!r}, expected {PACK_FORMAT!r}")
    if manifest.get("pack_version") != PACK_VERSION:
        raise PackError(f"{mpath}: pack_version {manifest.get('pack_version')}, this build reads {PACK_VERSION}")
    if manifest.get("contract_version") != contract_version:
        raise PackError(f"{mpath}: contract_version {manifest.get('contract_version')}, this build's is "
                        f"{contract_version}: the bits follow another contract; write the pack again")
    if verify:
        for rel, want in manifest["files"].items():
            fpath = os.path.join(path, rel)
            if not os.path.isfile(fpath):
                raise PackError(f"{fpath}: missing (the manifest lists it)")
            with open(fpath, "rb") as f:
                data = f.read()
            if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
                raise PackError(f"{fpath}: size or SHA-256 differs from the manifest's (a corrupted pack)")
    cases = []
    for c in manifest["cases"]:
        with open(os.path.join(path, c["name"], "case.json")) as f:
            cases.append(Case(path, json.load(f)))
    return Pack(path, manifest, cases)
