"""ServeConfig: every option of the HTTP server, in one frozen dataclass, checked once.

The engine options (`max_num_seqs`, `num_blocks`, `max_num_batched_tokens`, `block_size`)
are passed through to `EngineConfig`; `device` and `dtype` choose where and in what the
model is loaded (None: `minillm.devices.default_device()` and its default dtype, bf16 on
CUDA and fp32 on a CPU); the others belong to the HTTP layer: where to listen,
how many requests may wait before the server sheds load, how long a SIGTERM drain may take,
how long `/health` waits for its one-token generation, how many tokens a streamed SSE event
carries by default (`stream_tokens_per_event`: buffering), and how long one engine step may
run before the liveness probe (`/health/live`) reports the engine loop stalled.
"""
from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, fields

MODEL_NAME = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16", "float16")
ATTN_BACKENDS = ("torch", "triton")
DEVICE_TEXT = re.compile(r"^(cpu|cuda)(:\d+)?$")
MAX_BODY_BYTES = 1 << 20  # 1 MiB


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 16                  # engine: sequences per step
    max_queue_len: int = 64                 # waiting requests before new ones get 503
    num_blocks: int | None = None           # engine: KV blocks (None: sized from memory)
    block_size: int = 16
    max_num_batched_tokens: int | None = None  # engine: tokens per step (None: 512 on a
                                               # CPU, 8192 on CUDA: LLMEngine decides)
    drain_timeout_s: float = 30.0           # SIGTERM: how long in-flight requests may run on
    health_timeout_s: float = 30.0          # GET /health: the one-token generation's deadline
    default_max_tokens: int = 256           # chat completions without max_tokens
    max_n: int = 8                          # the largest `n` a request may ask for
    retry_after_s: int = 1                  # the Retry-After header of a 503
    stream_tokens_per_event: int = 1        # SSE buffering: tokens per event (the first alone)
    stall_timeout_s: float = 60.0           # /health/live fails once a step runs this long
    model_name: str = MODEL_NAME
    device: str | None = None               # cpu, cuda, cuda:N; None: the default device
    dtype: str | None = None                # float32, bfloat16, float16; None: the device's
    attn_backend: str | None = None         # engine: torch, triton; None: triton on CUDA
                                            # (its steps replay graphs), else the model's

    def __post_init__(self):
        for name in ("max_num_seqs", "max_queue_len", "block_size",
                     "default_max_tokens", "max_n", "retry_after_s", "stream_tokens_per_event"):
            _check_int(name, getattr(self, name), 1)
        _check_int("port", self.port, 0, 65535)
        for name in ("num_blocks", "max_num_batched_tokens"):  # None: the engine sizes it
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name in ("drain_timeout_s", "health_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ServeConfig.{name} must be a number of seconds > 0, "
                                 f"got {value!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"ServeConfig.host must be a host name or address, got {self.host!r}")
        if self.device is not None and not (isinstance(self.device, str)
                                            and DEVICE_TEXT.match(self.device.strip().lower())):
            raise ValueError(f"ServeConfig.device must be cpu, cuda or cuda:N (or None for the "
                             f"default device), got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"ServeConfig.dtype must be one of {DTYPES} (or None for the "
                             f"device's default), got {self.dtype!r}")
        if self.attn_backend is not None and self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"ServeConfig.attn_backend must be one of {ATTN_BACKENDS} (or None: "
                             f"triton on CUDA, else the model's), got {self.attn_backend!r}")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"ServeConfig.model_name must be a non-empty str, "
                             f"got {self.model_name!r}")

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def load_options(self) -> dict:
        """`load_model`'s device and dtype (None: the defaults)."""
        import torch
        return {"device": self.device,
                "dtype": None if self.dtype is None else getattr(torch, self.dtype)}

    def cli_args(self) -> list[str]:
        """`python -m minillm serve`'s flags for this config's options (all but host and
        model_name; None leaves the server's default), e.g. ["--port", "8000", ...]: what a
        child process (`ServerProcess`) or a Kubernetes container (`k8s.deployment`) runs."""
        args = []
        for name in ("port", "max_num_seqs", "max_queue_len", "num_blocks", "block_size",
                     "max_num_batched_tokens", "drain_timeout_s", "health_timeout_s",
                     "default_max_tokens", "max_n", "retry_after_s", "stream_tokens_per_event",
                     "stall_timeout_s", "device", "dtype", "attn_backend"):
            value = getattr(self, name)
            if value is not None:
                args += ["--" + name.removesuffix("_s").replace("_", "-"), str(value)]
        return args

    def engine_options(self) -> dict:
        """The EngineConfig options this config carries."""
        return {"max_num_seqs": self.max_num_seqs, "num_blocks": self.num_blocks,
                "block_size": self.block_size,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "attn_backend": self.attn_backend}


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo \
            or (hi is not None and value > hi):
        allowed = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"ServeConfig.{name} must be an int {allowed}, got {value!r}")


def is_loopback(host: str) -> bool:
    """True for localhost and any loopback address (127.0.0.0/8, ::1)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
