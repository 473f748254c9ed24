#!/usr/bin/env python3
"""PyTorch speed baseline for fp4sim's transformer (issue 4): tokens/s of the same architecture.

The bar of issue 4: fp4sim on an H200 reaches tokens/s >= 1.0x this script's PyTorch number
(torch.compile, fused AdamW, BF16 autocast with FP32 master weights, same architecture and batch)
for the gpt2-124m preset, batch 16 x 1024 tokens:

    python3 validation/torch_gpt_bench.py --config configs/gpt2-124m.json
    python3 validation/torch_gpt_bench.py --check      # 3 steps of configs/tiny.json on the CPU, no compile

The model is built from the preset's "model" section (d_model, layers, heads, KV heads, d_ff,
learned or RoPE positions, LayerNorm or RMSNorm, GELU-tanh or squared ReLU, tied embeddings,
biases), with fp4sim's parameter names and shapes (model/gpt.cpp) and its GPT-2 initialisation;
the optimizer is torch.optim.AdamW(fused=True) with the preset's lr, betas, eps and weight decay
(2+-dimensional tensors only, as model/trainer.cpp), global-norm clipping at train.grad_clip, a
constant learning rate (the schedule does not change the speed). Tokens are synthetic (seeded),
resident on the GPU. One training step = forward (F.scaled_dot_product_attention, is_causal) +
mean cross-entropy + backward + clipping + AdamW + zero_grad.

Measured after --warmup steps (compilation happens there): --repeats runs of --steps steps each,
timed with CUDA events around each step and torch.cuda.synchronize at the end of each run;
tokens/s of a run = steps * batch * seq / run time; reported: the median over runs of tokens/s and
of the mean step time, peak GPU memory (torch.cuda.max_memory_allocated / max_memory_reserved),
and MFU = tokens/s * training_flops_per_token / 989e12 (H200 dense BF16), the FLOP count of
model/config.cpp: 6 * N + 12 * L * T * d, N the parameters without the learned position table.
The last line printed is machine-readable:
    RESULT tokens_per_s=<median> step_ms=<median> peak_mem_gib=<x> mfu=<y>
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

H200_DENSE_BF16_FLOPS = 989e12  # model/config.hpp kH200DenseBf16Flops
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# model/config.hpp defaults (a preset may leave keys out)
MODEL_DEFAULTS = dict(vocab=256, seq_len=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=512,
                      activation="gelu_tanh", norm="layernorm", positions="learned", max_positions=256,
                      tied_embeddings=True, bias=True)
TRAIN_DEFAULTS = dict(batch=8, lr=3e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=1.0, seed=1337)


def load_preset(path):
    """The preset's model and train sections over fp4sim's defaults (nested or dotted keys)."""
    with open(path) as f:
        j = json.load(f)
    flat = {}

    def walk(o, prefix):
        for k, v in o.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                walk(v, key)
            else:
                flat[key] = v

    walk(j, "")
    m, t = dict(MODEL_DEFAULTS), dict(TRAIN_DEFAULTS)
    for k, v in flat.items():
        part, _, name = k.partition(".")
        if part == "model":
            m[name] = v
        elif part == "train" and name in t:
            t[name] = v
    return m, t


def parameter_count(m):
    """model/config.cpp parameter_count (embeddings counted once when tied)."""
    hd = m["d_model"] // m["n_heads"]
    attn = m["d_model"] * (m["d_model"] + 2 * m["n_kv_heads"] * hd) + m["d_model"] * m["d_model"]
    ffn = (3 if m["activation"] == "swiglu" else 2) * m["d_model"] * m["d_ff"]
    norms = (2 if m["norm"] == "layernorm" else 1) * m["d_model"] * 2
    biases = ((m["d_model"] + 2 * m["n_kv_heads"] * hd) + m["d_model"] +
              (2 if m["activation"] == "swiglu" else 1) * m["d_ff"] + m["d_model"]) if m["bias"] else 0
    per_layer = attn + ffn + norms + biases
    emb = m["vocab"] * m["d_model"] * (1 if m["tied_embeddings"] else 2)
    pos = m["max_positions"] * m["d_model"] if m["positions"] == "learned" else 0
    return m["n_layers"] * per_layer + emb + pos + (2 if m["norm"] == "layernorm" else 1) * m["d_model"]


def training_flops_per_token(m):
    """model/config.cpp training_flops_per_token: 6 * N + 12 * L * T * d (N without the position table)."""
    pos = m["max_positions"] * m["d_model"] if m["positions"] == "learned" else 0
    n = parameter_count(m) - pos
    return 6.0 * n + 12.0 * m["n_layers"] * m["seq_len"] * m["d_model"]


class Norm(torch.nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        self.kind = kind
        self.weight = torch.nn.Parameter(torch.ones(c))
        self.bias = torch.nn.Parameter(torch.zeros(c)) if kind == "layernorm" else None

    def forward(self, x):
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, eps=1e-5)
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * self.weight


class Block(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        C, NH, NKV = m["d_model"], m["n_heads"], m["n_kv_heads"]
        self.nh, self.nkv, self.hd = NH, NKV, C // NH
        self.rope = m["positions"] == "rope"
        self.act = m["activation"]
        self.ln_1 = Norm(C, m["norm"])
        self.attn = torch.nn.Module()
        self.attn.c_attn = torch.nn.Linear(C, (NH + 2 * NKV) * self.hd, bias=m["bias"])
        self.attn.c_proj = torch.nn.Linear(C, C, bias=m["bias"])
        self.ln_2 = Norm(C, m["norm"])
        self.mlp = torch.nn.Module()
        self.mlp.c_fc = torch.nn.Linear(C, m["d_ff"], bias=m["bias"])
        self.mlp.c_proj = torch.nn.Linear(m["d_ff"], C, bias=m["bias"])

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        NH, NKV, HD = self.nh, self.nkv, self.hd
        qkv = self.attn.c_attn(self.ln_1(x))
        q = qkv[..., : NH * HD].reshape(B, T, NH, HD)
        k = qkv[..., NH * HD : (NH + NKV) * HD].reshape(B, T, NKV, HD)
        v = qkv[..., (NH + NKV) * HD :].reshape(B, T, NKV, HD)
        if self.rope:  # pairs (2i, 2i+1) rotated by t * 10000^(-2i/HD), as emu::rope_forward
            def rot(u):
                c, s = cos.to(u.dtype), sin.to(u.dtype)  # keep q, k in the autocast dtype of v
                u0, u1 = u[..., 0::2], u[..., 1::2]
                return torch.stack((u0 * c - u1 * s, u0 * s + u1 * c), dim=-1).flatten(-2)
            q, k = rot(q), rot(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if NKV != NH:  # query head h reads KV head h // (NH / NKV)
            k = k.repeat_interleave(NH // NKV, dim=1)
            v = v.repeat_interleave(NH // NKV, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        f = self.mlp.c_fc(self.ln_2(x))
        f = F.gelu(f, approximate="tanh") if self.act == "gelu_tanh" else torch.relu(f).square()
        return x + self.mlp.c_proj(f)


class Gpt(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        if m["activation"] not in ("gelu_tanh", "squared_relu"):
            raise SystemExit(f"model.activation {m['activation']}: not in fp4sim's model (gelu_tanh, squared_relu)")
        self.m = m
        C = m["d_model"]
        self.wte = torch.nn.Embedding(m["vocab"], C)
        self.wpe = torch.nn.Embedding(m["max_positions"], C) if m["positions"] == "learned" else None
        self.h = torch.nn.ModuleList(Block(m) for _ in range(m["n_layers"]))
        self.ln_f = Norm(C, m["norm"])
        self.lm_head = None if m["tied_embeddings"] else torch.nn.Linear(C, m["vocab"], bias=False)
        if m["positions"] == "rope":
            hd = C // m["n_heads"]
            i = torch.arange(hd // 2, dtype=torch.float64)
            ang = torch.arange(m["seq_len"], dtype=torch.float64)[:, None] * (10000.0 ** (-2.0 * i / hd))[None, :]
            self.register_buffer("cos", torch.cos(ang).float()[None, :, None, :], persistent=False)
            self.register_buffer("sin", torch.sin(ang).float()[None, :, None, :], persistent=False)
        else:
            self.cos = self.sin = None
        self.init_weights(m)

    @torch.no_grad()
    def init_weights(self, m):
        # model/gpt.cpp Gpt::init: N(0, 0.02), c_proj weights scaled by 1/sqrt(2 * layers), norms 1, biases 0
        resid = 1.0 / math.sqrt(2.0 * m["n_layers"])
        for name, p in self.named_parameters():
            if ".bias" in name:
                p.zero_()
            elif "ln_" in name and name.endswith(".weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 * (resid if "c_proj.weight" in name else 1.0))

    def forward(self, tok, tgt):
        B, T = tok.shape
        x = self.wte(tok)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=tok.device))[None]
        cos = self.cos[:, :T] if self.cos is not None else None
        sin = self.sin[:, :T] if self.sin is not None else None
        for blk in self.h:
            x = blk(x, cos, sin)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight if self.lm_head is None else self.lm_head.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "gpt2-124m.json"))
    ap.add_argument("--batch", type=int, help="sequences per step (default: the preset's train.batch)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default: the preset's model.seq_len)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (>= 3); the median is reported")
    ap.add_argument("--no-compile", action="store_true", help="eager mode (no torch.compile)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="bf16: autocast to BF16, FP32 master weights; fp32: plain FP32 (no TF32)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--seed", type=int, default=None, help="default: the preset's train.seed")
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--check", action="store_true",
                    help="dry run: configs/tiny.json, CPU, no compile, 3 timed steps (1 per repeat)")
    args = ap.parse_args()
    if args.check:
        args.config = os.path.join(REPO, "configs", "tiny.json")
        args.device, args.no_compile = "cpu", True
        args.steps, args.warmup, args.repeats = 1, 0, 3
    if args.repeats < 3:
        ap.error("--repeats must be >= 3")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")

    m, t = load_preset(args.config)
    B = args.batch or t["batch"]
    T = args.seq or m["seq_len"]
    if m["positions"] == "learned" and T > m["max_positions"]:
        ap.error(f"--seq {T} is longer than the learned positions table ({m['max_positions']})")
    m["seq_len"] = T  # the FLOP count and RoPE tables use the sequence actually run
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    seed = t["seed"] if args.seed is None else args.seed
    torch.manual_seed(seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = args.dtype == "bf16"
        torch.backends.cudnn.allow_tf32 = args.dtype == "bf16"

    model = Gpt(m).to(dev)
    n_torch = sum(p.numel() for p in model.parameters())  # tied wte counted once
    n_fp4sim = parameter_count(m)
    if n_torch != n_fp4sim:
        msg = f"parameter count {n_torch} differs from fp4sim's parameter_count {n_fp4sim}"
        if args.check:
            raise SystemExit("check FAILED: " + msg)
        print("WARNING: " + msg, flush=True)
    flops_tok = training_flops_per_token(m)

    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = cuda
    opt = torch.optim.AdamW(groups, lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"], fused=fused)
    fwd = model if args.no_compile else torch.compile(model)

    # synthetic tokens, seeded, resident on the device: a few distinct batches, cycled
    g = torch.Generator().manual_seed(seed)
    nb = 8
    data = torch.randint(0, m["vocab"], (nb, B, T + 1), generator=g, dtype=torch.int64).to(dev)
    xs = [data[i, :, :-1].contiguous() for i in range(nb)]
    ys = [data[i, :, 1:].contiguous() for i in range(nb)]
    step_no = [0]
    last_loss = [None]

    def step():
        i = step_no[0] % nb
        step_no[0] += 1
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = fwd(xs[i], ys[i])
        loss.backward()
        if t["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, t["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        last_loss[0] = loss.detach()

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(dev) if cuda else 'cpu'}, "
          f"config {os.path.relpath(args.config)}, dtype {args.dtype}, compile {not args.no_compile}, "
          f"fused AdamW {fused}", flush=True)
    print(f"batch {B} x seq {T} = {B * T} tokens/step, parameters {n_torch / 1e6:.3f} M (fp4sim count "
          f"{n_fp4sim / 1e6:.3f} M), {flops_tok / 1e9:.4f} GFLOP/token (6N + 12LTd)", flush=True)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    warm_s = time.perf_counter() - t0
    print(f"warm-up: {args.warmup} steps in {warm_s:.1f} s (compilation included)", flush=True)

    runs = []  # (seconds, [per-step ms])
    for r in range(args.repeats):
        sync()
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
            ev[0].record()
            for s in range(args.steps):
                step()
                ev[s + 1].record()
            sync()
            per = [ev[s].elapsed_time(ev[s + 1]) for s in range(args.steps)]
            total = ev[0].elapsed_time(ev[-1]) / 1e3
        else:
            per = []
            t_run = time.perf_counter()
            for s in range(args.steps):
                ts = time.perf_counter()
                step()
                per.append((time.perf_counter() - ts) * 1e3)
            total = time.perf_counter() - t_run
        loss = float(last_loss[0])
        if not math.isfinite(loss):
            raise SystemExit(f"FAILED: the loss is {loss} in repeat {r + 1}")
        runs.append((total, per))
        print(f"repeat {r + 1}: {args.steps} steps in {total * 1e3:.1f} ms, {total * 1e3 / args.steps:.2f} ms/step, "
              f"{args.steps * B * T / total:,.0f} tokens/s, loss {loss:.4f}", flush=True)

    tok_s = [args.steps * B * T / total for total, _ in runs]
    step_ms = [total * 1e3 / args.steps for total, _ in runs]
    all_steps = [x for _, per in runs for x in per]
    med_tok_s = statistics.median(tok_s)
    med_step_ms = statistics.median(step_ms)
    mfu = med_tok_s * flops_tok / H200_DENSE_BF16_FLOPS
    peak_alloc = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan")
    peak_res = torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else float("nan")

    rows = [
        ("tokens/s (median of repeats)", f"{med_tok_s:,.0f}"),
        ("tokens/s (min .. max)", f"{min(tok_s):,.0f} .. {max(tok_s):,.0f}"),
        ("step time ms (median of repeat means)", f"{med_step_ms:.3f}"),
        ("step time ms (single steps, min / median / max)",
         f"{min(all_steps):.3f} / {statistics.median(all_steps):.3f} / {max(all_steps):.3f}"),
        ("peak memory allocated GiB", f"{peak_alloc:.2f}"),
        ("peak memory reserved GiB", f"{peak_res:.2f}"),
        ("model TFLOP/s (6N + 12LTd)", f"{med_tok_s * flops_tok / 1e12:.1f}"),
        ("MFU vs 989 TFLOP/s", f"{100 * mfu:.2f}%"),
    ]
    w = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    print(flush=True)

    if args.json:
        out = dict(config=os.path.relpath(args.config), model=m, batch=B, seq=T, dtype=args.dtype,
                   compile=not args.no_compile, fused_adamw=fused, device=str(dev),
                   device_name=torch.cuda.get_device_name(dev) if cuda else "cpu", torch=torch.__version__,
                   steps=args.steps, warmup=args.warmup, repeats=args.repeats, params=n_torch,
                   flops_per_token=flops_tok, tokens_per_s=med_tok_s, tokens_per_s_runs=tok_s,
                   step_ms=med_step_ms, step_ms_runs=step_ms, step_ms_all=all_steps,
                   peak_mem_allocated_gib=peak_alloc, peak_mem_reserved_gib=peak_res, mfu=mfu,
                   warmup_s=warm_s)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}", flush=True)
    print(f"RESULT tokens_per_s={med_tok_s:.1f} step_ms={med_step_ms:.3f} peak_mem_gib={peak_alloc:.3f} "
          f"mfu={mfu:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
