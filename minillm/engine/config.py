"""EngineConfig: every option of the serving engine, in one frozen dataclass.

    engine = LLMEngine(model, tokenizer, config=EngineConfig(block_size=16, max_num_seqs=32))
    engine = LLMEngine(model, tokenizer, block_size=16, max_num_seqs=32)   # the same

Each value is checked once, here, when the config is built: `EngineConfig(block_size=0)`
raises a ValueError that names the option and what is allowed. The engine, the scheduler,
the block manager and the KV cache all take their sizes from the one config the engine
holds (`engine.config`), so no option has two sources of truth.

The values that depend on the model (`max_model_len` = the model's context length,
`num_blocks` from the memory budget, the `decode_path` this machine supports, whether decode
steps go through CUDA graphs) may be left None; `LLMEngine` resolves them and keeps the
resolved config (`dataclasses.replace`), so `engine.config` always says what is in use.

Attention (`attn_backend`): the engine's paged attention runs on its own backend, not
necessarily the model's. None resolves to "triton" on CUDA, whatever the model was loaded
with: with the torch backend a decode step gathers K/V into padded tensors, which cannot be
captured, so every step would run eagerly there, bound by its launches (24-36 ms a step
for SmolLM2 on an H100, against ~1 ms replayed). Elsewhere None is the model's own backend.
The model's backend is left as it is (its `generate` and forward keep using it).

CUDA graphs (`minillm.engine.cuda_graph`). `enforce_eager=None` resolves to False (graphs)
on CUDA when the decode path can be captured (the Triton backend), else True. On a CPU it
resolves to True: there is nothing to capture, and padding a batch to its bucket only adds
rows to compute. `enforce_eager=False` on a CPU runs the same padded static decode step
without capture (the CPU tests check it against eager). Decode steps of more than
`max_cudagraph_capture_size` sequences run eagerly (the engine warns once at start if
`max_num_seqs` allows such steps).

Piecewise CUDA graphs (`minillm.engine.piecewise`): prefill and mixed steps replay every op
but attention from graphs captured per token bucket. `piecewise_graphs=None` resolves to
True where decode steps use CUDA graphs on CUDA (`enforce_eager` resolved False), else
False; a value given is honoured whatever `enforce_eager` is. True on a CPU runs the same
padded pieces without capture (for testing, not speed).

Async scheduling (`minillm.engine.overlap`). `async_scheduling=None` resolves to True on
CUDA (the next step is launched before the last one's ids are read back, hiding the host's
work behind the GPU's) and False on a CPU, where there is nothing to overlap with. True on
a CPU runs the same overlapped bookkeeping synchronously (for testing, not speed).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..attention.backends import BACKENDS
from ..attention.paged import DECODE_PATHS

ATTN_BACKENDS = tuple(BACKENDS)

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
    max_num_batched_tokens: int | None = None  # None: 512 on a CPU, 8192 on CUDA (LLMEngine)
    chunked_prefill: bool = True
    scheduling: str = "continuous"             # or "static": the baseline of Lab 05
    # Admission keeps this fraction of the pool free, so that a newly admitted prompt does
    # not take the blocks the running requests need for their next tokens (which would
    # preempt them at once: thrashing). vLLM's default.
    watermark: float = 0.01
    max_model_len: int | None = None           # None: the model's context length
    attn_backend: str | None = None            # None: "triton" on CUDA, else the model's
    decode_path: str | None = None             # None: the fastest this machine supports
    enforce_eager: bool | None = None          # None: CUDA graphs where they apply (above)
    max_cudagraph_capture_size: int = 512      # the largest decode batch with a graph
    piecewise_graphs: bool | None = None       # None: on where decode graphs are, on CUDA
    async_scheduling: bool | None = None       # None: True on CUDA, False on a CPU (above)
    max_finished_metrics: int = 10_000         # RequestMetrics kept for finished requests

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_finished_metrics",
                     "max_cudagraph_capture_size"):
            _check_int(name, getattr(self, name))
        for name in ("num_blocks", "kv_cache_memory_bytes", "max_model_len",
                     "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), " or None")
        for name in ("enable_prefix_caching", "chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"EngineConfig.enforce_eager must be None (CUDA graphs where they "
                             f"apply), True or False, got {self.enforce_eager!r}")
        if self.piecewise_graphs is not None and not isinstance(self.piecewise_graphs, bool):
            raise ValueError(f"EngineConfig.piecewise_graphs must be None (on with CUDA graphs "
                             f"on a GPU), True or False, got {self.piecewise_graphs!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"EngineConfig.async_scheduling must be None (on where there is a "
                             f"GPU), True or False, got {self.async_scheduling!r}")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"EngineConfig.scheduling (the batching policy) must be one of "
                             f"{SCHEDULING}, "
                             f"got {self.scheduling!r}")
        if self.attn_backend is not None and self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"EngineConfig.attn_backend must be None (Triton on CUDA, else the "
                             f"model's) or one of {ATTN_BACKENDS}, got {self.attn_backend!r}")
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

    def pool_fit_error(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request could never run in this pool even alone, or None if it fits (needs
        a resolved num_blocks). It may need the K/V of prompt + max_tokens - 1 tokens (the
        last token is sampled, never computed). The one rule both the engine's
        `add_request` and the server's admission apply."""
        need = num_prompt_tokens + max_tokens - 1
        blocks = -(-need // self.block_size)
        if blocks <= self.num_blocks:
            return None
        return (f"this request needs up to {blocks} KV blocks of {self.block_size} tokens "
                f"(prompt {num_prompt_tokens} + max_tokens {max_tokens} - 1) but the whole "
                f"pool has {self.num_blocks}: it could never run; shorten the prompt, lower "
                f"max_tokens, or give the engine more blocks (num_blocks / "
                f"kv_cache_memory_bytes)")


def _check_int(name: str, value, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EngineConfig.{name} must be an int >= 1{extra}, got {value!r}")
