#!/usr/bin/env python3
"""Mamba-2 mixer in plain PyTorch (DESIGN.md §12), shared by torch_hybrid_check.py and
torch_hybrid_bench.py; no fp4sim code.

Shapes: x (b, T, H, P), dt (b, T, H) (after the softplus), A (H,) (negative), B and C (b, T, G, N),
D (H,); head h reads group g = h // (H / G) of B and C. The SSM, per batch and head:
    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * (x_t outer B_t)      (S is P x N, S_{-1} = 0)
    y_t = S_t C_t + D_h x_t
Two implementations:
  - ssd_sequential: the recurrence above, one time step at a time (the definition; slow);
  - ssd_chunked: the chunked SSD algorithm (Mamba-2's "state space duality"): within a chunk of Q
    steps the output is a masked (Q x Q) matmul, C B^T weighted by the decays exp(cumsum
    differences); each chunk's final state is passed to the next chunks by a second, small (chunks
    x chunks) decay matmul. T need not be a multiple of Q: the sequence is padded with dt = 0 and
    x = B = C = 0 at its end, which changes nothing before it, and the padding is cut off again.
B and C are expanded to their heads (repeat_interleave by H / G) before the einsums; the minimal
SSD listing's einsums contract a group axis and are right for G = 1 only.

`python3 validation/torch_ssd.py` runs self_test(): chunked == sequential in float64 (forward and
autograd gradients) on small shapes with G > 1 and partial chunks, and the causal conv against
its formula; the last line says PASS or FAIL.
"""
import math
import sys

import torch
import torch.nn.functional as F


def ssd_sequential(x, dt, A, B, C, D):
    """The recurrence of DESIGN.md §12, step by step (autograd differentiates through the loop)."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    Bh = B.repeat_interleave(H // G, dim=2)  # (b, T, H, N)
    Ch = C.repeat_interleave(H // G, dim=2)
    S = x.new_zeros(b, H, P, N)
    ys = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A)  # (b, H)
        S = decay[:, :, None, None] * S + dt[:, t, :, None, None] * (x[:, t, :, :, None] * Bh[:, t, :, None, :])
        ys.append((S * Ch[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1)


def _causal_decay(cs):
    """exp(cs[..., i] - cs[..., j]) for i >= j, 0 above the diagonal; cs (..., L) -> (..., L, L).
    The difference is masked with -inf before the exp (exp of a positive difference could
    overflow, and inf * 0 would poison the backward pass)."""
    L = cs.shape[-1]
    diff = cs[..., :, None] - cs[..., None, :]
    keep = torch.ones(L, L, dtype=torch.bool, device=cs.device).tril()
    return torch.exp(diff.masked_fill(~keep, float("-inf")))


def ssd_chunked(x, dt, A, B, C, D, chunk):
    """The chunked SSD; same arguments and result as ssd_sequential, plus the chunk length Q.
    The decays (dt * A, their cumulative sums and exps) are computed in float32 or wider (the
    dtype of dt); the einsums run in the inputs' dtype (BF16 under autocast)."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    Q = int(chunk)
    if Q < 1:
        raise ValueError(f"ssd_chunked: chunk {chunk} must be >= 1")
    if H % G:
        raise ValueError(f"ssd_chunked: heads {H} not a multiple of groups {G}")
    nc = (T + Q - 1) // Q
    pad = nc * Q - T
    x_in = x
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    Bh = B.repeat_interleave(H // G, dim=2).reshape(b, nc, Q, H, N)
    Ch = C.repeat_interleave(H // G, dim=2).reshape(b, nc, Q, H, N)
    X = (x * dt[..., None].to(x.dtype)).reshape(b, nc, Q, H, P)  # dt_t x_t, the state's input
    a = (dt * A).reshape(b, nc, Q, H).permute(0, 3, 1, 2)  # (b, H, nc, Q): log decay per step
    acs = torch.cumsum(a, dim=-1)  # within each chunk
    # 1. inside each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(acs_l - acs_s) X_s
    L = _causal_decay(acs)  # (b, H, nc, Q, Q)
    scores = torch.einsum("bclhn,bcshn->bhcls", Ch, Bh)
    y_diag = torch.einsum("bhcls,bcshp->bclhp", (scores * L).to(X.dtype), X)
    # 2. each chunk's own final state: sum_s exp(acs_last - acs_s) X_s outer B_s
    to_end = torch.exp(acs[..., -1:] - acs)  # (b, H, nc, Q)
    Bd = Bh * to_end.permute(0, 2, 3, 1)[..., None].to(Bh.dtype)
    states = torch.einsum("bclhn,bclhp->bchpn", Bd, X)  # (b, nc, H, P, N)
    # 3. the state entering chunk z: sum over earlier chunks c of their states decayed through
    # chunks c+1 .. z-1 (a (nc+1) x (nc+1) causal decay matrix over the chunk totals)
    totals = F.pad(acs[..., -1], (1, 0))  # (b, H, nc + 1), a leading 0 for the zero initial state
    between = _causal_decay(torch.cumsum(totals, dim=-1))  # (b, H, nc + 1, nc + 1)
    states = torch.cat([states.new_zeros(b, 1, H, P, N), states], dim=1)
    entering = torch.einsum("bhzc,bchpn->bzhpn", between.to(states.dtype), states)[:, :nc]
    # 4. the entering state's contribution inside each chunk: exp(acs_l) C_l . S_in
    y_off = torch.einsum("bclhn,bchpn->bclhp", Ch, entering)
    y_off = y_off * torch.exp(acs).permute(0, 2, 3, 1)[..., None].to(y_off.dtype)
    y = (y_diag + y_off).reshape(b, nc * Q, H, P)[:, :T]
    return y + D[:, None].to(y.dtype) * x_in


def causal_conv(u, weight, bias):
    """Depthwise causal conv1d over time: u (b, T, ch), weight (ch, W), bias (ch,);
    y_t = bias + sum_{k=0..W-1} weight[:, k] * u_{t-W+1+k} (zero before the start)."""
    T, ch, W = u.shape[1], u.shape[2], weight.shape[1]
    y = F.conv1d(u.transpose(1, 2), weight[:, None, :], bias, padding=W - 1, groups=ch)
    return y[..., :T].transpose(1, 2)


def _at_least_f32(dtype):
    """float64 stays float64 (the self-test), anything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gated_rmsnorm(y, z, weight, groups, eps=1e-5):
    """Mamba-2's RMSNormGated (norm after the gate): rmsnorm(y * silu(z)) over `groups` groups
    of channels, times weight; computed in float32 (or wider)."""
    dt = _at_least_f32(y.dtype)
    g = y.to(dt) * F.silu(z.to(dt))
    shape = g.shape
    g = g.reshape(*shape[:-1], groups, shape[-1] // groups)
    g = g * torch.rsqrt((g * g).mean(-1, keepdim=True) + eps)
    return g.reshape(shape) * weight


class MambaDims:
    """The mixer's sizes from a config's model section (fp4sim's key names)."""

    KEYS = ("mamba_expand", "mamba_head_dim", "mamba_groups", "mamba_state", "mamba_conv", "mamba_chunk")

    def __init__(self, m):
        missing = [k for k in self.KEYS if k not in m]
        if missing:
            raise KeyError(f"the model section has an 'M' block but no {', '.join(missing)}")
        self.D = int(m["d_model"])
        self.e = int(m["mamba_expand"])
        self.P = int(m["mamba_head_dim"])
        self.G = int(m["mamba_groups"])
        self.N = int(m["mamba_state"])
        self.W = int(m["mamba_conv"])
        self.Q = int(m["mamba_chunk"])
        self.d_inner = self.e * self.D
        if self.P < 1 or self.d_inner % self.P:
            raise ValueError(f"d_inner {self.d_inner} (mamba_expand {self.e} x d_model {self.D}) is not a multiple "
                             f"of mamba_head_dim {self.P}")
        self.H = self.d_inner // self.P
        if self.G < 1 or self.H % self.G:
            raise ValueError(f"heads {self.H} (d_inner / mamba_head_dim) not a multiple of mamba_groups {self.G}")
        if self.N < 1 or self.W < 1 or self.Q < 1:
            raise ValueError(f"mamba_state {self.N}, mamba_conv {self.W}, mamba_chunk {self.Q} must be >= 1")
        self.GN = self.G * self.N
        self.conv_ch = self.d_inner + 2 * self.GN
        self.in_width = 2 * self.d_inner + 2 * self.GN + self.H

    def shapes(self, prefix):
        """fp4sim's tensors of one M block's mixer: name -> shape."""
        return {prefix + "in_proj.weight": [self.in_width, self.D],
                prefix + "conv.weight": [self.conv_ch, self.W],
                prefix + "conv.bias": [self.conv_ch],
                prefix + "dt_bias": [self.H],
                prefix + "A_log": [self.H],
                prefix + "D": [self.H],
                prefix + "norm.weight": [self.d_inner],
                prefix + "out_proj.weight": [self.D, self.d_inner]}


def mamba_mixer(h, w, dims, ssd="chunked"):
    """The M block's mixer on h (b, T, D) (the block's normed input). w(name) returns the tensor
    <prefix>name (in_proj.weight, conv.weight, ...); ssd: 'chunked' or 'sequential'."""
    d = dims
    b, T, _ = h.shape
    zxbcdt = F.linear(h, w("in_proj.weight"))
    z, xbc, dt_raw = torch.split(zxbcdt, [d.d_inner, d.conv_ch, d.H], dim=-1)
    xbc = F.silu(causal_conv(xbc, w("conv.weight"), w("conv.bias")))
    x, Bm, Cm = torch.split(xbc, [d.d_inner, d.GN, d.GN], dim=-1)
    f32 = _at_least_f32(h.dtype)
    dt = F.softplus(dt_raw.to(f32) + w("dt_bias"))  # threshold 20: u itself above it
    A = -torch.exp(w("A_log").to(f32))
    x = x.reshape(b, T, d.H, d.P)
    Bm = Bm.reshape(b, T, d.G, d.N)
    Cm = Cm.reshape(b, T, d.G, d.N)
    if ssd == "sequential":
        y = ssd_sequential(x, dt.to(x.dtype), A.to(x.dtype), Bm, Cm, w("D").to(x.dtype))
    else:
        y = ssd_chunked(x, dt, A, Bm, Cm, w("D"), d.Q)
    y = gated_rmsnorm(y.reshape(b, T, d.d_inner), z, w("norm.weight"), d.G)
    return F.linear(y.to(h.dtype), w("out_proj.weight"))


def _rel(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


def self_test(verbose=True, tol=1e-10):
    """ssd_chunked == ssd_sequential (float64, forward and gradients), causal_conv == its formula.
    Returns the number of failed cases; prints one line per case when verbose."""
    cases = [  # b, T, H, P, G, N, Q
        (2, 37, 4, 3, 2, 5, 8),   # G > 1, partial last chunk
        (1, 32, 4, 2, 1, 3, 8),   # G = 1, whole chunks
        (2, 5, 6, 2, 3, 4, 16),   # one partial chunk (T < Q)
        (1, 24, 4, 3, 4, 2, 5),   # G = H (a group per head), partial chunk
        (2, 16, 2, 4, 2, 6, 1),   # Q = 1
        (1, 20, 8, 2, 2, 3, 20),  # G > 1, exactly one chunk
    ]
    gen = torch.Generator().manual_seed(1234)
    failed = 0
    for (b, T, H, P, G, N, Q) in cases:
        f64 = dict(dtype=torch.float64)
        x = torch.randn(b, T, H, P, generator=gen, **f64).requires_grad_()
        dt = F.softplus(torch.randn(b, T, H, generator=gen, **f64) - 1.0).detach().requires_grad_()
        A = (-torch.exp(torch.rand(H, generator=gen, **f64) * math.log(16.0))).detach().requires_grad_()
        Bm = torch.randn(b, T, G, N, generator=gen, **f64).requires_grad_()
        Cm = torch.randn(b, T, G, N, generator=gen, **f64).requires_grad_()
        D = torch.randn(H, generator=gen, **f64).requires_grad_()
        ins = (x, dt, A, Bm, Cm, D)
        gy = torch.randn(b, T, H, P, generator=gen, **f64)
        y_s = ssd_sequential(*ins)
        g_s = torch.autograd.grad(y_s, ins, gy)
        y_c = ssd_chunked(*ins, Q)
        g_c = torch.autograd.grad(y_c, ins, gy)
        errs = [_rel(y_c, y_s)] + [_rel(a, s) for a, s in zip(g_c, g_s)]
        ok = all(e <= tol for e in errs)
        failed += not ok
        if verbose:
            names = ["y", "dx", "ddt", "dA", "dB", "dC", "dD"]
            print(f"  ssd b={b} T={T} H={H} P={P} G={G} N={N} Q={Q}: max rel diff "
                  + " ".join(f"{n} {e:.1e}" for n, e in zip(names, errs)) + ("  OK" if ok else "  NOT OK"), flush=True)
    # the causal conv against its formula, with a partial window at the start
    b, T, ch, W = 2, 9, 5, 4
    u = torch.randn(b, T, ch, generator=gen, dtype=torch.float64)
    wt = torch.randn(ch, W, generator=gen, dtype=torch.float64)
    bs = torch.randn(ch, generator=gen, dtype=torch.float64)
    want = bs.expand(b, T, ch).clone()
    for t in range(T):
        for k in range(W):
            s = t - W + 1 + k
            if s >= 0:
                want[:, t] += wt[:, k] * u[:, s]
    e = _rel(causal_conv(u, wt, bs), want)
    ok = e <= tol
    failed += not ok
    if verbose:
        print(f"  causal conv b={b} T={T} ch={ch} W={W}: max rel diff {e:.1e}" + ("  OK" if ok else "  NOT OK"), flush=True)
    return failed


if __name__ == "__main__":
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    n = self_test()
    print("torch_ssd self-test: PASS" if n == 0 else f"torch_ssd self-test: FAIL ({n} cases not OK)", flush=True)
    sys.exit(1 if n else 0)
