"""AWQ (Lin et al., 2023): protect the weights that meet large activations by scaling them up
before rounding, and fold the inverse scale into the layer before, so the math is unchanged.

For y = W x, scaling input channel j of W by s_j and dividing x_j by s_j changes nothing in
exact arithmetic, but rounding W·s then dividing by s shrinks the rounding error of channel j
by s_j. Channels whose activations are large matter most to the output, so

    s = mean|x|^α, normalised (s / sqrt(max s · min s)),  α from {0, 0.05, …, 0.95}

and each α is scored by the output error of the whole block the scaled weights feed (the
attention for q|k|v, the MLP for gate|up, down_proj itself for down), measured on
calibration activations. α = 0 is plain RTN, so the search never does worse on its data.

Where 1/s goes (the fold), so no extra op runs at inference:
- q|k|v: into `input_norm`'s weight (the RMSNorm that produces their input);
- gate|up: into `post_attention_norm`'s weight;
- down: into the up rows of gate|up (down's input is silu(gate) · up, linear in up).
v → o is not scaled here: with grouped-query attention v_proj has 3 heads of 64 and o_proj
reads 9 (each v head serves 3 query heads), so o's input channels are not v's output rows
one to one, and no single per-channel scale folds through.

Then a clip search (`clip_search`): for each group, shrink the range to m · (1 − i/20),
i < 10, keeping the m that minimises that group's share of the output error. Skipped for
q and k, whose error reaches the output only through softmax(q·kᵀ), where the per-group
output proxy is a poor guide. Finally RTN on the scaled, clipped weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .weights import rtn

GRID = 20            # α ∈ {0, 0.05, …, 0.95}
CLIP_GRID = 20       # shrink steps of 1/20
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 512    # tokens the clip search scores on (as AutoAWQ)
SEARCH_WINDOWS = 8   # calibration windows the scale search scores on (8 x 512 tokens)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """RTN then dequantize: the weight the quantized layer will compute with."""
    return rtn(w, bits, group_size, sym).dequantize(w.dtype)


def normalised_scales(act_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    s = act_mean.clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scale(weights: list[torch.Tensor], act_mean: torch.Tensor, block, reference,
                 bits: int, group_size: int, sym: bool, grid: int = GRID):
    """The best (s, α, errors) for the matrices `weights` (each [out, in], sharing one input
    whose per-channel mean |x| is `act_mean`). `block(ws)` runs the block with those weights
    swapped in and returns its output; `reference` is its fp output."""
    errors = []
    best = (None, None, float("inf"))
    for i in range(grid):
        alpha = i / grid
        s = normalised_scales(act_mean, alpha)
        trial = [fake_quantize(w * s, bits, group_size, sym) / s for w in weights]
        err = (block(trial) - reference).float().pow(2).mean().item()  # fp16 would overflow
        errors.append(err)
        if err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1], errors


@torch.no_grad()
def clip_search(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, sym: bool,
                grid: int = CLIP_GRID, max_shrink: float = CLIP_MAX_SHRINK,
                oc_batch: int = 256) -> torch.Tensor:
    """Per-(row, group) clip ranges for `w` [out, in] given inputs x [tokens, in]: returns
    max_val [out, groups]; clamp each group to ±max_val before quantizing."""
    out_features, in_features = w.shape
    G = in_features // group_size
    w = w.float()  # squared output errors overflow fp16 and round coarsely in bf16
    xg = x.float().reshape(-1, G, group_size)                 # [T, G, g]
    best = torch.empty(out_features, G, device=w.device)
    for o0 in range(0, out_features, oc_batch):
        wg = w[o0:o0 + oc_batch].reshape(-1, G, group_size)    # [o, G, g]
        org_max = wg.abs().amax(-1)                            # [o, G]
        ref = torch.einsum("tgk,ogk->otg", xg, wg)
        best_err = torch.full_like(org_max, float("inf"))
        best_max = org_max.clone()
        for i in range(int(max_shrink * grid)):
            m = org_max * (1 - i / grid)
            clipped = torch.maximum(torch.minimum(wg, m[..., None]), -m[..., None])
            q = fake_quantize(clipped.reshape(-1, in_features), bits, group_size, sym)
            out = torch.einsum("tgk,ogk->otg", xg, q.reshape(-1, G, group_size))
            err = (out - ref).pow(2).mean(1)                   # [o, G]
            better = err < best_err
            best_err[better], best_max[better] = err[better], m[better]
        best[o0:o0 + oc_batch] = best_max
    return best


def apply_clip(w: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    m = max_val.repeat_interleave(group_size, dim=1)
    return torch.maximum(torch.minimum(w, m), -m)


@torch.no_grad()
def scale_layer(layer, x: torch.Tensor, cos, sin, ctx, bits: int, group_sizes: dict,
                sym: bool) -> dict:
    """Search and fold AWQ's three scales into one `DecoderLayer` (float `Linear`s), given
    its input hidden states x [B, T, d]. Exact in fp32: the layer computes the same outputs.
    Returns the chosen α per projection and the search's errors."""
    attn, mlp = layer.attn, layer.mlp
    inter = mlp.intermediate_size
    a = layer.input_norm(x)
    attn_ref = attn(a, cos, sin, ctx, 0)
    h = x + attn_ref
    m = layer.post_attention_norm(h)
    gate_up = mlp.gate_up_proj(m)
    d_in = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    mlp_ref = mlp.down_proj(d_in)

    def with_weight(linear, w, fn):
        old = linear.weight
        linear.weight = torch.nn.Parameter(w, requires_grad=False)
        try:
            return fn()
        finally:
            linear.weight = old

    def mean_abs(t):
        return t.reshape(-1, t.shape[-1]).abs().mean(0)

    report = {}
    # q|k|v, scored by the attention block's output; folded into input_norm.
    s, alpha, errs = search_scale(
        [attn.qkv_proj.weight], mean_abs(a),
        lambda ws: with_weight(attn.qkv_proj, ws[0], lambda: attn(a, cos, sin, ctx, 0)),
        attn_ref, bits, group_sizes["qkv_proj"], sym)
    layer.input_norm.weight.div_(s)
    attn.qkv_proj.weight.mul_(s)
    report["qkv_proj"] = {"alpha": alpha, "errors": errs}
    # gate|up, scored by the MLP's output; folded into post_attention_norm.
    s, alpha, errs = search_scale(
        [mlp.gate_up_proj.weight], mean_abs(m),
        lambda ws: with_weight(mlp.gate_up_proj, ws[0], lambda: mlp(m)),
        mlp_ref, bits, group_sizes["gate_up_proj"], sym)
    layer.post_attention_norm.weight.div_(s)
    mlp.gate_up_proj.weight.mul_(s)
    report["gate_up_proj"] = {"alpha": alpha, "errors": errs}
    # down, scored by its own output; folded into the up rows of gate|up.
    s, alpha, errs = search_scale(
        [mlp.down_proj.weight], mean_abs(d_in),
        lambda ws: F.linear(d_in, ws[0]), mlp_ref, bits, group_sizes["down_proj"], sym)
    mlp.gate_up_proj.weight[inter:].div_(s[:, None])
    mlp.down_proj.weight.mul_(s)
    report["down_proj"] = {"alpha": alpha, "errors": errs}
    return report


@torch.no_grad()
def clip_layer(layer, x: torch.Tensor, cos, sin, ctx, bits: int, group_sizes: dict,
               sym: bool, tokens: int = CLIP_TOKENS) -> None:
    """AWQ's clip search on a (scaled) layer's v rows, o, gate|up and down, in place."""
    attn, mlp, c = layer.attn, layer.mlp, layer.attn.config
    inputs = {}
    hooks = [getattr(mod, name).register_forward_pre_hook(
                 lambda _m, args, key=name: inputs.__setitem__(key, args[0]))
             for mod, name in ((attn, "qkv_proj"), (attn, "o_proj"),
                               (mlp, "gate_up_proj"), (mlp, "down_proj"))]
    try:
        layer(x, cos, sin, ctx, 0)
    finally:
        for hk in hooks:
            hk.remove()
    for mod, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"),
                      (mlp, "down_proj")):
        lin = getattr(mod, name)
        xs = inputs[name].reshape(-1, lin.in_features)
        xs = xs[torch.linspace(0, len(xs) - 1, min(tokens, len(xs))).long()]
        g = group_sizes[name]
        rows = slice(c.q_size + c.kv_size, None) if name == "qkv_proj" else slice(None)
        w = lin.weight[rows]
        lin.weight[rows] = apply_clip(w, clip_search(w, xs, bits, g, sym), g)
