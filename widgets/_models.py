"""The model shapes the widgets' memory formulas need: ``ModelSpec``, the presets the
labs compare (SmolLM2-135M, Llama-3-8B, Llama-2-70B), and bytes per element of a dtype.

The numbers come from ``minillm.calc`` and ``minillm.config``, so a widget and the book
cannot disagree about a model's size.
"""
from __future__ import annotations

import dataclasses

from minillm import calc
from minillm.config import ModelConfig

__all__ = ["ModelSpec", "MODEL_PRESETS", "display_name", "model_spec", "dtype_bytes"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the memory formulas need about a model. ``num_params`` of the 7B/70B presets are
    the nominal sizes the book's arithmetic uses (70B fp16 = 140 GB)."""

    name: str
    num_params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int

    @classmethod
    def from_config(cls, config: ModelConfig, name: str | None = None) -> "ModelSpec":
        return cls(name or config.name, float(config.num_params()), config.num_layers,
                   config.num_heads, config.num_kv_heads, config.head_dim,
                   config.max_position_embeddings)

    def kv_bytes_per_token(self, dtype_bytes: float, num_kv_heads: int | None = None) -> float:
        return calc.kv_cache_bytes_per_token(self.num_layers, num_kv_heads or self.num_kv_heads,
                                             self.head_dim, dtype_bytes)


MODEL_PRESETS: dict[str, ModelSpec] = {
    "SmolLM2-135M": ModelSpec.from_config(ModelConfig.smollm2_135m(), "SmolLM2-135M"),
    "Llama-3-8B": ModelSpec("Llama-3-8B", 8.0e9, 32, 32, 8, 128, 8192),
    "Llama-2-70B": ModelSpec("Llama-2-70B", 70e9, 80, 64, 8, 128, 4096),
}


def display_name(name: str, num_params: float | None = None) -> str:
    """A preset's short name when ``num_params`` matches it (within 1%), else ``name``.

    The GGUF file names SmolLM2 "Smollm2 135M 8k Lc100K Mix1 Ep2"; figures say "SmolLM2-135M".
    """
    if num_params:
        for key, spec in MODEL_PRESETS.items():
            if abs(spec.num_params - num_params) <= 0.01 * spec.num_params:
                return key
    return name


def model_spec(model) -> ModelSpec:
    """A preset name, a ``ModelSpec`` or a ``ModelConfig`` -> ``ModelSpec``."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, ModelConfig):
        return ModelSpec.from_config(model)
    if model in MODEL_PRESETS:
        return MODEL_PRESETS[model]
    raise ValueError(f"model must be one of {list(MODEL_PRESETS)}, a ModelSpec or a "
                     f"minillm.ModelConfig; got {model!r}.")


def dtype_bytes(dtype: str) -> float:
    """'fp16' -> 2 (see ``calc.DTYPE_BYTES``)."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in calc.DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(calc.DTYPE_BYTES)}; got {dtype!r}.")
    return calc.DTYPE_BYTES[key]
