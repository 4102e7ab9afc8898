"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings.

    x = embed(ids)
    for each layer:  x = x + Attn(RMSNorm(x));  x = x + MLP(RMSNorm(x))
    h = RMSNorm(x)                         hidden_states()
    logits = lm_head(h)                    compute_logits(): lm_head shares embed's weight

`model(input_ids[B, T]) -> logits[B, T, V]` runs the whole sequence with no cache. Callers
that keep a cache pass `positions` and an attention context (see `minillm.attention`),
which decides where K/V live and which backend computes attention. Callers that need the
logits of a few rows only (the serving engine) call `hidden_states`, pick the rows, then
`compute_logits` on those.

Every weight product goes through a `minillm.layers.Linear` (the four projections of each
layer and the LM head), so quantized or sharded linears replace modules, not this file.

Two fusions keep batch-1 decode close to the memory roofline on a CPU: q|k|v is one matrix
(`qkv_proj`) and gate|up is one matrix (`gate_up_proj`), so each layer does four matrix
products instead of seven. The math is unchanged. The elementwise glue between the products
(RMSNorm, the residual add and the norm after it, RoPE, SiLU·up) goes through
`minillm.layers.fused`: one C++ pass per group on a CPU, one Triton kernel per group on
CUDA (eager), the plain PyTorch ops elsewhere. The model's loop leaves each layer's last
residual add open (`DecoderLayer.forward_open`) for the next layer's norm to add in its
pass; `layer(x)` alone still returns the sum. A context that owns a cache may hand each
layer a `fused.KVWrite` (`ctx.kv_write(layer)`): RoPE then stores the layer's K/V in the
same pass, and `attend` is told so (`kv_stored=True`). A decode step on CUDA goes one step
further: each norm runs inside the weight product that reads it, SiLU·up inside down's,
and RoPE with the K/V store inside q|k|v's (`fused.norm_linear`, `fused.silu_mul_linear`,
`fused.norm_linear_rope`: the decode GEMV), five kernels a layer.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .attention import NoCacheContext, get_backend
from .config import ModelConfig
from .layers import Linear, cpu_linear, fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, device=None):
    """RoPE tables [max_positions, head_dim] in fp32, laid out for `apply_rope`.

    Frequency i (of head_dim / 2) rotates the pair (x[i], x[i + D/2]) by angle pos * w_i. The
    tables repeat each angle in both halves and fold the rotation's sign into `sin`:
    cos = [cos, cos], sin = [-sin, sin].
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)
                                / head_dim))
    angles = torch.arange(max_positions, device=device, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1).float(), torch.cat([-sin, sin], -1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + D/2]) pair by its position's angle (half-split form):

        (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)

    x: [B, T, H, D]; cos/sin: [B, T, D] from `rope_cos_sin`, gathered at each token's
    position. Three ops, not ten: a decode step calls this once per layer.
    """
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # (x1, x2) -> (x2, x1)
    return torch.addcmul(x * c, swapped, s).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size)
        self.o_proj = Linear(config.q_size, config.hidden_size)

    def qkv(self, x, cos, sin, kv_write=None):
        """Project and rotate: q [B,T,Hq,D], k/v [B,T,Hkv,D]. With kv_write (a
        `fused.KVWrite` from the attention context), k and v are also stored in the cache.
        Exposed for Lab 02."""
        return self.rotate(self.qkv_proj(x), cos, sin, kv_write)

    def rotate(self, qkv, cos, sin, kv_write=None):
        """q, k, v from q|k|v's projection [B, T, q_size + 2 kv_size], RoPE applied."""
        c = self.config
        heads = self._heads(qkv)
        n = c.num_heads + c.num_kv_heads
        if fused.rope_(heads, n, cos, sin, kv_write) is not None:  # in place, in one pass
            return self._split(heads)
        # Rotate q and k heads in one call (fewer small ops per decode step).
        qk = apply_rope(heads[:, :, :n], cos, sin)
        q, k, v = qk[:, :, :c.num_heads], qk[:, :, c.num_heads:], heads[:, :, n:]
        if kv_write is not None:
            kv_write.store(k, v)
        return q, k, v

    def _heads(self, qkv):
        """q|k|v's projection [B, T, q_size + 2 kv_size] as heads [B, T, Hq + 2 Hkv, D]."""
        c = self.config
        return qkv.view(*qkv.shape[:2], c.num_heads + 2 * c.num_kv_heads, c.head_dim)

    def _split(self, heads):
        c = self.config
        n = c.num_heads + c.num_kv_heads
        return heads[:, :, :c.num_heads], heads[:, :, c.num_heads:n], heads[:, :, n:]

    def forward(self, x, cos, sin, ctx, layer_idx: int):
        return self.attend(self.qkv_proj(x), cos, sin, ctx, layer_idx)

    def attend(self, qkv, cos, sin, ctx, layer_idx: int):
        """Attention from q|k|v's projection on: RoPE, the cache, attention, o_proj."""
        return self._attend(qkv, cos, sin, ctx, layer_idx, ctx.kv_write(layer_idx), False)

    def norm_attend(self, x, delta, norm, cos, sin, ctx, layer_idx: int):
        """(s, attention of norm(s)) with s = x + delta (delta None: s = x): the input norm,
        q|k|v's product, RoPE, the K/V store, attention, o_proj. For a decode step on CUDA
        the first four are one kernel (`fused.norm_linear_rope`: the decode GEMV)."""
        c = self.config
        kv_write = ctx.kv_write(layer_idx)  # None: ctx.attend stores K/V itself
        x, qkv, rotated = fused.norm_linear_rope(x, delta, norm.weight, norm.eps, self.qkv_proj,
                                                 c.num_heads, c.num_kv_heads, cos, sin, kv_write)
        return x, self._attend(qkv, cos, sin, ctx, layer_idx, kv_write, rotated)

    def _attend(self, qkv, cos, sin, ctx, layer_idx, kv_write, rotated: bool):
        """attend's body; rotated: q|k in qkv are rotated already and K/V stored where
        kv_write says (the GEMV's epilogue did both)."""
        if rotated:
            q, k, v = self._split(self._heads(qkv))
        else:
            q, k, v = self.rotate(qkv, cos, sin, kv_write)
        out = ctx.attend(layer_idx, q, k, v, kv_stored=kv_write is not None)  # [B, T, Hq, D]
        out = out.reshape(qkv.shape[0], qkv.shape[1], self.config.q_size)
        return fused.linear(out, self.o_proj)  # the decode GEMV where it applies


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return fused.silu_mul_linear(self.gate_up_proj(x), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, ctx, layer_idx):
        x, delta = self.forward_open(x, None, cos, sin, ctx, layer_idx)
        return x + delta

    def forward_open(self, x, delta, cos, sin, ctx, layer_idx):
        """The layer with its last residual add left open: the input is x + delta (delta:
        the previous layer's MLP output, or None), the output is the pair (x, mlp) whose sum
        is `forward`'s result. The model's loop hands the pair to the next layer, whose
        input norm adds it in its own pass: one kernel per layer fewer on a GPU, the same
        bits everywhere (the sum is rounded once, as `x + delta`).

        Each norm goes straight into the product that reads it, and SiLU·up into down's
        (`Attention.norm_attend`, `fused.norm_linear`, `fused.silu_mul_linear`): for a
        decode step on CUDA each pair is one kernel (the decode GEMV; q|k|v's also does RoPE
        and the K/V store); elsewhere the norm's glue, then the Linear, as `self.attn(...)`
        and `self.mlp(...)` compute them."""
        x, attn = self.attn.norm_attend(x, delta, self.input_norm, cos, sin, ctx, layer_idx)
        norm = self.post_attention_norm
        x, gate_up = fused.norm_linear(x, attn, norm.weight, norm.eps, self.mlp.gate_up_proj)
        return x, fused.silu_mul_linear(gate_up, self.mlp.down_proj)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend="torch"):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied: the head shares the embedding's Parameter (one tensor, no copy), but is its
        # own module, so it can be swapped, quantized or sharded like any other Linear.
        self.lm_head = Linear(config.hidden_size, config.vocab_size,
                              self.embed_tokens.weight if config.tie_word_embeddings else None)
        cos, sin = rope_cos_sin(config.head_dim, config.max_position_embeddings,
                                config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.attn_backend = get_backend(attn_backend)
        self._compiled_run = None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def deep_copy(self) -> "LlamaModel":
        """A deep copy of the weights and settings, on the same device, without this model's
        compiled step or captured CUDA graphs (``_decode_graphs``): those belong to the
        original's tensors and cannot be copied (a copy compiles or captures its own)."""
        import copy

        memo = {id(self._compiled_run): None}
        graphs = self.__dict__.get("_decode_graphs")
        if graphs is not None:
            memo[id(graphs)] = {}
        new = copy.deepcopy(self, memo=memo)
        new._compiled_run = None
        return new

    def set_attn_backend(self, name_or_backend) -> "LlamaModel":
        self.attn_backend = get_backend(name_or_backend)
        self._compiled_run = None  # compiled against the old backend
        return self

    def init_random_weights(self, seed: int = 0, std: float = 0.2) -> "LlamaModel":
        """Fill weights with seeded noise; norms get 1 + noise so they are not trivial.

        std=0.2 (not the 0.02 of training inits) makes greedy outputs of a tiny model vary
        from token to token, so "same tokens" comparisons in tests are not trivially true.
        """
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                noise = torch.randn(p.shape, generator=g) * std
                p.copy_((1.0 + noise) if name.endswith("norm.weight") else noise)
        return self

    def tie_weights(self) -> "LlamaModel":
        """Point the LM head at the embedding's Parameter again (tied models only). Needed
        after anything that assigns `embed_tokens.weight` anew, such as loading with
        `load_state_dict(..., assign=True)`."""
        if self._head_holds_float_weight():
            self.lm_head.weight = self.embed_tokens.weight
        return self

    def _head_holds_float_weight(self) -> bool:
        """Tied, and the head still a float `Linear` (a quantized head has its own storage)."""
        return (self.config.tie_word_embeddings and isinstance(self.lm_head, Linear)
                and isinstance(getattr(self.lm_head, "weight", None), torch.Tensor))

    def use_matvec_layout(self) -> "LlamaModel":
        """Every float `Linear` stores its weight with the longer side contiguous (see
        `Linear.use_matvec_layout` for why). Same values, same shapes, same outputs."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_matvec_layout()
        if self._head_holds_float_weight():
            self.embed_tokens.weight = self.lm_head.weight  # keep the tie: one tensor
        self._compiled_run = None  # compiled against the old tensors
        return self

    def check_positions(self, positions: torch.Tensor) -> None:
        limit = self.config.max_position_embeddings
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= limit):
            raise ValueError(f"positions must lie in [0, {limit}) (the model's context length), "
                             f"got {int(positions.min())}..{int(positions.max())}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                ctx=None, last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only=True).

        positions [B, T] default to 0..T-1. ctx defaults to full causal attention with no
        cache, computed by this model's backend.
        """
        positions, ctx = self._check_inputs(input_ids, positions, ctx)
        return self.run(input_ids, positions, ctx, last_only)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      ctx=None, num_layers: int | None = None, check: bool = True) -> torch.Tensor:
        """input_ids [B, T] -> h [B, T, hidden]: the last layer's output after the final
        norm, i.e. what the LM head reads. Same arguments as `forward`. `num_layers` runs
        only the first layers (a layer-skip draft model for speculative decoding).
        check=False skips the argument checks, which read the positions back to the host: a
        sync that the engine's step and CUDA graphs avoid (their positions are valid by
        construction; then positions and ctx are required)."""
        if check:
            positions, ctx = self._check_inputs(input_ids, positions, ctx)
        return self._final_norm(*self._open_layers(input_ids, positions, ctx, num_layers))

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., hidden] (rows of `hidden_states`, any leading shape) -> logits [..., V].
        Pick the rows first: the LM head is the model's largest matrix."""
        return self.lm_head(h)

    def _check_inputs(self, input_ids: torch.Tensor, positions, ctx):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape "
                             f"{tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if input_ids.device != self.device:  # else the embedding fails with a device error
            raise ValueError(f"input_ids are on {input_ids.device} but the model is on "
                             f"{self.device}: create them there (torch.tensor(..., "
                             f"device=model.device)) or move them with .to(model.device)")
        if positions is None:
            if T > self.config.max_position_embeddings:
                raise ValueError(f"sequence of {T} tokens exceeds the context length "
                                 f"{self.config.max_position_embeddings}")
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        else:
            self.check_positions(positions)
        return positions, NoCacheContext(self.attn_backend) if ctx is None else ctx

    def _open_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx,
                     num_layers: int | None = None):
        """Embedding and the first `num_layers` decoder layers (all by default), the last
        residual add left open: (x, delta) whose sum is the layers' output (delta None when
        no layer ran); no argument checks."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x, delta = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers[:num_layers]):
            x, delta = layer.forward_open(x, delta, cos, sin, ctx, i)
        return x, delta

    def _run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx,
                    num_layers: int | None = None) -> torch.Tensor:
        """The layers' output before the final norm (the open add closed)."""
        x, delta = self._open_layers(input_ids, positions, ctx, num_layers)
        return x if delta is None else x + delta

    def _final_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The final norm of x + delta: the last residual add in the norm's own pass (one
        kernel on a GPU), the same bits as `self.norm(x + delta)`."""
        if delta is None:
            return self.norm(x)
        return fused.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)[1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx,
            last_only: bool = False) -> torch.Tensor:
        """The forward math with no argument checks: what `compiled_run` compiles."""
        h = self._final_norm(*self._open_layers(input_ids, positions, ctx))
        if last_only:
            h = h[:, -1:]  # the LM head on the last row only (the norm is cheap on all)
        return self.compute_logits(h)

    def check_compilable(self) -> None:
        """Raise if torch.compile cannot trace this model's attention backend here."""
        if getattr(self.attn_backend, "name", None) == "triton":
            from .kernels import interpreter_enabled
            if interpreter_enabled():  # dynamo would trace into the interpreter's numpy code
                raise ValueError("torch.compile cannot trace Triton kernels that run in "
                                 "Triton's CPU interpreter (no CUDA GPU here); compile with "
                                 "the torch attention backend (model.set_attn_backend('torch')) "
                                 "or run the Triton backend eagerly")

    def compiled_run(self):
        """`run` compiled by `torch.compile` (built once per model, then reused).

        Why: a batch-1 decode step still runs many small ops per layer around 4 matrix-vector
        products even with the fused glue (views, slices, the cache write, attention), and
        on a CPU each op costs microseconds of dispatch. The compiled step is one graph:
        Inductor fuses the glue into a few generated loops and calls the weight products'
        kernels directly (`benchmarks/decode_profile.py` shows where the time goes). The
        math is unchanged; tests compare its tokens and logits with eager. The first call
        compiles (~40 s for SmolLM2 on 2 cores; 13-15 s in a later process, from Inductor's
        on-disk cache: `benchmarks/compile_cache.py`). dynamic=True: one graph serves every
        position and cache size.
        """
        self.check_compilable()
        if self._compiled_run is None:
            cpu_linear.prepare()  # measure and build now: inside a trace it would break the graph
            self._compiled_run = torch.compile(self.run, dynamic=True)
        return self._compiled_run


def load_model(dtype: torch.dtype | str | None = None, device=None, attn_backend="torch"):
    """Load SmolLM2-135M-Instruct from the installed GGUF: returns (model, tokenizer).

    ``device``: None for ``devices.default_device()`` (CUDA when a GPU is visible, else the
    CPU; ``MINILLM_DEVICE`` overrides), or "cpu", "cuda", "cuda:1", ...
    ``dtype``: None for ``devices.default_dtype(device)``: bf16 on CUDA (fp16 before Ampere), fp32 on a CPU, where
    it is exact against the reference and fast on every CPU. ``"auto"`` picks
    ``devices.decode_dtype(device)``: bf16 on CUDA and on CPUs with native bf16 (avx512_bf16
    or AMX), where it halves the bytes a decode step reads; fp32 on the others, whose
    emulated bf16 GEMMs make prefill crawl (a Lab 01 lesson). Weights are dequantized to
    ``dtype`` at load. A bf16 model agrees with fp32 on most greedy tokens, not all:
    ``tests/test_bf16.py`` compares them by top-1 agreement and KL.
    """
    from .devices import decode_dtype, default_dtype, make_current, resolve_device
    from .gguf_loader import load_gguf
    from .tokenizer import MiniTokenizer

    device = resolve_device(device)
    make_current(device)  # Triton launches on the current CUDA device (cuda:1 is not it)
    if dtype is None:
        dtype = default_dtype(device)
    elif isinstance(dtype, str) and dtype == "auto":
        dtype = decode_dtype(device)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32, None "
                         f"(the device's default) or 'auto', got {dtype!r}")
    config, state, reader = load_gguf()
    tokenizer = MiniTokenizer.from_gguf_reader(reader)
    with torch.device("meta"):
        model = LlamaModel(config, attn_backend=attn_backend)
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    result = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ValueError(f"the GGUF's tensors do not match the model: missing "
                         f"{sorted(set(result.missing_keys) - tied)}, unexpected "
                         f"{sorted(result.unexpected_keys)}")
    model.tie_weights()  # assign=True gave embed_tokens a new Parameter
    cos, sin = rope_cos_sin(config.head_dim, config.max_position_embeddings, config.rope_theta)
    model.rope_cos, model.rope_sin = cos, sin
    model = model.to(device=device, dtype=dtype)
    if model.device.type == "cpu":
        model.use_matvec_layout()
    # RoPE tables stay fp32 whatever the weights are.
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model.eval().requires_grad_(False), tokenizer
