"""minillm: a small, complete LLM inference engine for the workbook."""
import os as _os

import torch as _torch

from .devices import cuda_requested as _cuda_requested

# Triton kernels run through its interpreter where the course does not run on CUDA (no GPU,
# or MINILLM_DEVICE=cpu). The variable must be set before anything imports triton
# (transformers and torch._dynamo do), so set it here.
if not _cuda_requested():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from .config import ModelConfig
from .model import LlamaModel, load_model

__all__ = ["ModelConfig", "LlamaModel", "load_model"]
from .generate import generate, generate_batch, generate_stream
from .kv_cache import KVCache

__all__ += ["generate", "generate_batch", "generate_stream", "KVCache"]
from .engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

__all__ += ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
