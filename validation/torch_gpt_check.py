#!/usr/bin/env python3
"""PyTorch check of fp4sim's transformer (issue 4): the same model, weights and batches in PyTorch.

fp4sim writes what this script needs with `--dump` (train.warmup must not exceed train.steps, and
tiny.json's warmup is 20, hence the override):

    build/fp4sim train --config configs/tiny.json train.steps=10 train.warmup=2 model.activation_dtype=fp32 train.eval_every=0 \
        train.out_dir=runs/torchcheck --dump runs/torchcheck/dump
    python3 validation/torch_gpt_check.py --dump runs/torchcheck/dump --log runs/torchcheck/log.jsonl

It rebuilds the model from dump/config.json (learned or RoPE positions, LayerNorm or RMSNorm,
GELU-tanh or squared ReLU, grouped KV heads, tied or untied embeddings, biases), loads
dump/weights.safetensors (fp4sim's initial weights, fp4sim's tensor names; the names and shapes
must be exactly the ones the config implies), and checks on the same batch, in float32:
  - step-0 loss within 0.5% (relative) of fp4sim's,
  - every parameter gradient: cosine similarity >= 0.99 and relative norm difference <= 5%,
then trains with torch.optim.AdamW on the same batches (dump/batches.safetensors), the learning
rates fp4sim logged (checked against the schedule recomputed from the config), the same AdamW
hyper-parameters, no weight decay on 1-D tensors (biases, norm weights) as fp4sim, and the same
global-norm clipping, and checks every step's loss within 2% of fp4sim's.
fp4sim rounds GEMM operands to BF16 and accumulates like the tensor core; PyTorch here is plain
FP32, so the tolerances above are the issue's, not bit equality. The last line printed is
"torch_gpt_check: PASS" or "torch_gpt_check: FAIL ..."; exit status 1 on any failure or error.
safetensors files are read by a small reader here (the safetensors package is not required).
Runs on CUDA when available, else on the CPU (--device overrides).
"""
import argparse
import json
import math
import struct
import sys
import traceback

import torch
import torch.nn.functional as F


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(HD), causal) v on (B, NH, T, HD); PyTorch's SDPA where it exists (2.0+),
    else the same formula written out (Debian's PyTorch 1.13, for CPU runs of this check)."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v


class CheckError(Exception):
    pass


# safetensors: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
# data_offsets: [begin, end]}} (offsets relative to the end of the header), then the raw bytes.
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors_raw(path):
    """{name: (dtype string, shape list, bytes)} without any tensor library."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise CheckError(f"{path}: not a safetensors file ({len(data)} bytes)")
    n = struct.unpack("<Q", data[:8])[0]
    if n > len(data) - 8:
        raise CheckError(f"{path}: not a safetensors file (header length {n})")
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        if not 0 <= b <= e <= len(data) - base:
            raise CheckError(f"{path}: tensor '{name}' offsets {b}..{e} outside the file")
        out[name] = (info["dtype"], [int(d) for d in info["shape"]], data[base + b : base + e])
    return out


def load_safetensors(path):
    if sys.byteorder != "little":
        raise CheckError("this reader assumes a little-endian host")
    out = {}
    for name, (dt, shape, raw) in read_safetensors_raw(path).items():
        if dt not in _ST_DTYPES:
            raise CheckError(f"{path}: tensor '{name}' has unsupported dtype {dt}")
        dtype = _ST_DTYPES[dt]
        numel = math.prod(shape)
        if len(raw) != numel * torch.empty((), dtype=dtype).element_size():
            raise CheckError(f"{path}: tensor '{name}' has {len(raw)} bytes for {dt} {shape}")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()
    return out


def expected_shapes(c):
    """fp4sim's parameter tensors (model/gpt.cpp, Gpt::Gpt): names and shapes."""
    C, NH, NKV = c["d_model"], c["n_heads"], c["n_kv_heads"]
    HD = C // NH
    QKV = (NH + 2 * NKV) * HD
    ln, bias = c["norm"] == "layernorm", c["bias"]
    s = {"wte": [c["vocab"], C]}
    if c["positions"] == "learned":
        s["wpe"] = [c["max_positions"], C]
    for l in range(c["n_layers"]):
        p = f"h.{l}."
        s[p + "ln_1.weight"] = [C]
        if ln:
            s[p + "ln_1.bias"] = [C]
        s[p + "attn.c_attn.weight"] = [QKV, C]
        if bias:
            s[p + "attn.c_attn.bias"] = [QKV]
        s[p + "attn.c_proj.weight"] = [C, C]
        if bias:
            s[p + "attn.c_proj.bias"] = [C]
        s[p + "ln_2.weight"] = [C]
        if ln:
            s[p + "ln_2.bias"] = [C]
        s[p + "mlp.c_fc.weight"] = [c["d_ff"], C]
        if bias:
            s[p + "mlp.c_fc.bias"] = [c["d_ff"]]
        s[p + "mlp.c_proj.weight"] = [C, c["d_ff"]]
        if bias:
            s[p + "mlp.c_proj.bias"] = [C]
    s["ln_f.weight"] = [C]
    if ln:
        s["ln_f.bias"] = [C]
    if not c["tied_embeddings"]:
        s["lm_head.weight"] = [c["vocab"], C]
    return s


def learning_rate(t, step):
    """model/schedule.hpp's learning_rate: step is 0-based, t the config's train section."""
    lr, steps, warmup = t["lr"], t["steps"], t["warmup"]
    min_lr = lr * t["min_lr_ratio"]
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if t["schedule"] == "wsd":
        decay_steps = int(math.floor(t["decay_fraction"] * steps + 0.5))  # llround, non-negative
        decay_start = steps - decay_steps
        if step < decay_start or decay_steps == 0:
            return lr
        f = (step - decay_start + 1) / decay_steps
        return lr + (min_lr - lr) * f
    span = steps - warmup
    if span <= 1:
        return lr
    f = (step - warmup) / (span - 1)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * f))


def rope(x, base=10000.0):
    # x (B, T, H, D): pairs (2i, 2i+1) rotated by t * base^(-2i/D), as emu::rope_forward
    B, T, H, D = x.shape
    i = torch.arange(D // 2, dtype=torch.float64, device=x.device)
    freq = base ** (-2.0 * i / D)
    ang = torch.arange(T, dtype=torch.float64, device=x.device)[:, None] * freq[None, :]
    c = torch.cos(ang).to(x.dtype)[None, :, None, :]
    s = torch.sin(ang).to(x.dtype)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def fp4sim_adamw(model, tcfg):
    """torch.optim.AdamW with the run's hyper-parameters and fp4sim's weight-decay rule
    (model/trainer.cpp): decay on tensors of 2+ dimensions only (embeddings, heads, GEMM weights,
    conv weights), none on biases, norm weights and the other vectors."""
    decay = [p for p in model.p.values() if p.dim() >= 2]
    no_decay = [p for p in model.p.values() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tcfg["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=tcfg["lr"], betas=(tcfg["beta1"], tcfg["beta2"]), eps=tcfg["eps"])


def replay_step(model, opt, tcfg, batches, entry, s, dev):
    """Step s (from 0) as fp4sim logged it: the logged learning rate (checked against the config's
    schedule, a NOT OK line where it differs), the dumped batch, forward, backward, fp4sim's global
    norm clipping, the optimizer step. Returns (loss, gradient norm, whether the lr matched)."""
    lr_want = learning_rate(tcfg, s)
    lr_ok = abs(entry["lr"] - lr_want) <= 1e-6 * lr_want
    if not lr_ok:
        print(f"  NOT OK step {s + 1}: logged lr {entry['lr']:.6e}, the config's schedule gives {lr_want:.6e}", flush=True)
    for group in opt.param_groups:
        group["lr"] = entry["lr"]
    tok = batches[f"tokens.{s}"].long().to(dev)
    tgt = batches[f"targets.{s}"].long().to(dev)
    opt.zero_grad(set_to_none=True)
    loss = model(tok, tgt)
    loss.backward()
    if tcfg["grad_clip"] > 0:
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg["grad_clip"]))
    else:
        gnorm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))
    opt.step()
    return loss.item(), gnorm, lr_ok


class Gpt(torch.nn.Module):
    def __init__(self, cfg, weights):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v.clone()) for k, v in weights.items()})

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def norm(self, x, pre):
        if self.cfg["norm"] == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.w(pre + ".weight"), self.w(pre + ".bias"), eps=1e-5)
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * self.w(pre + ".weight")

    def linear(self, x, pre):
        b = self.w(pre + ".bias") if self.cfg["bias"] else None
        return F.linear(x, self.w(pre + ".weight"), b)

    def forward(self, tok, tgt):
        c = self.cfg
        B, T = tok.shape
        C, NH, NKV = c["d_model"], c["n_heads"], c["n_kv_heads"]
        HD = C // NH
        x = self.w("wte")[tok]
        if c["positions"] == "learned":
            x = x + self.w("wpe")[torch.arange(T, device=tok.device)][None]
        for l in range(c["n_layers"]):
            h = self.norm(x, f"h.{l}.ln_1")
            qkv = self.linear(h, f"h.{l}.attn.c_attn")
            q = qkv[..., : NH * HD].reshape(B, T, NH, HD)
            k = qkv[..., NH * HD : (NH + NKV) * HD].reshape(B, T, NKV, HD)
            v = qkv[..., (NH + NKV) * HD :].reshape(B, T, NKV, HD)
            if c["positions"] == "rope":
                q, k = rope(q), rope(k)
            rep = NH // NKV  # query head h reads KV head h // rep, as emu::attention_forward
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
            y = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            y = y.transpose(1, 2).reshape(B, T, NH * HD)
            x = x + self.linear(y, f"h.{l}.attn.c_proj")
            h = self.norm(x, f"h.{l}.ln_2")
            f = self.linear(h, f"h.{l}.mlp.c_fc")
            f = F.gelu(f, approximate="tanh") if c["activation"] == "gelu_tanh" else torch.relu(f) ** 2
            x = x + self.linear(f, f"h.{l}.mlp.c_proj")
        x = self.norm(x, "ln_f")
        head = self.w("wte") if c["tied_embeddings"] else self.w("lm_head.weight")
        logits = F.linear(x, head)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dump", required=True, help="the folder fp4sim train --dump wrote")
    ap.add_argument("--log", required=True, help="the run's log.jsonl (per-step losses and learning rates)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    with open(f"{args.dump}/config.json") as fh:
        full = json.load(fh)
    cfg, tcfg = full["model"], full["train"]
    if cfg["activation"] == "swiglu":
        raise CheckError("swiglu: this reference model has no SwiGLU yet")
    if cfg.get("activation_dtype", "fp32") != "fp32":
        raise CheckError("the PyTorch reference keeps activations in FP32: dump with model.activation_dtype=fp32 "
                         f"(the dump has {cfg.get('activation_dtype')})")
    dev = torch.device(args.device)
    print(f"device {dev}, torch {torch.__version__}, model {json.dumps(cfg, sort_keys=True)}", flush=True)
    weights = {k: v.float() for k, v in load_safetensors(f"{args.dump}/weights.safetensors").items()}
    ref = load_safetensors(f"{args.dump}/step0_grads.safetensors")
    batches = load_safetensors(f"{args.dump}/batches.safetensors")
    with open(args.log) as fh:
        log = [json.loads(line) for line in fh if line.strip()]
    failures = 0

    # the dump must hold exactly the tensors the config implies (a missing or extra one is a bug)
    want = expected_shapes(cfg)
    got = {k: list(v.shape) for k, v in weights.items()}
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise CheckError(f"weights.safetensors does not match the config: missing {missing}, extra {extra}, "
                         f"wrong shape {[(k, got[k], want[k]) for k in wrong]}")
    for name in want:
        if name not in ref or list(ref[name].shape) != want[name]:
            raise CheckError(f"step0_grads.safetensors: gradient '{name}' missing or of the wrong shape")
    if "loss" not in ref:
        raise CheckError("step0_grads.safetensors: no 'loss'")

    steps = sorted(int(k.split(".")[1]) for k in batches if k.startswith("tokens."))
    if not steps:
        raise CheckError("batches.safetensors holds no tokens.<step>")
    if steps[0] != 0:
        # the dump's weights are the ones before steps[0], but AdamW's moments of a resumed run are not dumped
        raise CheckError(f"the dump starts at step {steps[0]} (a resumed run): the optimizer state is not in it; "
                         "dump a fresh run")
    B, T = tcfg["batch"], cfg["seq_len"]
    for s in steps:
        for kind in ("tokens", "targets"):
            t = batches.get(f"{kind}.{s}")
            if t is None or list(t.shape) != [B, T]:
                raise CheckError(f"batches.safetensors: {kind}.{s} missing or not of shape [{B}, {T}]")

    model = Gpt(cfg, {k: v.to(dev) for k, v in weights.items()})
    tok = batches[f"tokens.{steps[0]}"].long().to(dev)
    tgt = batches[f"targets.{steps[0]}"].long().to(dev)
    loss = model(tok, tgt)
    loss.backward()
    lv = loss.item()
    f_loss = float(ref["loss"].reshape(-1)[0])
    rel = abs(lv - f_loss) / abs(f_loss)
    ok = rel <= 0.005
    failures += not ok
    print(f"step-0 loss: torch {lv:.6f}  fp4sim {f_loss:.6f}  rel diff {rel:.2e}  {'OK' if ok else 'NOT OK'} (<= 0.5%)", flush=True)
    worst_cos, worst_norm = 1.0, 0.0
    for name in want:
        grad = model.w(name).grad
        g_t = (grad if grad is not None else torch.zeros_like(model.w(name))).detach().double().flatten().cpu()
        g_f = ref[name].double().flatten()
        nt, nf = g_t.norm().item(), g_f.norm().item()
        if nt == 0.0 and nf == 0.0:
            cos, nrel = 1.0, 0.0  # both exactly zero: equal
        else:
            cos = float(torch.dot(g_t, g_f)) / (nt * nf) if nt > 0 and nf > 0 else 0.0
            nrel = abs(nt - nf) / nf if nf > 0 else math.inf
        bad = not (cos >= 0.99 and nrel <= 0.05)  # NaN fails too
        failures += bad
        worst_cos, worst_norm = min(worst_cos, cos), max(worst_norm, nrel)
        if bad:
            print(f"  NOT OK {name}: cosine {cos:.5f} (>= 0.99), norm diff {nrel:.2%} (<= 5%)", flush=True)
    print(f"gradients: {len(want)} tensors, worst cosine {worst_cos:.5f}, worst norm diff {worst_norm:.2%}", flush=True)

    # training on the same batches with the logged learning rates (checked against the schedule)
    model = Gpt(cfg, {k: v.to(dev) for k, v in weights.items()})
    opt = fp4sim_adamw(model, tcfg)
    for s in steps:
        entry = next((e for e in log if e["step"] == s + 1), None)
        if entry is None:
            raise CheckError(f"{args.log}: no entry for step {s + 1}")
        lv, gnorm, lr_ok = replay_step(model, opt, tcfg, batches, entry, s, dev)
        failures += not lr_ok
        rel = abs(lv - entry["loss"]) / abs(entry["loss"])
        ok = rel <= 0.02
        failures += not ok
        print(f"step {s + 1:3d}: torch {lv:.5f}  fp4sim {entry['loss']:.5f}  rel diff {rel:.2e}  "
              f"{'OK' if ok else 'NOT OK'} (<= 2%)  | grad norm torch {gnorm:.4f} fp4sim {entry.get('grad_norm', float('nan')):.4f}"
              f"  lr {entry['lr']:.3e}", flush=True)
    print("torch_gpt_check: PASS" if failures == 0 else f"torch_gpt_check: FAIL ({failures} checks not OK)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        rc = main()
    except Exception as e:
        if not isinstance(e, CheckError):
            traceback.print_exc()
        sys.stderr.flush()
        print(f"torch_gpt_check: FAIL (error: {e})", flush=True)
        rc = 1
    sys.exit(rc)
