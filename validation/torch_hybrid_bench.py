#!/usr/bin/env python3
"""PyTorch speed baseline for fp4sim's hybrid Mamba-2/Transformer model: tokens/s of the same model.

The hybrid counterpart of torch_gpt_bench.py: the model of an fp4sim config with a model.pattern
('M' Mamba-2, '*' attention, '-' MLP; DESIGN.md §11-§12), trained as a PyTorch user would train
it: FP32 master weights, BF16 autocast, F.scaled_dot_product_attention(is_causal=True), the
chunked SSD of torch_ssd.py (einsums per chunk, chunk model.mamba_chunk), torch.optim.AdamW
(fused=True), torch.compile (default mode) on the whole model, synthetic tokens:

    python3 validation/torch_hybrid_bench.py --config configs/nemotron-h-small.json            # batch 8 x 1024
    python3 validation/torch_hybrid_bench.py --config configs/nemotron-h-small.json --no-compile  # eager
    python3 validation/torch_hybrid_bench.py --check    # 3 steps of a tiny built-in hybrid on the CPU, eager

Parameters carry fp4sim's names (blocks.<i>.mamba.in_proj.weight, ...; the conv weight is
nn.Conv1d's [C, 1, W] where fp4sim stores [C, W]) and DESIGN.md §12's initialisation (linear
weights N(0, 0.02), c_proj and out_proj scaled by 1/sqrt(blocks), dt log-uniform in [1e-3, 1e-1]
through dt_bias, A_log = log U[1, 16], D = 1, norm weights 1, the conv as nn.Conv1d's default).
AdamW uses the preset's lr, betas, eps and weight decay (2+-dimensional tensors only, as
model/trainer.cpp), global-norm clipping at train.grad_clip, a constant learning rate. Attention
with GQA: the KV heads repeat_interleave'd to the query heads (--gqa expand, as
torch_gpt_bench.py) or SDPA's enable_gqa (--gqa native, PyTorch 2.5+).
One training step = forward + mean cross-entropy + backward + clipping + AdamW + zero_grad.

Measured as torch_gpt_bench.py measures: after --warmup untimed steps (compilation happens
there), --repeats runs of --steps steps, CUDA events around each step, a synchronize at the end of
each run; tokens/s of a run = steps * batch * seq / run time; reported: the median over runs of
tokens/s and of the mean step time, peak GPU memory (torch.cuda.max_memory_allocated, whole
process), and MFU = tokens/s * (6 N + 12 L_attn T d) / 989e12 (the parameter term plus the
attention blocks' score and value products; the SSD's own products are not counted).
The last line printed is one JSON object, e.g.
    {"bench": "torch_hybrid_bench", "tokens_per_s": 123456.7, "step_ms": 66.4, "peak_mem_gib": 20.1, ...}
(`tail -1 LOG | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])'`).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_ssd  # noqa: E402
from torch_gpt_bench import H200_DENSE_BF16_FLOPS, load_preset  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --check's model: the shape of configs/nemotron-h-tiny.json
TINY = dict(vocab=256, seq_len=128, d_model=128, pattern="M-M*-M-", n_heads=4, n_kv_heads=2, d_ff=512,
            activation="squared_relu", norm="rmsnorm", positions="none", tied_embeddings=False, bias=False,
            mamba_expand=2, mamba_head_dim=16, mamba_groups=2, mamba_state=16, mamba_conv=4, mamba_chunk=64)
TINY_TRAIN = dict(batch=4)


def fail(msg):
    print(f"torch_hybrid_bench: error: {msg}", file=sys.stderr, flush=True)
    print(json.dumps({"bench": "torch_hybrid_bench", "error": msg}), flush=True)
    sys.exit(1)


def sdpa(q, k, v, gqa_native):
    """Causal attention on (B, heads, T, HD); k and v may have fewer heads (GQA)."""
    if hasattr(F, "scaled_dot_product_attention"):
        if gqa_native:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if k.shape[1] != q.shape[1]:  # query head h reads KV head h // (NH / NKV)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # PyTorch before 2.0 (--check on Debian's 1.13 only): the formula written out
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(s.float().masked_fill(mask, float("-inf")), dim=-1).to(v.dtype) @ v


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


class Attention(torch.nn.Module):
    def __init__(self, m, gqa_native):
        super().__init__()
        C, NH, NKV = m["d_model"], m["n_heads"], m["n_kv_heads"]
        self.nh, self.nkv, self.hd, self.gqa_native = NH, NKV, C // NH, gqa_native
        self.rope = m["positions"] == "rope"
        self.c_attn = torch.nn.Linear(C, (NH + 2 * NKV) * self.hd, bias=m["bias"])
        self.c_proj = torch.nn.Linear(C, C, bias=m["bias"])

    def forward(self, h, cos, sin):
        B, T, C = h.shape
        NH, NKV, HD = self.nh, self.nkv, self.hd
        qkv = self.c_attn(h)
        q = qkv[..., : NH * HD].reshape(B, T, NH, HD)
        k = qkv[..., NH * HD : (NH + NKV) * HD].reshape(B, T, NKV, HD)
        v = qkv[..., (NH + NKV) * HD :].reshape(B, T, NKV, HD)
        if self.rope:  # pairs (2i, 2i+1) rotated by t * 10000^(-2i/HD), as emu::rope_forward
            def rot(u):
                c, s = cos.to(u.dtype), sin.to(u.dtype)
                u0, u1 = u[..., 0::2], u[..., 1::2]
                return torch.stack((u0 * c - u1 * s, u0 * s + u1 * c), dim=-1).flatten(-2)
            q, k = rot(q), rot(k)
        y = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.gqa_native)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Mlp(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.act = m["activation"]
        self.c_fc = torch.nn.Linear(m["d_model"], m["d_ff"], bias=m["bias"])
        self.c_proj = torch.nn.Linear(m["d_ff"], m["d_model"], bias=m["bias"])

    def forward(self, h):
        f = self.c_fc(h)
        f = F.gelu(f, approximate="tanh") if self.act == "gelu_tanh" else torch.relu(f).square()
        return self.c_proj(f)


class Mamba2(torch.nn.Module):
    """DESIGN.md §12's mixer: in_proj -> [z | x | B | C | dt], causal depthwise conv + SiLU over
    [x | B | C], softplus dt (float32), chunked SSD, gated grouped RMSNorm (float32), out_proj."""

    def __init__(self, dims):
        super().__init__()
        d = self.d = dims
        self.in_proj = torch.nn.Linear(d.D, d.in_width, bias=False)
        self.conv = torch.nn.Conv1d(d.conv_ch, d.conv_ch, d.W, groups=d.conv_ch, padding=d.W - 1, bias=True)
        self.dt_bias = torch.nn.Parameter(torch.empty(d.H))
        self.A_log = torch.nn.Parameter(torch.empty(d.H))
        self.D = torch.nn.Parameter(torch.ones(d.H))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(d.d_inner))
        self.out_proj = torch.nn.Linear(d.d_inner, d.D, bias=False)

    def forward(self, h):
        d = self.d
        b, T, _ = h.shape
        z, xbc, dt_raw = torch.split(self.in_proj(h), [d.d_inner, d.conv_ch, d.H], dim=-1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :T].transpose(1, 2))
        x, Bm, Cm = torch.split(xbc, [d.d_inner, d.GN, d.GN], dim=-1)
        dt = F.softplus(dt_raw.float() + self.dt_bias)
        A = -torch.exp(self.A_log.float())
        y = torch_ssd.ssd_chunked(x.reshape(b, T, d.H, d.P), dt, A, Bm.reshape(b, T, d.G, d.N),
                                  Cm.reshape(b, T, d.G, d.N), self.D, d.Q)
        y = torch_ssd.gated_rmsnorm(y.reshape(b, T, d.d_inner), z, self.norm.weight, d.G)
        return self.out_proj(y)


class Block(torch.nn.Module):
    def __init__(self, kind, m, dims, gqa_native):
        super().__init__()
        self.kind = kind
        self.norm = Norm(m["d_model"], m["norm"])
        if kind == "*":
            self.attn = Attention(m, gqa_native)
        elif kind == "-":
            self.mlp = Mlp(m)
        else:
            self.mamba = Mamba2(dims)

    def forward(self, x, cos, sin):
        h = self.norm(x)
        if self.kind == "*":
            return x + self.attn(h, cos, sin)
        if self.kind == "-":
            return x + self.mlp(h)
        return x + self.mamba(h)


class Hybrid(torch.nn.Module):
    def __init__(self, m, dims, gqa_native):
        super().__init__()
        C = m["d_model"]
        self.wte = torch.nn.Embedding(m["vocab"], C)
        self.wpe = torch.nn.Embedding(m["max_positions"], C) if m["positions"] == "learned" else None
        self.blocks = torch.nn.ModuleList(Block(k, m, dims, gqa_native) for k in m["pattern"])
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
        self.init_weights(len(m["pattern"]))

    @torch.no_grad()
    def init_weights(self, n_blocks):
        resid = 1.0 / math.sqrt(n_blocks)  # fp4sim's pattern models: one factor per residual add
        for name, p in self.named_parameters():
            if name.endswith("conv.weight") or name.endswith("conv.bias"):
                continue  # nn.Conv1d's default
            if name.endswith("dt_bias"):
                dt = torch.exp(torch.rand_like(p) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0)))
            elif name.endswith(".D") or name.endswith("norm.weight") or name == "ln_f.weight":
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                scaled = name.endswith("c_proj.weight") or name.endswith("out_proj.weight")
                p.normal_(0.0, 0.02 * (resid if scaled else 1.0))

    def forward(self, tok, tgt):
        T = tok.shape[1]
        x = self.wte(tok)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=tok.device))[None]
        cos = self.cos[:, :T] if self.cos is not None else None
        sin = self.sin[:, :T] if self.sin is not None else None
        for blk in self.blocks:
            x = blk(x, cos, sin)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight if self.lm_head is None else self.lm_head.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))


def resolve_model(m, source):
    """Checks the model section; returns the Mamba sizes (None without an 'M' block)."""
    pat = m.get("pattern", "")
    if not isinstance(pat, str) or not pat:
        fail(f"{source}: model.pattern is missing or empty (torch_gpt_bench.py benchmarks the GPT presets)")
    bad = sorted(set(pat) - set("M*-"))
    if bad:
        fail(f"{source}: model.pattern {pat!r} has block characters {bad} (known: M, *, -)")
    if m["activation"] not in ("gelu_tanh", "squared_relu"):
        fail(f"{source}: model.activation {m['activation']}: this model has gelu_tanh and squared_relu")
    if m["positions"] not in ("none", "learned", "rope"):
        fail(f"{source}: model.positions {m['positions']}: not none, learned or rope")
    if m["d_model"] % m["n_heads"] or m["n_heads"] % m["n_kv_heads"]:
        fail(f"{source}: d_model {m['d_model']}, n_heads {m['n_heads']}, n_kv_heads {m['n_kv_heads']}: d_model must "
             "be a multiple of n_heads and n_heads of n_kv_heads")
    if "M" not in pat:
        return None
    try:
        return torch_ssd.MambaDims(m)
    except (KeyError, ValueError) as e:
        fail(f"{source}: {e.args[0]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="the last line printed is one JSON object (tokens_per_s, step_ms, peak_mem_gib, ...)")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "nemotron-h-small.json"),
                    help="an fp4sim config with a model.pattern (default: configs/nemotron-h-small.json)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (>= 3); the median is reported")
    ap.add_argument("--no-compile", action="store_true", help="eager mode (no torch.compile)")
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode (default: default)")
    ap.add_argument("--gqa", choices=["expand", "native"], default="expand",
                    help="GQA attention: repeat_interleave the KV heads (expand) or SDPA's enable_gqa (native)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="bf16: autocast to BF16, FP32 master weights; fp32: plain FP32 (no TF32)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--seed", type=int, default=None, help="default: the preset's train.seed")
    ap.add_argument("--json", help="also write the results, with every run and step time, to this JSON file")
    ap.add_argument("--check", action="store_true",
                    help="dry run: a tiny built-in hybrid (M-M*-M-), batch 4 x 128, CPU, no compile, 3 timed steps")
    args = ap.parse_args()
    if args.check:
        args.device, args.no_compile = "cpu", True
        args.steps, args.warmup, args.repeats = 1, 0, 3
        args.batch, args.seq = TINY_TRAIN["batch"], TINY["seq_len"]
    if args.repeats < 3:
        ap.error("--repeats must be >= 3")
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 1:
        ap.error("--steps, --batch and --seq must be >= 1 and --warmup >= 0")

    if args.check:
        source = "built-in tiny hybrid"
        m, t = load_preset_from_dict(TINY)
    else:
        source = args.config
        if not os.path.isfile(args.config):
            fail(f"{args.config}: no such config file")
        try:
            m, t = load_preset(args.config)
        except (OSError, ValueError) as e:
            fail(f"{args.config}: cannot read it ({e})")
    dims = resolve_model(m, source)
    B, T = args.batch, args.seq
    if m["positions"] == "learned" and T > m["max_positions"]:
        ap.error(f"--seq {T} is longer than the learned positions table ({m['max_positions']})")
    m["seq_len"] = T  # the FLOP count and RoPE tables use the sequence actually run
    m["n_layers"] = len(m["pattern"])  # (fp4sim sets it from the pattern)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    seed = t["seed"] if args.seed is None else args.seed
    torch.manual_seed(seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = args.dtype == "bf16"
        torch.backends.cudnn.allow_tf32 = args.dtype == "bf16"
    gqa_native = args.gqa == "native"
    if gqa_native:
        try:
            q = torch.zeros(1, 2, 4, 8, device=dev)
            F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], is_causal=True, enable_gqa=True)
        except (TypeError, AttributeError, RuntimeError) as e:
            fail(f"--gqa native: this PyTorch ({torch.__version__}) has no SDPA enable_gqa ({e}); use --gqa expand")

    model = Hybrid(m, dims, gqa_native).to(dev)
    if args.check:
        check_against_reference(model, m, dims)
    n_params = sum(p.numel() for p in model.parameters())
    pos = m["max_positions"] * m["d_model"] if m["positions"] == "learned" else 0
    n_attn = m["pattern"].count("*")
    flops_tok = 6.0 * (n_params - pos) + 12.0 * n_attn * T * m["d_model"]

    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = cuda
    extra = {"fused": True} if fused else {}
    opt = torch.optim.AdamW(groups, lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"], **extra)
    if args.no_compile:
        fwd = model
    else:
        if not hasattr(torch, "compile"):
            fail(f"this PyTorch ({torch.__version__}) has no torch.compile; use --no-compile")
        fwd = torch.compile(model, mode=args.compile_mode)

    g = torch.Generator().manual_seed(seed)
    nb = 8  # a few distinct batches of synthetic tokens, resident on the device, cycled
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

    dev_name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"torch {torch.__version__}, device {dev_name}, config {source}, dtype {args.dtype}, "
          f"compile {'off' if args.no_compile else args.compile_mode}, gqa {args.gqa}, fused AdamW {fused}", flush=True)
    print(f"model {json.dumps(m, sort_keys=True)}", flush=True)
    if dims is not None:
        print(f"mamba: d_inner {dims.d_inner}, heads {dims.H} x head dim {dims.P}, groups {dims.G}, state {dims.N}, "
              f"conv {dims.W}, chunk {dims.Q} ({-(-T // dims.Q)} chunks of the sequence)", flush=True)
    print(f"pattern {m['pattern']} ({len(m['pattern'])} blocks: {m['pattern'].count('M')} M, {n_attn} *, "
          f"{m['pattern'].count('-')} -), batch {B} x seq {T} = {B * T} tokens/step, parameters {n_params / 1e6:.3f} M, "
          f"{flops_tok / 1e9:.4f} GFLOP/token (6N + 12 L_attn T d)", flush=True)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    warm_s = time.perf_counter() - t0
    if args.warmup:
        loss0 = float(last_loss[0])
        if not math.isfinite(loss0):
            fail(f"the loss is {loss0} after the warm-up")
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
            fail(f"the loss is {loss} in repeat {r + 1}")
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
        ("model TFLOP/s (6N + 12 L_attn T d)", f"{med_tok_s * flops_tok / 1e12:.1f}"),
        ("MFU vs 989 TFLOP/s", f"{100 * mfu:.2f}%"),
    ]
    w = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    print(flush=True)

    def num(x):  # JSON has no NaN: null for the CPU's memory figures
        return x if math.isfinite(x) else None

    summary = dict(bench="torch_hybrid_bench", config=source, pattern=m["pattern"], batch=B, seq=T, dtype=args.dtype,
                   compile=not args.no_compile, compile_mode=None if args.no_compile else args.compile_mode,
                   gqa=args.gqa, fused_adamw=fused, device=dev_name, torch=torch.__version__, params=n_params,
                   tokens_per_s=round(med_tok_s, 1), runs_tokens_per_s=[round(x, 1) for x in tok_s],
                   step_ms=round(med_step_ms, 3),
                   peak_mem_gib=num(round(peak_alloc, 3)), peak_mem_reserved_gib=num(round(peak_res, 3)),
                   mfu=round(mfu, 5), warmup_s=round(warm_s, 1), steps=args.steps, repeats=args.repeats)
    if args.json:
        full = dict(summary, model=m, flops_per_token=flops_tok, tokens_per_s_runs=tok_s, step_ms_runs=step_ms,
                    step_ms_all=all_steps, warmup=args.warmup)
        with open(args.json, "w") as f:
            json.dump(full, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}", flush=True)
    print(json.dumps(summary), flush=True)
    return 0


def check_against_reference(model, m, dims):
    """--check: the SSD self-test, fp4sim's parameter names and shapes, and the loss of
    torch_hybrid_check.py's model (the PyTorch reference) on the same weights, eager FP32."""
    import torch_hybrid_check as ref

    if torch_ssd.self_test(verbose=False):
        fail("check FAILED: torch_ssd.self_test (chunked SSD != sequential)")
    want = ref.expected_shapes(m, dims)

    def fp4sim_name(k):  # nn.Embedding's weight: fp4sim's wte, wpe
        return k[: -len(".weight")] if k in ("wte.weight", "wpe.weight") else k

    got = {fp4sim_name(k): list(p.shape) for k, p in model.named_parameters()}
    for k, shape in got.items():
        if k.endswith("mamba.conv.weight"):  # nn.Conv1d's [C, 1, W], fp4sim's [C, W]
            got[k] = [shape[0], shape[2]]
    if got != want:
        fail(f"check FAILED: parameters differ from fp4sim's: only here {sorted(set(got) - set(want))}, "
             f"only in fp4sim {sorted(set(want) - set(got))}, "
             f"shapes {[(k, got[k], want[k]) for k in sorted(set(got) & set(want)) if got[k] != want[k]]}")
    weights = {fp4sim_name(k): p.detach().reshape(want[fp4sim_name(k)]).clone() for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(7)
    tok = torch.randint(0, m["vocab"], (2, m["seq_len"] + 1), generator=g)
    with torch.no_grad():
        a = float(model(tok[:, :-1], tok[:, 1:]))
        b = float(ref.Hybrid(m, dims, weights, "sequential")(tok[:, :-1], tok[:, 1:]))
    if not abs(a - b) <= 1e-5 * abs(b):
        fail(f"check FAILED: loss {a} differs from torch_hybrid_check.py's model ({b}) on the same weights")
    print(f"check: SSD self-test PASS, {len(want)} tensors named and shaped as fp4sim's, FP32 loss {a:.6f} "
          f"== the reference model's {b:.6f}", flush=True)


def load_preset_from_dict(model):
    """load_preset's result for a built-in model section (through a temporary file, so the
    defaults are filled in exactly as for a config file)."""
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model}, f)
    try:
        return load_preset(f.name)
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    sys.exit(main())
