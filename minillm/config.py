"""Model configuration: the numbers that fully describe a Llama-style decoder.

`ModelConfig` is frozen so a config can be shared by a model, its KV caches and the
calculator without anyone mutating it underneath them. Presets:

- `ModelConfig.smollm2_135m()`: the real model the labs run (SmolLM2-135M-Instruct).
- `ModelConfig.tiny(...)`: a few-hundred-kilobyte random-weight model for fast tests,
  with the same structure (GQA, tied embeddings, SwiGLU) so every code path is exercised.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "custom"

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each KV head serves a whole group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    # Derived sizes ------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count (`minillm.calc`'s formula, piece by piece). Tied embeddings are
        counted once."""
        from . import calc
        d, L = self.hidden_size, self.num_layers
        layer = (calc.attention_params(d, self.num_heads, self.num_kv_heads, self.head_dim)
                 + calc.swiglu_params(d, self.intermediate_size))
        total = L * layer + calc.norm_params(d, L)
        if include_embedding:
            total += calc.embedding_params(self.vocab_size, d, self.tie_word_embeddings)
        return total

    def kv_bytes_per_token(self, dtype_bytes: float = 4) -> float:
        """K and V, every layer (`calc.kv_cache_bytes_per_token`, the one formula)."""
        from . import calc
        return calc.kv_cache_bytes_per_token(self.num_layers, self.num_kv_heads,
                                             self.head_dim, dtype_bytes)

    # Presets ------------------------------------------------------------------------
    @classmethod
    def smollm2_135m(cls) -> "ModelConfig":
        return cls(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
            num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
            rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, name="SmolLM2-135M-Instruct")

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A small random-weight config: 2 layers, GQA 4/2, vocab 128."""
        base = cls(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
            rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, name="tiny")
        return replace(base, **overrides)
