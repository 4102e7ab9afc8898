"""EngineConfig: every option of the serving engine, in one frozen dataclass.

    engine = LLMEngine(model, tokenizer, config=EngineConfig(block_size=16, max_num_seqs=32))
    engine = LLMEngine(model, tokenizer, block_size=16, max_num_seqs=32)   # the same

Each value is checked once, here, when the config is built: `EngineConfig(block_size=0)`
raises a ValueError that names the option and what is allowed. The engine, the scheduler,
the block manager and the KV cache all take their sizes from the one config the engine
holds (`engine.config`), so no option has two sources of truth.

The values that depend on the model (`max_model_len` = the model's context length,
`num_blocks` from the memory budget, the `decode_path` this machine supports) may be left
None; `LLMEngine` resolves them and keeps the resolved config (`dataclasses.replace`), so
`engine.config` always says what is in use.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..attention.paged import DECODE_PATHS

SCHEDULING = ("continuous", "static")


@dataclass(frozen=True)
class EngineConfig:
    # KV cache: a pool of num_blocks blocks of block_size token slots each.
    block_size: int = 16
    num_blocks: int | None = None              # None: size the pool from a byte budget
    kv_cache_memory_bytes: int | None = None   # that budget (None: see default_kv_budget_bytes)
    enable_prefix_caching: bool = True
    # Scheduling: per step at most max_num_seqs sequences and max_num_batched_tokens tokens.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    chunked_prefill: bool = True
    scheduling: str = "continuous"             # or "static": the baseline of Lab 05
    # Admission keeps this fraction of the pool free, so that a newly admitted prompt does
    # not take the blocks the running requests need for their next tokens (which would
    # preempt them at once: thrashing). vLLM's default.
    watermark: float = 0.01
    max_model_len: int | None = None           # None: the model's context length
    decode_path: str | None = None             # None: the fastest this machine supports
    max_finished_metrics: int = 10_000         # RequestMetrics kept for finished requests

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_finished_metrics"):
            _check_int(name, getattr(self, name))
        for name in ("num_blocks", "kv_cache_memory_bytes", "max_model_len"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), " or None")
        for name in ("enable_prefix_caching", "chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"EngineConfig.scheduling (the batching policy) must be one of "
                             f"{SCHEDULING}, "
                             f"got {self.scheduling!r}")
        if self.decode_path is not None and self.decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be None (choose) or one of {DECODE_PATHS}, "
                             f"got {self.decode_path!r}")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)) \
                or not 0 <= self.watermark < 1:
            raise ValueError(f"EngineConfig.watermark must be a fraction of the pool in "
                             f"[0, 1), got {self.watermark!r}")

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def watermark_blocks(self) -> int:
        """Blocks that admission leaves free (needs a resolved num_blocks)."""
        return int(self.watermark * (self.num_blocks or 0))


def _check_int(name: str, value, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EngineConfig.{name} must be an int >= 1{extra}, got {value!r}")
