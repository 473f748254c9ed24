"""fp4sim.torch: PyTorch linear layers whose three GEMMs are fp4sim's (DESIGN.md §9, §15).

    import fp4sim.torch as ft
    ft.replace_linears(model, {"name": "nvfp4", "gemm": "exact"}, seed=0)
    for step, (x, y) in enumerate(batches):
        ft.set_step(model, step)              # the SR streams' (step, micro-batch), as the trainer
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    ft.statistics(model)                      # per-tensor quantization statistics (statistics=True)

Each replaced ``torch.nn.Linear`` becomes an ``fp4sim.torch.Linear`` holding the same weight and
bias Parameters (optimizers and state_dict keys are unchanged). Its forward and backward passes are
the trainer's linear layer (model/linear.hpp: Fprop y = x Wᵀ + b, Dgrad dx = dy W, Wgrad dW = dyᵀ x,
each GEMM in the recipe's format with the copies, RHT, SR and Four Over Six of §9), computed by
fp4sim's C++ code on the tensors' memory: host tensors on the emulator, CUDA tensors on the CUDA
backend, on the tensor's current CUDA stream. The recipe is the ``recipe.*`` keys of an fp4sim
config (docs/cli.md), checked as a config file's; the high-precision rule (§9: the first and last
blocks in BF16 for nvfp4) counts the model's numbered blocks.

Which linear is which: a module named ``...<prefix>.<l>.<rest>`` (the first purely numeric name
component is the block ``l``, e.g. ``h.3.attn.c_attn`` or ``layers.3.mlp.down_proj``) belongs to
block ``l``; its ``linear`` index (the SR stream field and the recipe.override key) is fp4sim's
(0 attn.c_attn, 1 attn.c_proj, 2 mlp.c_fc, 3 mlp.c_proj, 4 mamba.in_proj, 5 mamba.out_proj) where
``<rest>`` is one of those names, else its order among the block's linears (at most 6 a block).
Linears outside numbered blocks (an output head) stay ``torch.nn.Linear``, as fp4sim's head stays
in BF16. ``layout=`` replaces this rule: a function (name) -> (block, linear) or None to keep it.

Activations and weights are float32 (nothing is converted silently: another dtype is a TypeError
naming the layer). The gradients are fp4sim's bits for the given inputs: dweight and dbias as
fp4sim accumulates them from zero over one backward call (torch then adds them to .grad).
"""
import re

import torch

from . import _fp4sim

__all__ = ["Linear", "replace_linears", "set_step", "statistics", "recipe_of"]

# fp4sim's linear indices (model/linear.hpp kLinearNames)
_FP4SIM_LINEARS = {"attn.c_attn": 0, "attn.c_proj": 1, "mlp.c_fc": 2, "mlp.c_proj": 3,
                   "mamba.in_proj": 4, "mamba.out_proj": 5}
_MAX_LINEARS = len(_FP4SIM_LINEARS)


def _capsule(t):
    return torch.utils.dlpack.to_dlpack(t)


def _stream(t):
    """The current CUDA stream of t's device as a cudaStream_t integer (0: the default stream),
    or 0 for host tensors."""
    if t.is_cuda:
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        r = layer._recipe_now()
        shape = x.shape
        if x.dtype != torch.float32 or weight.dtype != torch.float32:
            raise TypeError(f"fp4sim.torch.Linear({layer.fp4sim_name}): x is {x.dtype} and the "
                            f"weight {weight.dtype}; fp4sim's linear takes float32 (cast first)")
        x2 = x.detach().reshape(-1, shape[-1]).contiguous()
        w = weight.detach().contiguous()
        b = None if bias is None else bias.detach().contiguous()
        out = torch.empty((x2.shape[0], w.shape[0]), dtype=torch.float32, device=x.device)
        st = _fp4sim.linear_forward(
            r, _capsule(x2), _capsule(w), None if b is None else _capsule(b), _capsule(out),
            seed=layer.seed, step=layer.step, micro_batch=layer.micro_batch,
            layer=layer.block, linear=layer.linear, name=layer.fp4sim_name,
            statistics=layer.collect_statistics, stream=_stream(x2))
        layer._stats = st
        ctx.save_for_backward(x2, w, b)
        ctx.layer, ctx.recipe, ctx.shape = layer, r, shape
        ctx.ids = (layer.step, layer.micro_batch)
        return out.reshape(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w, b = ctx.saved_tensors
        layer = ctx.layer
        dy2 = dy.reshape(-1, w.shape[0])
        if dy2.dtype != torch.float32:
            raise TypeError(f"fp4sim.torch.Linear({layer.fp4sim_name}): the output gradient is "
                            f"{dy2.dtype}, expected float32")
        dy2 = dy2.contiguous()
        dx = torch.empty_like(x2)
        dw = torch.zeros_like(w)
        db = None if b is None else torch.zeros_like(b)
        st = _fp4sim.linear_backward(
            ctx.recipe, _capsule(dy2), _capsule(x2), _capsule(w),
            None if b is None else _capsule(b), _capsule(dx), _capsule(dw),
            None if db is None else _capsule(db),
            seed=layer.seed, step=ctx.ids[0], micro_batch=ctx.ids[1], layer=layer.block,
            linear=layer.linear, name=layer.fp4sim_name, statistics=layer.collect_statistics,
            stream=_stream(dy2))
        layer._stats = layer._stats + st
        return dx.reshape(ctx.shape), dw, db, None


class Linear(torch.nn.Module):
    """y = x Wᵀ + b through fp4sim's linear layer (its weight [out, in] and bias are nn.Linear's).

    recipe: an ``_fp4sim.Recipe`` (see replace_linears); block, linear: the layer's indices in it;
    seed: train.seed of the SR streams; statistics: collect the per-tensor quantization
    statistics each pass (read with fp4sim.torch.statistics)."""

    def __init__(self, weight, bias, recipe, block, linear, name, seed=0, statistics=False):
        super().__init__()
        if not 0 <= linear < _MAX_LINEARS:
            raise ValueError(f"fp4sim.torch.Linear({name}): linear {linear} outside "
                             f"0..{_MAX_LINEARS - 1}")
        self.weight = weight
        self.bias = bias
        self.recipe = recipe
        self.block, self.linear, self.fp4sim_name = block, linear, name
        self.seed = seed
        self.step, self.micro_batch = 0, 0
        self.collect_statistics = statistics
        self._stats = []
        recipe.linear(block, linear, 0)  # (checks the indices now)

    @property
    def in_features(self):
        return self.weight.shape[1]

    @property
    def out_features(self):
        return self.weight.shape[0]

    def _recipe_now(self):
        return self.recipe.linear(self.block, self.linear, self.step)

    def forward(self, x):
        return _LinearFunction.apply(x, self.weight, self.bias, self)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp4sim={self.fp4sim_name!r}, "
                f"{self._recipe_now()!r}")


def _default_layout(name):
    parts = name.split(".")
    for i, p in enumerate(parts):
        if re.fullmatch(r"\d+", p):
            return int(p), ".".join(parts[i + 1:])
    return None


def replace_linears(model, recipe, *, seed=0, layout=None, statistics=False):
    """Replaces model's torch.nn.Linear modules inside numbered blocks by fp4sim.torch.Linear, in
    place, and returns model. recipe: the recipe.* keys as a dict ({"name": "nvfp4", "gemm":
    "exact", "four_over_six": "weights", ...}: docs/cli.md) or a recipe name ("nvfp4"). seed: the
    SR streams' seed (fp4sim's train.seed). layout: (module name) -> (block, linear) or None (keep
    the module), in place of the rule in this module's docstring. The recipe's unit count (§9's
    high-precision rule, recipe.override keys) is the highest block index + 1."""
    keys = {"name": recipe} if isinstance(recipe, str) else dict(recipe)
    found = []
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear:
            continue
        if layout is not None:
            ids = layout(name)
            if ids is not None:
                found.append((name, mod, int(ids[0]), int(ids[1])))
            continue
        d = _default_layout(name)
        if d is not None:
            found.append((name, mod, d[0], d[1]))
    if not found:
        raise ValueError("fp4sim.torch.replace_linears: no torch.nn.Linear inside a numbered block "
                         "(pass layout= to say which modules to replace)")
    if layout is None:  # fp4sim's indices for its names, else the order within the block
        order = {}
        resolved = []
        for name, mod, block, rest in found:
            if rest in _FP4SIM_LINEARS:
                lin = _FP4SIM_LINEARS[rest]
            else:
                lin = order.get(block, 0)
                order[block] = lin + 1
                if lin >= _MAX_LINEARS:
                    raise ValueError(f"fp4sim.torch.replace_linears: block {block} has more than "
                                     f"{_MAX_LINEARS} linear layers ({name}); pass layout=")
            resolved.append((name, mod, block, lin))
        found = resolved
    seen = {}
    for name, _, block, lin in found:
        if (block, lin) in seen:
            raise ValueError(f"fp4sim.torch.replace_linears: {name} and {seen[(block, lin)]} are "
                             f"both linear {lin} of block {block} (their SR streams would be the "
                             "same); pass layout=")
        seen[(block, lin)] = name
    n_blocks = max(b for _, _, b, _ in found) + 1
    r = _fp4sim.Recipe(keys, n_blocks)
    for name, mod, block, lin in found:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        new = Linear(mod.weight, mod.bias, r, block, lin, f"{name}", seed=seed,
                     statistics=statistics)
        setattr(parent, name.rpartition(".")[2], new)
    return model


def _linears(model):
    return [m for m in model.modules() if isinstance(m, Linear)]


def set_step(model, step, micro_batch=0):
    """The (step, micro-batch) of the next forward pass of every fp4sim linear in model: the SR
    streams' fields (DESIGN.md §3) and the step of the recipe's late BF16 switch. The backward
    pass uses those of its forward pass."""
    if step < 0 or not 0 <= micro_batch < 256:
        raise ValueError(f"fp4sim.torch.set_step: step {step} (>= 0), micro_batch {micro_batch} "
                         "(0..255)")
    for m in _linears(model):
        m.step, m.micro_batch = int(step), int(micro_batch)


def statistics(model):
    """The quantization statistics of the last forward and backward pass of each fp4sim linear
    made with statistics=True (the trainer's recipe.stats_every lines): a list of dicts with
    tensor, amax, saturated, underflow_blocks, rel_error, elements."""
    out = []
    for m in _linears(model):
        out.extend(m._stats)
    return out


def recipe_of(model):
    """{module name: LinearRecipe at its current step} of every fp4sim linear in model."""
    return {m.fp4sim_name: m._recipe_now() for m in _linears(model)}
