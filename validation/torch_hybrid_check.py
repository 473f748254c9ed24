#!/usr/bin/env python3
"""PyTorch check of fp4sim's hybrid Mamba-2/Transformer model (model.pattern, DESIGN.md §11-§12).

The hybrid counterpart of torch_gpt_check.py, with the same inputs, checks and thresholds. fp4sim
writes what it needs with `--dump` (train.warmup must not exceed train.steps):

    build/fp4sim train --backend emu --config configs/nemotron-h-tiny.json train.steps=10 train.warmup=2 \
        model.activation_dtype=fp32 train.eval_every=0 train.data=synthetic \
        train.out_dir=runs/hcheck --dump runs/hcheck/dump
    python3 validation/torch_hybrid_check.py --dump runs/hcheck/dump --log runs/hcheck/log.jsonl

(--backend cuda checks the CUDA backend the same way; model.seq_len=100, say, gives the SSD a
partial last chunk; --log defaults to the log.jsonl beside the dump folder.)

The model is rebuilt from dump/config.json's "model" section: blocks from model.pattern ('M'
Mamba-2, '*' attention, '-' MLP), each x = x + mixer(norm(x)) with the block's norm
blocks.<i>.norm; then ln_f and the head (lm_head.weight, or wte when tied). Attention: c_attn rows
q | k | v (GQA: query head h reads KV head h // (n_heads / n_kv_heads)), causal, no RoPE unless
model.positions = rope; MLP: c_fc, GELU-tanh or squared ReLU, c_proj; Mamba-2: torch_ssd.py's
mixer (in_proj [z | x | B | C | dt], causal conv + SiLU, softplus dt, SSD, gated grouped RMSNorm,
out_proj). Norms: RMSNorm (or LayerNorm) with eps 1e-5. Token embedding wte, learned positions wpe
only for model.positions = learned (none: no positions at all).
dump/weights.safetensors (fp4sim's initial weights under fp4sim's names) must hold exactly the
tensors and shapes the config implies. In float32 (no TF32), on the same batch:
  - step-0 loss within 0.5% (relative) of fp4sim's,
  - every parameter gradient: cosine similarity >= 0.99 and relative norm difference <= 5%
    (a table gives the worst of each parameter kind),
then 10 steps of torch.optim.AdamW on dump/batches.safetensors with the learning rates fp4sim
logged (checked against the schedule recomputed from the config), fp4sim's AdamW settings, weight
decay on tensors of 2+ dimensions only (as model/trainer.cpp: the linear weights, embeddings and
the conv weight; not biases, norm weights, dt_bias, A_log, D), global-norm clipping at
train.grad_clip; every step's loss within 2% of fp4sim's.
The SSD is the chunked algorithm (chunk model.mamba_chunk) unless --ssd sequential. The script
first runs torch_ssd.self_test() (chunked == sequential in float64, forward and gradients) and
fails when it does. The last line printed is "torch_hybrid_check: PASS" or
"torch_hybrid_check: FAIL ..."; exit status 1 on any failure or error.
Shares the safetensors reader, the schedule and the attention with torch_gpt_check.py; runs on CUDA
when available, else on the CPU (--device overrides); works with PyTorch 1.13 and later.
"""
import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torch_gpt_check import (CheckError, Gpt, causal_attention, fp4sim_adamw,  # noqa: E402
                             load_safetensors, replay_step, rope)
import torch_ssd  # noqa: E402

NAME = "torch_hybrid_check"
MODEL_KEYS = ("vocab", "seq_len", "d_model", "n_heads", "n_kv_heads", "d_ff", "activation", "norm", "positions",
              "tied_embeddings", "bias", "pattern")
TRAIN_KEYS = ("batch", "lr", "steps", "warmup", "min_lr_ratio", "schedule", "decay_fraction", "weight_decay",
              "beta1", "beta2", "eps", "grad_clip")


def check_config(full, path):
    """The model and train sections, with every key this script reads present and usable."""
    for part in ("model", "train"):
        if not isinstance(full.get(part), dict):
            raise CheckError(f"{path}: no '{part}' object")
    cfg, tcfg = full["model"], full["train"]
    missing = [f"model.{k}" for k in MODEL_KEYS if k not in cfg] + [f"train.{k}" for k in TRAIN_KEYS if k not in tcfg]
    if missing:
        raise CheckError(f"{path}: missing key(s) {', '.join(missing)}")
    pat = cfg["pattern"]
    if not isinstance(pat, str) or not pat:
        raise CheckError(f"{path}: model.pattern is {pat!r}; this script checks pattern models "
                         "(torch_gpt_check.py checks the GPT presets' layout)")
    bad = sorted(set(pat) - set("M*-"))
    if bad:
        raise CheckError(f"{path}: model.pattern {pat!r} has block characters {bad} (known: M, *, -)")
    if cfg["activation"] not in ("gelu_tanh", "squared_relu"):
        raise CheckError(f"model.activation {cfg['activation']}: this reference model has gelu_tanh and squared_relu")
    if cfg["norm"] not in ("rmsnorm", "layernorm"):
        raise CheckError(f"model.norm {cfg['norm']}: not rmsnorm or layernorm")
    if cfg["positions"] not in ("none", "learned", "rope"):
        raise CheckError(f"model.positions {cfg['positions']}: not none, learned or rope")
    if cfg["positions"] == "learned" and "max_positions" not in cfg:
        raise CheckError(f"{path}: model.positions is learned but there is no model.max_positions")
    if cfg.get("activation_dtype", "fp32") != "fp32":
        raise CheckError("the PyTorch reference keeps activations in FP32: dump with model.activation_dtype=fp32 "
                         f"(the dump has {cfg.get('activation_dtype')})")
    if cfg["d_model"] % cfg["n_heads"] or cfg["n_heads"] % cfg["n_kv_heads"]:
        raise CheckError(f"d_model {cfg['d_model']}, n_heads {cfg['n_heads']}, n_kv_heads {cfg['n_kv_heads']}: "
                         "d_model must be a multiple of n_heads and n_heads of n_kv_heads")
    dims = None
    if "M" in pat:
        try:
            dims = torch_ssd.MambaDims(cfg)
        except (KeyError, ValueError) as e:
            raise CheckError(f"{path}: {e.args[0]}")
    return cfg, tcfg, dims


def expected_shapes(c, dims):
    """fp4sim's parameter tensors of a model.pattern model: names and shapes, in fp4sim's order."""
    C, NH, NKV = c["d_model"], c["n_heads"], c["n_kv_heads"]
    HD = C // NH
    QKV = (NH + 2 * NKV) * HD
    ln, bias = c["norm"] == "layernorm", c["bias"]
    s = {"wte": [c["vocab"], C]}
    if c["positions"] == "learned":
        s["wpe"] = [c["max_positions"], C]
    for i, kind in enumerate(c["pattern"]):
        p = f"blocks.{i}."
        s[p + "norm.weight"] = [C]
        if ln:
            s[p + "norm.bias"] = [C]
        if kind == "*":
            s[p + "attn.c_attn.weight"] = [QKV, C]
            if bias:
                s[p + "attn.c_attn.bias"] = [QKV]
            s[p + "attn.c_proj.weight"] = [C, C]
            if bias:
                s[p + "attn.c_proj.bias"] = [C]
        elif kind == "-":
            s[p + "mlp.c_fc.weight"] = [c["d_ff"], C]
            if bias:
                s[p + "mlp.c_fc.bias"] = [c["d_ff"]]
            s[p + "mlp.c_proj.weight"] = [C, c["d_ff"]]
            if bias:
                s[p + "mlp.c_proj.bias"] = [C]
        else:  # 'M': no biases in in_proj and out_proj (DESIGN.md §12)
            s.update(dims.shapes(p + "mamba."))
    s["ln_f.weight"] = [C]
    if ln:
        s["ln_f.bias"] = [C]
    if not c["tied_embeddings"]:
        s["lm_head.weight"] = [c["vocab"], C]
    return s


def param_kind(name, pattern):
    """A parameter's kind for the summary table: 'M mamba.in_proj.weight', '* norm.weight', 'wte'."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"{pattern[int(i)]} {rest}"
    return name


class Hybrid(Gpt):
    """torch_gpt_check's model (its parameters, w, norm and linear) with blocks by pattern."""

    def __init__(self, cfg, dims, weights, ssd):
        super().__init__(cfg, weights)
        self.dims, self.ssd = dims, ssd

    def attention(self, h, pre):
        c = self.cfg
        B, T, _ = h.shape
        NH, NKV = c["n_heads"], c["n_kv_heads"]
        HD = c["d_model"] // NH
        qkv = self.linear(h, pre + "attn.c_attn")
        q = qkv[..., : NH * HD].reshape(B, T, NH, HD)
        k = qkv[..., NH * HD : (NH + NKV) * HD].reshape(B, T, NKV, HD)
        v = qkv[..., (NH + NKV) * HD :].reshape(B, T, NKV, HD)
        if c["positions"] == "rope":
            q, k = rope(q), rope(k)
        k = k.repeat_interleave(NH // NKV, dim=2)  # query head h reads KV head h // (NH / NKV)
        v = v.repeat_interleave(NH // NKV, dim=2)
        y = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.linear(y.transpose(1, 2).reshape(B, T, NH * HD), pre + "attn.c_proj")

    def mlp(self, h, pre):
        f = self.linear(h, pre + "mlp.c_fc")
        f = F.gelu(f, approximate="tanh") if self.cfg["activation"] == "gelu_tanh" else torch.relu(f) ** 2
        return self.linear(f, pre + "mlp.c_proj")

    def forward(self, tok, tgt):
        c = self.cfg
        T = tok.shape[1]
        x = self.w("wte")[tok]
        if c["positions"] == "learned":
            x = x + self.w("wpe")[torch.arange(T, device=tok.device)][None]
        for i, kind in enumerate(c["pattern"]):
            pre = f"blocks.{i}."
            h = self.norm(x, pre + "norm")
            if kind == "*":
                x = x + self.attention(h, pre)
            elif kind == "-":
                x = x + self.mlp(h, pre)
            else:
                x = x + torch_ssd.mamba_mixer(h, lambda n, pre=pre: self.w(pre + "mamba." + n), self.dims, self.ssd)
        x = self.norm(x, "ln_f")
        head = self.w("wte") if c["tied_embeddings"] else self.w("lm_head.weight")
        logits = F.linear(x, head)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def load_dump_file(dump, name):
    path = os.path.join(dump, name)
    if not os.path.isfile(path):
        raise CheckError(f"{path}: no such file (write the dump with `fp4sim train ... --dump {dump}`)")
    return load_safetensors(path)


def compare_gradients(model, ref, want, pattern):
    """Cosine and relative norm difference of every gradient; prints the NOT OK tensors and the
    per-kind table; returns the number of tensors not OK."""
    kinds = {}  # kind -> [count, worst cos, its tensor, worst norm diff, its tensor]
    failures = 0
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
        if bad:
            print(f"  NOT OK {name}: cosine {cos:.5f} (>= 0.99), norm diff {nrel:.2%} (<= 5%), "
                  f"norm torch {nt:.4e} fp4sim {nf:.4e}", flush=True)
        k = kinds.setdefault(param_kind(name, pattern), [0, 2.0, "", -1.0, ""])
        k[0] += 1
        if not cos >= k[1]:
            k[1], k[2] = cos, name
        if not nrel <= k[3]:
            k[3], k[4] = nrel, name
    wk = max(len(k) for k in kinds)
    print(f"  {'kind':<{wk}}  tensors  worst cosine (>= 0.99)  worst norm diff (<= 5%)", flush=True)
    for kind, (n, cos, cn, nrel, nn) in kinds.items():
        flag = "" if cos >= 0.99 and nrel <= 0.05 else "  NOT OK"
        where = cn if cn == nn else f"{cn} / {nn}"
        print(f"  {kind:<{wk}}  {n:7d}  {cos:22.6f}  {nrel:22.3%}   ({where}){flag}", flush=True)
    worst_cos = min(k[1] for k in kinds.values())
    worst_norm = max(k[3] for k in kinds.values())
    print(f"gradients: {len(want)} tensors, worst cosine {worst_cos:.6f}, worst norm diff {worst_norm:.3%}"
          f"{'' if failures == 0 else f', {failures} NOT OK'}", flush=True)
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="the fp4sim command that writes the inputs is in this script's docstring")
    ap.add_argument("--dump", help="the folder fp4sim train --dump wrote (config.json, weights.safetensors, "
                                   "step0_grads.safetensors, batches.safetensors)")
    ap.add_argument("--log", help="the run's log.jsonl (per-step losses and learning rates); default: "
                                  "<dump>/../log.jsonl")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ssd", choices=["chunked", "sequential"], default="chunked",
                    help="the Mamba-2 scan: the chunked SSD (model.mamba_chunk) or the step-by-step recurrence")
    ap.add_argument("--self-test", action="store_true",
                    help="only the SSD self-test (chunked == sequential, float64), then exit")
    args = ap.parse_args()
    if not args.dump and not args.self_test:
        ap.error("--dump is required (unless --self-test)")

    print("SSD self-test (chunked == sequential, float64, forward and gradients, <= 1e-10):", flush=True)
    n_bad = torch_ssd.self_test()
    if args.self_test:
        if n_bad:
            raise CheckError(f"SSD self-test: {n_bad} cases not OK")
        print(f"{NAME}: PASS (self-test only)", flush=True)
        return 0
    if n_bad:
        raise CheckError(f"SSD self-test: {n_bad} cases not OK (the chunked SSD is wrong; nothing else was checked)")
    log_path = args.log or os.path.join(os.path.dirname(os.path.abspath(args.dump)), "log.jsonl")

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    cfg_path = os.path.join(args.dump, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckError(f"{cfg_path}: no such file (write the dump with `fp4sim train ... --dump {args.dump}`)")
    with open(cfg_path) as fh:
        full = json.load(fh)
    cfg, tcfg, dims = check_config(full, cfg_path)
    dev = torch.device(args.device)
    print(f"device {dev}, torch {torch.__version__}, ssd {args.ssd}, model {json.dumps(cfg, sort_keys=True)}", flush=True)
    if dims is not None:
        print(f"mamba: d_inner {dims.d_inner}, heads {dims.H} x head dim {dims.P}, groups {dims.G}, state {dims.N}, "
              f"conv {dims.W}, chunk {dims.Q}; in_proj width {dims.in_width}", flush=True)
    weights = {k: v.float() for k, v in load_dump_file(args.dump, "weights.safetensors").items()}
    ref = load_dump_file(args.dump, "step0_grads.safetensors")
    batches = load_dump_file(args.dump, "batches.safetensors")
    if not os.path.isfile(log_path):
        raise CheckError(f"{log_path}: no such file (the run's log.jsonl: train.out_dir/log.jsonl; see --log)")
    with open(log_path) as fh:
        log = [json.loads(line) for line in fh if line.strip()]
    failures = 0

    # the dump must hold exactly the tensors the config implies (a missing or extra one is a bug)
    want = expected_shapes(cfg, dims)
    got = {k: list(v.shape) for k, v in weights.items()}
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise CheckError(f"weights.safetensors does not match the config: missing {missing}, extra {extra}, "
                         f"wrong shape (name, dump, expected) {[(k, got[k], want[k]) for k in wrong]}")
    for name in want:
        if name not in ref:
            raise CheckError(f"step0_grads.safetensors: no gradient '{name}'")
        if list(ref[name].shape) != want[name]:
            raise CheckError(f"step0_grads.safetensors: gradient '{name}' has shape {list(ref[name].shape)}, "
                             f"expected {want[name]}")
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
                raise CheckError(f"batches.safetensors: {kind}.{s} missing or not of shape [{B}, {T}] "
                                 f"({None if t is None else list(t.shape)})")
    print(f"dump: {len(want)} tensors, {sum(math.prod(v) for v in want.values()):,} parameters, "
          f"{len(steps)} batches of {B} x {T}, log {log_path} ({len(log)} lines)", flush=True)

    # step 0: loss and gradients on the same batch
    t0 = time.perf_counter()
    model = Hybrid(cfg, dims, {k: v.to(dev) for k, v in weights.items()}, args.ssd)
    tok = batches[f"tokens.{steps[0]}"].long().to(dev)
    tgt = batches[f"targets.{steps[0]}"].long().to(dev)
    loss = model(tok, tgt)
    loss.backward()
    lv = loss.item()
    f_loss = float(ref["loss"].reshape(-1)[0])
    rel = abs(lv - f_loss) / abs(f_loss)
    ok = rel <= 0.005
    failures += not ok
    print(f"step-0 loss: torch {lv:.6f}  fp4sim {f_loss:.6f}  rel diff {rel:.2e}  {'OK' if ok else 'NOT OK'} (<= 0.5%)"
          f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    failures += compare_gradients(model, ref, want, cfg["pattern"])

    # training on the same batches with the logged learning rates (checked against the schedule)
    model = Hybrid(cfg, dims, {k: v.to(dev) for k, v in weights.items()}, args.ssd)
    opt = fp4sim_adamw(model, tcfg)
    print("   step  loss torch   loss fp4sim  rel diff        grad norm torch  fp4sim     lr", flush=True)
    worst_step = 0.0
    for s in steps:
        entry = next((e for e in log if e.get("step") == s + 1), None)
        if entry is None:
            raise CheckError(f"{log_path}: no entry for step {s + 1}")
        for key in ("loss", "lr"):
            if key not in entry:
                raise CheckError(f"{log_path}: step {s + 1} has no '{key}'")
        lv, gnorm, lr_ok = replay_step(model, opt, tcfg, batches, entry, s, dev)
        failures += not lr_ok
        rel = abs(lv - entry["loss"]) / abs(entry["loss"])
        ok = rel <= 0.02
        failures += not ok
        worst_step = max(worst_step, rel) if rel == rel else math.inf
        print(f"  {s + 1:5d}  {lv:10.5f}  {entry['loss']:12.5f}  {rel:.2e} {'OK    ' if ok else 'NOT OK'}  "
              f"{gnorm:15.4f}  {entry.get('grad_norm', float('nan')):9.4f}  {entry['lr']:.3e}", flush=True)
    print(f"training: {len(steps)} steps, worst loss rel diff {worst_step:.2e} (<= 2%)", flush=True)
    print(f"{NAME}: PASS" if failures == 0 else f"{NAME}: FAIL ({failures} checks not OK)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        rc = main()
    except Exception as e:
        if not isinstance(e, CheckError):
            traceback.print_exc()
        sys.stderr.flush()
        print(f"{NAME}: FAIL (error: {e})", flush=True)
        rc = 1
    sys.exit(rc)
