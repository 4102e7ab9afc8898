"""GGUF tensor types: what a llama.cpp file stores per block, what the shipped SmolLM2 file
holds, and which type each tensor would get in a Q4_K_M file ("mixed bits per layer type").

    gguf_types.file_tensors()                  # [(name, type, [out, in], params, bytes)] of the shipped GGUF
    gguf_types.summary(gguf_types.file_tensors())  # {type: {"tensors", "params", "bytes"}}
    plan = gguf_types.plan(config, "Q4_K_M")   # {tensor name: type}, llama.cpp's rules
    gguf_types.plan_bytes(config, plan)        # bytes of that layout
    gguf_types.bits_per_weight("Q4_K")         # 4.5: 144 bytes per super-block of 256

Block layouts (``BLOCKS``: weights per block, bytes per block):

- Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: blocks of 32 weights with an fp16 scale (and, for the
  "_1" types, an fp16 minimum): Q4_1 = 2 + 2 + 16 bytes = 5 bits per weight.
- K-quants: super-blocks of 256 weights. Q4_K: an fp16 scale d and minimum dmin for the
  super-block, 8 sub-blocks of 32 each with a 6-bit scale and a 6-bit minimum (12 bytes),
  and 128 bytes of nibbles: 144 bytes, 4.5 bits per weight. Q6_K: 16 sub-blocks of 16 with
  8-bit scales, one fp16 d, 6-bit values: 210 bytes, 6.5625 bits per weight.

``plan`` follows llama.cpp's ``llama_tensor_get_type`` (src/llama-quant.cpp) for the two
file types this course meets, "Q4_1" (the shipped file) and "Q4_K_M", for a llama-style
dense model: the tied embedding gets the output tensor's type (Q6_K, or Q8_0 where its rows
do not fit a block of 256); Q4_K_M gives Q6_K to attn_v and ffn_down in the layers
``use_more_bits`` picks and Q4_K elsewhere; a row length that is not a multiple of a type's
block falls back (Q4_K -> Q5_0, Q6_K -> Q8_0). Invariant: ``plan(config, "Q4_1")`` equals the
shipped file's types tensor for tensor (tests/test_quant_formats.py checks it), and
``BLOCKS`` equals the ``gguf`` package's ``GGML_QUANT_SIZES``.
"""
from __future__ import annotations

from collections import Counter

__all__ = ["BLOCKS", "FALLBACK", "bits_per_weight", "file_tensors", "summary", "tensor_shapes",
           "use_more_bits", "plan", "plan_bytes", "type_counts"]

# type -> (weights per block, bytes per block)
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
          "Q5_1": (32, 24), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
          "Q6_K": (256, 210)}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # when a row is not a multiple of 256
FILE_TYPES = ("Q4_1", "Q4_K_M")


def bits_per_weight(ggml_type: str) -> float:
    """Stored bits per weight of a GGML type, its scales and minimums included."""
    n, nbytes = BLOCKS[ggml_type]
    return nbytes * 8 / n


def file_tensors(path=None) -> list[tuple]:
    """[(name, type, [rows, row length], params, bytes)] for every tensor of a GGUF file
    (default: the shipped SmolLM2 file), as the ``gguf`` package reads them."""
    import gguf

    from minillm.gguf_loader import find_model_path

    reader = gguf.GGUFReader(path or find_model_path())
    out = []
    for t in reader.tensors:
        shape = [int(x) for x in t.shape][::-1]   # GGUF's ne is [in, out]: list it [out, in]
        out.append((t.name, t.tensor_type.name, shape, int(t.n_elements), int(t.n_bytes)))
    return out


def summary(tensors) -> dict:
    """{type: {"tensors", "params", "bytes"}} over (name, type, shape, params[, bytes]) rows;
    bytes are computed from the block layout when a row has none."""
    out: dict = {}
    for row in tensors:
        _, kind, shape, params = row[:4]
        nbytes = row[4] if len(row) > 4 else _bytes(kind, shape)
        acc = out.setdefault(kind, {"tensors": 0, "params": 0, "bytes": 0})
        acc["tensors"] += 1
        acc["params"] += params
        acc["bytes"] += nbytes
    return out


def _bytes(kind: str, shape) -> int:
    n, nbytes = BLOCKS[kind]
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    if cols % n:
        raise ValueError(f"a row of {cols} weights does not fit blocks of {n} ({kind})")
    return rows * (cols // n) * nbytes


def tensor_shapes(config) -> dict:
    """{GGUF tensor name: [out, in]} of a llama-style model with tied embeddings."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    shapes = {"token_embd.weight": [config.vocab_size, h], "output_norm.weight": [h]}
    for i in range(config.num_layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": [h], b + "ffn_norm.weight": [h],
                       b + "attn_q.weight": [config.num_heads * config.head_dim, h],
                       b + "attn_k.weight": [kv, h], b + "attn_v.weight": [kv, h],
                       b + "attn_output.weight": [h, config.num_heads * config.head_dim],
                       b + "ffn_gate.weight": [config.intermediate_size, h],
                       b + "ffn_up.weight": [config.intermediate_size, h],
                       b + "ffn_down.weight": [h, config.intermediate_size]})
    return shapes


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and
    every third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fit(kind: str, cols: int) -> str:
    if cols % BLOCKS[kind][0]:
        kind = FALLBACK.get(kind, kind)
        if cols % BLOCKS[kind][0]:
            return "F16"
    return kind


def plan(config, file_type: str = "Q4_K_M") -> dict:
    """{GGUF tensor name: type} that llama.cpp's quantizer gives a llama-style dense model
    with tied embeddings for `file_type` ("Q4_1" or "Q4_K_M"); norms stay F32."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {FILE_TYPES}, got {file_type!r}")
    base = "Q4_1" if file_type == "Q4_1" else "Q4_K"
    n = config.num_layers
    out = {}
    for name, shape in tensor_shapes(config).items():
        if len(shape) == 1:
            out[name] = "F32"
            continue
        cols = shape[1]
        kind = base
        if name == "token_embd.weight":            # tied: it is also the output matrix
            kind = "Q8_0" if cols % BLOCKS[base][0] else "Q6_K"
        elif file_type == "Q4_K_M" and name.endswith(("attn_v.weight", "ffn_down.weight")):
            i = int(name.split(".")[1])
            kind = "Q6_K" if use_more_bits(i, n) else "Q4_K"
        out[name] = _fit(kind, cols)
    return out


def plan_bytes(config, layout: dict) -> dict:
    """{"bytes", "params", "bits_per_weight", "by_type": summary} of a layout from ``plan``."""
    shapes = tensor_shapes(config)
    rows = []
    for name, kind in layout.items():
        shape = shapes[name]
        params = shape[0] * (shape[1] if len(shape) == 2 else 1)
        rows.append((name, kind, shape, params, _bytes(kind, shape)))
    by_type = summary(rows)
    nbytes = sum(v["bytes"] for v in by_type.values())
    params = sum(v["params"] for v in by_type.values())
    return {"bytes": nbytes, "params": params, "bits_per_weight": nbytes * 8 / params,
            "by_type": by_type}


def type_counts(layout: dict) -> Counter:
    """How many tensors of each type a layout holds."""
    return Counter(layout.values())
