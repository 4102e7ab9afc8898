"""Mixture of experts (MoE) and expert parallelism (EP): parameters, memory per GPU and the
all-to-all traffic of routing tokens to their experts.

An MoE layer replaces the dense MLP by ``num_experts`` MLPs of the same shape (SwiGLU:
gate, up and down, ``3 · hidden · expert_ffn`` weights each) and a router that sends each
token to its ``top_k`` experts. Under expert parallelism the experts of every layer are dealt
out to ``ep_size`` GPUs, ``num_experts / ep_size`` each; everything else (attention,
embeddings, norms, routers) is here replicated on every GPU (real deployments often shard it
with TP as well: `tp_param_bytes_per_rank`).

All-to-all per MoE layer (uniform routing assumed, no capacity limit): each token's hidden
vector goes to each of its ``top_k`` experts (dispatch) and the expert's output comes back
(combine). An expert lives on another GPU with probability ``(ep − 1) / ep``, so each token
sends ``2 · top_k · (ep − 1) / ep · hidden · dtype_bytes`` bytes per MoE layer. Invariant: at
``ep_size = 1`` nothing is sent; the traffic never depends on the expert FFN size.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._common import _int, _real
from .memory import attention_params, embedding_params, norm_params


@dataclass(frozen=True)
class MoEConfig:
    """The shape of a decoder-only MoE model (every layer an MoE layer)."""

    name: str
    num_layers: int
    hidden_size: int
    expert_ffn_size: int     # intermediate size of ONE expert's MLP
    num_experts: int
    top_k: int               # experts each token is routed to
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for field in ("num_layers", "hidden_size", "expert_ffn_size", "num_experts", "top_k",
                      "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            _int(field, getattr(self, field))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}: a "
                             f"token is routed to at most every expert; lower top_k.")

    @property
    def expert_params(self) -> int:
        """Weights of one expert in one layer: gate, up and down, ``3 · hidden · ffn``."""
        return 3 * self.hidden_size * self.expert_ffn_size

    @property
    def shared_params(self) -> int:
        """Everything but the experts: attention, routers, norms, embedding and LM head."""
        d, L = self.hidden_size, self.num_layers
        attn = attention_params(d, self.num_heads, self.num_kv_heads, self.head_dim)
        router = d * self.num_experts
        return (L * (attn + router) + norm_params(d, L)
                + embedding_params(self.vocab_size, d, self.tie_word_embeddings))

    @property
    def total_params(self) -> int:
        return self.num_layers * self.num_experts * self.expert_params + self.shared_params

    @property
    def active_params(self) -> int:
        """Weights one token runs through: its ``top_k`` experts per layer, and the rest."""
        return self.num_layers * self.top_k * self.expert_params + self.shared_params


#: Mixtral-8x7B (its config.json): 32 layers, hidden 4096, expert FFN 14336, 8 experts, top-2,
#: 32 query / 8 KV heads of 128, vocabulary 32000, untied LM head. 46.7B parameters, 12.9B active.
MIXTRAL_8X7B = MoEConfig("Mixtral-8x7B", 32, 4096, 14336, 8, 2, 32, 8, 128, 32000)


def _checked_ep(num_experts, ep_size) -> int:
    ep, e = _int("ep_size", ep_size), _int("num_experts", num_experts)
    if e % ep:
        raise ValueError(f"ep_size={ep} does not divide the {e} experts of each layer: every GPU "
                         f"must hold the same number of whole experts; use one of "
                         f"{[n for n in range(1, e + 1) if e % n == 0]}.")
    return ep


def ep_expert_bytes_per_gpu(config: MoEConfig, ep_size, dtype_bytes) -> int:
    """Expert weight bytes on each GPU: ``num_layers · num_experts / ep · expert_params ·
    dtype_bytes``. ``ep_size`` must divide ``num_experts``."""
    ep = _checked_ep(config.num_experts, ep_size)
    per_gpu = config.num_experts // ep
    return int(config.num_layers * per_gpu * config.expert_params * _real("dtype_bytes", dtype_bytes))


def ep_memory_per_gpu(config: MoEConfig, ep_size, dtype_bytes) -> int:
    """Weight bytes on each GPU under expert parallelism: its experts
    (`ep_expert_bytes_per_gpu`) plus a full copy of the shared weights."""
    shared = config.shared_params * _real("dtype_bytes", dtype_bytes)
    return int(ep_expert_bytes_per_gpu(config, ep_size, dtype_bytes) + shared)


def ep_all_to_all_bytes_per_token(hidden_size, top_k, ep_size, dtype_bytes) -> float:
    """Bytes one token sends across GPUs in ONE MoE layer (dispatch to its experts and the
    combine back): ``2 · top_k · (ep − 1) / ep · hidden_size · dtype_bytes``, with uniform
    routing (each expert on another GPU with probability (ep − 1) / ep). ep = 1: 0."""
    ep = _int("ep_size", ep_size)
    k = _int("top_k", top_k)
    d = _int("hidden_size", hidden_size)
    return 2 * k * (ep - 1) / ep * d * _real("dtype_bytes", dtype_bytes)
