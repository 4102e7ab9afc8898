"""`quantize_model`: a quantized copy of a `LlamaModel`, by RTN, GPTQ or AWQ.

Every projection of every layer (q|k|v, o, gate|up, down) becomes a `QuantLinear`; the
embedding stays as it is, and so does the LM head unless `lm_head=True` (see below).

GPTQ and AWQ need calibration activations, and they run layer by layer: the calibration
windows go through the embedding, then through layer 0, which is quantized; its outputs,
computed by the *quantized* layer, are layer 1's inputs, and so on. So each layer is fitted
to the inputs it will really see, errors of the layers before included.

- GPTQ: one pass of the float layer collects each projection's input Hessian H = 2XXᵀ/n;
  then `gptq` rounds each matrix; a second pass through the quantized layer makes the next
  layer's inputs.
- AWQ: `awq.scale_layer` searches and folds the scales, `awq.clip_layer` clips, RTN rounds.

The LM head (tied to the embedding) stays in float by default: it is the one matrix whose
error goes straight into the logits, with no later layer to absorb it, and it is a fifth of
SmolLM2's weights. `lm_head=True` quantizes it like the layers and `lm_head=8` to its own
width (RTN for rtn and awq, GPTQ on the final hidden states for gptq); the embedding then
keeps its float table for lookups, untied. At batch 1 the float head is a large share of
what a w4 step reads (113 of 171 MB for SmolLM2), so the benchmark measures all three.
"""
from __future__ import annotations

import torch

from .. import attention
from . import awq as awq_mod
from .gptq import gptq
from .qlinear import QuantLinear
from .weights import check_bits_and_group, rtn

METHODS = ("rtn", "gptq", "awq")
# The 4-bit layout for the CUDA W4A16 kernel (BENCHMARKS.md, "Int4 layouts for the GPU";
# benchmarks/quant_layouts.py measured the candidates): quantize_model(model, "rtn", 4,
# **GPU_LAYOUT). quantize_model's own default stays g64 asymmetric (the CPU kernels', the
# labs').
GPU_LAYOUT = {"group_size": 64, "sym": False}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
CHUNK = 8  # calibration windows per forward pass (bounds the activation memory)


def projections(layer) -> dict:
    """{name: (parent module, attribute)} for a decoder layer's four projections."""
    return {"qkv_proj": (layer.attn, "qkv_proj"), "o_proj": (layer.attn, "o_proj"),
            "gate_up_proj": (layer.mlp, "gate_up_proj"), "down_proj": (layer.mlp, "down_proj")}


def resolve_group_sizes(model, bits, group_size) -> dict:
    """{projection: group size} for this model, or a ValueError naming what does not fit.

    `group_size` is an int, None (per output channel), or a dict from projection name (and
    optionally "default") to either."""
    layer = model.layers[0]
    if isinstance(group_size, dict):
        unknown = set(group_size) - set(PROJECTIONS) - {"default", "lm_head"}
        if unknown:
            raise ValueError(f"group_size keys must be among {PROJECTIONS + ('lm_head', 'default')}, "
                             f"got {sorted(unknown)}")
        wanted = {name: group_size.get(name, group_size.get("default", 64))
                  for name in PROJECTIONS + ("lm_head",)}
    else:
        wanted = dict.fromkeys(PROJECTIONS + ("lm_head",), group_size)
    sizes = {}
    in_features = {name: getattr(*projections(layer)[name]).in_features for name in PROJECTIONS}
    in_features["lm_head"] = model.config.hidden_size
    bad = []
    for name, g in wanted.items():
        try:
            sizes[name] = check_bits_and_group(bits, g, in_features[name])
        except ValueError as e:
            if "bits" in str(e):
                raise
            bad.append(f"{name} (in_features {in_features[name]})")
    if bad:
        raise ValueError(f"group_size {group_size!r} does not divide the input dimension of "
                         f"{', '.join(bad)}. SmolLM2's hidden size is 576 = 9 x 64, so 64 "
                         f"divides every projection and 128 only down_proj (1536); pass e.g. "
                         f"{{'default': 64, 'down_proj': 128}}, or None for per-channel")
    return sizes


def check_calibration(calibration, vocab_size: int) -> torch.Tensor:
    if (not isinstance(calibration, torch.Tensor) or calibration.dim() != 2
            or calibration.dtype not in (torch.int32, torch.int64) or calibration.numel() == 0):
        got = (f"{calibration.dtype} {tuple(calibration.shape)}"
               if isinstance(calibration, torch.Tensor) else type(calibration).__name__)
        raise ValueError(f"calibration must be token ids [num_windows, seqlen] (an integer "
                         f"tensor, e.g. quant.calibration_windows(tokenizer)), got {got}")
    if int(calibration.min()) < 0 or int(calibration.max()) >= vocab_size:
        raise ValueError(f"calibration token ids must lie in [0, {vocab_size})")
    return calibration.long()


def quantize_model(model, method: str = "rtn", bits: int = 4, group_size=64, sym: bool = False,
                   calibration: torch.Tensor | None = None, progress: bool = True,
                   lm_head: bool = False, percdamp: float = 0.01, blocksize: int = 128,
                   act_order: bool = False):
    """A quantized copy of `model`; `model` itself is never modified.

    method: "rtn", "gptq" or "awq". bits: 2..8. group_size: 64 (default), None for per
    output channel, or a dict per projection (see `resolve_group_sizes`). calibration:
    token ids [num_windows, seqlen] for GPTQ/AWQ (default: `calibration_windows` of the
    SmolLM2 tokenizer, 128 x 512). lm_head: False (float), True, or bits for the head."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(sym, bool):
        raise ValueError(f"sym must be True or False, got {sym!r}")
    sizes = resolve_group_sizes(model, bits, group_size)
    head_bits = bits if lm_head is True else lm_head
    if head_bits is not False:
        if isinstance(head_bits, bool) or not isinstance(head_bits, int):
            raise ValueError(f"lm_head must be False (keep it float), True (quantize it like "
                             f"the layers) or its own bit width 2..8, got {lm_head!r}")
        resolve_group_sizes(model, head_bits, group_size)
    if method != "rtn":
        if calibration is None:
            from ..gguf_loader import load_tokenizer
            from .data import calibration_windows
            calibration = calibration_windows(load_tokenizer())
        calibration = check_calibration(calibration, model.config.vocab_size)

    # Copy without the compiled step and CUDA graphs (they belong to the original).
    qmodel = model.deep_copy()
    qmodel.requires_grad_(False)
    layers = qmodel.layers
    bar = _progress(len(layers) + int(head_bits is not False), f"{method} w{bits}", progress)
    with torch.no_grad():
        if method == "rtn":
            for layer in layers:
                for name, (parent, attr) in projections(layer).items():
                    w = getattr(parent, attr).weight
                    setattr(parent, attr, QuantLinear.from_quantized(
                        rtn(w, bits, sizes[name], sym)))
                bar.update(1)
            hidden = None
        else:
            hidden = _calibrated(qmodel, calibration, method, bits, sizes, sym, bar,
                                 percdamp=percdamp, blocksize=blocksize, act_order=act_order)
        if head_bits is not False:
            w = qmodel.lm_head.weight
            if method == "gptq":
                H = _hessian_of(hidden, qmodel.norm)
                qw = gptq(w, H, head_bits, sizes["lm_head"], sym, percdamp, blocksize, act_order)
            else:
                qw = rtn(w, head_bits, sizes["lm_head"], sym)
            qmodel.lm_head = QuantLinear.from_quantized(qw)
            bar.update(1)
    bar.close()
    qmodel.quantization = {"method": method, "bits": bits, "group_size": sizes, "sym": sym,
                           "lm_head": head_bits}
    return qmodel.eval()


def _progress(total, desc, enabled):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="layer", disable=not enabled)


def _layer_inputs(model, ids):
    positions = torch.arange(ids.shape[1], device=model.rope_cos.device).expand(ids.shape)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    return cos, sin, attention.NoCacheContext(model.attn_backend)


def _chunks(n):
    return [slice(i, min(i + CHUNK, n)) for i in range(0, n, CHUNK)]


def _hessian_of(xs, module):
    """H = 2XXᵀ/n of `module`'s outputs over a list of input chunks, in float64."""
    H, n = None, 0
    for x in xs:
        x = module(x).reshape(-1, x.shape[-1])
        H = _xtx(x) if H is None else H + _xtx(x)
        n += x.shape[0]
    return 2 * H / n


def _xtx(x: torch.Tensor) -> torch.Tensor:
    """XᵀX of x [rows, d] in float64, multiplied in fp32 at least: in a 16-bit model's dtype
    it overflows fp16 (diagonals reach 6e7 on SmolLM2) and is off by ~0.3% in bf16."""
    x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (x.T @ x).double()


def _calibrated(qmodel, calibration, method, bits, sizes, sym, bar, **gptq_args):
    """Quantize `qmodel`'s layers in place, one at a time, on calibration activations.
    Returns the last layer's outputs (list of chunks), for the LM head."""
    calibration = calibration.to(qmodel.embed_tokens.weight.device)  # on the model's device
    chunks = _chunks(len(calibration))
    xs = [qmodel.embed_tokens(calibration[c]) for c in chunks]
    cos, sin, ctx = _layer_inputs(qmodel, calibration[:CHUNK])
    for layer in qmodel.layers:
        def run(x):
            n = x.shape[0]
            return layer(x, cos[:n], sin[:n], ctx, 0)

        projs = projections(layer)
        if method == "gptq":
            H = {name: None for name in projs}
            counts = dict.fromkeys(projs, 0)

            def hook(name):
                def fn(_module, args):
                    x = args[0].reshape(-1, args[0].shape[-1])
                    xtx = _xtx(x)
                    H[name] = xtx if H[name] is None else H[name] + xtx
                    counts[name] += x.shape[0]
                return fn

            hooks = [getattr(p, a).register_forward_pre_hook(hook(name))
                     for name, (p, a) in projs.items()]
            try:
                for x in xs:
                    run(x)
            finally:
                for h in hooks:
                    h.remove()
            for name, (parent, attr) in projs.items():
                Hn = 2 * H[name] / counts[name]
                setattr(parent, attr, QuantLinear.from_quantized(
                    gptq(getattr(parent, attr).weight, Hn, bits, sizes[name], sym, **gptq_args)))
        else:  # awq: scales searched on a sample of the windows, then clip, then RTN
            sample = torch.cat(xs)[:awq_mod.SEARCH_WINDOWS]
            n = sample.shape[0]
            awq_mod.scale_layer(layer, sample, cos[:1].expand(n, -1, -1),
                                sin[:1].expand(n, -1, -1), ctx, bits, sizes, sym)
            awq_mod.clip_layer(layer, sample, cos[:1].expand(n, -1, -1),
                               sin[:1].expand(n, -1, -1), ctx, bits, sizes, sym)
            for name, (parent, attr) in projs.items():
                setattr(parent, attr, QuantLinear.from_quantized(
                    rtn(getattr(parent, attr).weight, bits, sizes[name], sym)))
        xs = [run(x) for x in xs]  # the quantized layer's outputs feed the next layer
        bar.update(1)
    return xs


def weight_bytes(model) -> dict:
    """Bytes of the model's weights: {'per_token', 'stored', 'linears', 'lm_head'}.

    `per_token` is what a batch-1 decode step reads: every weight matrix (packed where
    quantized), the norms, and one embedding row (a lookup reads one row, not the table).
    `stored` is the model's size: every tensor once (a tied embedding counts once)."""
    seen, stored = set(), 0
    for t in list(model.parameters()) + [b for n, b in model.named_buffers()
                                         if not n.startswith("rope_")]:
        if id(t) not in seen:
            seen.add(id(t))
            stored += t.numel() * t.element_size()
    # Packed weights count as saved (fp16 scales, 8-bit zeros), not as held in memory.
    linears, head = 0, 0
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            nbytes = m.nbytes()
            stored += nbytes - sum(b.numel() * b.element_size() for b in m.buffers())
        elif hasattr(m, "weight") and hasattr(m, "in_features"):
            nbytes = m.weight.numel() * m.weight.element_size()
        else:
            continue
        if name == "lm_head":
            head = nbytes
        else:
            linears += nbytes
    norms = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                if type(m).__name__ == "RMSNorm")
    embed = model.embed_tokens.weight
    row = embed.shape[1] * embed.element_size()
    return {"per_token": linears + head + norms + row, "stored": stored, "linears": linears,
            "lm_head": head}
