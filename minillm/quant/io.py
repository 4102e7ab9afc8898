"""Save and load a quantized model as one safetensors file.

The file holds every tensor of the model by its state_dict name: float tensors as they are,
and for each `QuantLinear` its packed `qweight` (uint8, two int4 per byte), `scales` as
fp16 and `zeros` as uint8. The metadata (strings, as safetensors wants) carries the model
config and each quantized module's bits, group size and symmetry, so `load` rebuilds the
same modules. A tied LM head is stored once (as the embedding).

Round trip exact: scales are fp16 values by construction and zeros are small integers, so
loading gives back the same tensors bit for bit (tested).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from .qlinear import QuantLinear


def save(model, path: str | os.PathLike) -> int:
    """Write `model` to `path` (a .safetensors file); returns its size in bytes."""
    from safetensors.torch import save_file

    tensors, layers = {}, {}
    tied = (model.config.tie_word_embeddings
            and getattr(model.lm_head, "weight", None) is model.embed_tokens.weight)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            layers[name] = {"bits": m.bits, "group_size": m.group_size, "sym": m.sym,
                            "in_features": m.in_features, "out_features": m.out_features}
            tensors[f"{name}.qweight"] = m.qweight
            tensors[f"{name}.scales"] = m.scales.half()
            tensors[f"{name}.zeros"] = m.zeros.to(torch.uint8)
    for name, t in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in layers or (tied and name == "lm_head.weight"):
            continue
        tensors[name] = t
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {"config": json.dumps(asdict(model.config)), "quantized": json.dumps(layers),
            "quantization": json.dumps(getattr(model, "quantization", {})),
            "tied": json.dumps(bool(tied)), "format": "minillm-quant-1"}
    save_file(tensors, str(path), metadata=meta)
    return os.path.getsize(path)


def load(path: str | os.PathLike, attn_backend="torch"):
    """The model saved by `save` (on the CPU, eval mode, no gradients)."""
    from safetensors import safe_open

    from ..config import ModelConfig
    from ..model import LlamaModel, rope_cos_sin

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != "minillm-quant-1":
            raise ValueError(f"{path} is not a minillm quantized model (no 'minillm-quant-1' "
                             f"format tag in its metadata)")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    config = ModelConfig(**json.loads(meta["config"]))
    with torch.device("meta"):
        model = LlamaModel(config, attn_backend=attn_backend)
    for name, spec in json.loads(meta["quantized"]).items():
        parent_name, attr = name.rsplit(".", 1) if "." in name else ("", name)
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, QuantLinear(
            spec["in_features"], spec["out_features"], spec["bits"], spec["group_size"],
            spec["sym"], tensors.pop(f"{name}.qweight"), tensors.pop(f"{name}.scales").float(),
            tensors.pop(f"{name}.zeros").float()))
    result = model.load_state_dict(tensors, strict=False, assign=True)
    tied = json.loads(meta["tied"])
    missing = set(result.missing_keys) - ({"lm_head.weight"} if tied else set())
    missing = {k for k in missing if not k.rsplit(".", 1)[0] in json.loads(meta["quantized"])}
    if missing or result.unexpected_keys:
        raise ValueError(f"{path} does not match the model: missing {sorted(missing)}, "
                         f"unexpected {sorted(result.unexpected_keys)}")
    if tied:
        model.tie_weights()
    cos, sin = rope_cos_sin(config.head_dim, config.max_position_embeddings, config.rope_theta)
    model.rope_cos, model.rope_sin = cos, sin
    model.quantization = json.loads(meta["quantization"])
    return model.eval().requires_grad_(False)
