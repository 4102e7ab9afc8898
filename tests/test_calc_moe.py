"""minillm.calc.moe: mixture-of-experts parameters, expert-parallel memory per GPU and the
all-to-all bytes of routing tokens, against independent counts: the parameters of real
(tiny) torch modules of the same shape, and every routing of a token enumerated."""
from __future__ import annotations

import itertools

import pytest
import torch

from minillm import calc
from minillm.calc import MoEConfig


def _tiny() -> MoEConfig:
    return MoEConfig("tiny", num_layers=3, hidden_size=16, expert_ffn_size=24, num_experts=6,
                     top_k=2, num_heads=4, num_kv_heads=2, head_dim=4, vocab_size=50)


def _modules(cfg: MoEConfig) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """(shared part, experts of every layer) as torch modules of cfg's shape, no biases."""
    d, f = cfg.hidden_size, cfg.expert_ffn_size
    lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
    shared = torch.nn.ModuleList([torch.nn.Embedding(cfg.vocab_size, d), lin(d, cfg.vocab_size),
                                  torch.nn.RMSNorm(d)])
    experts = []
    for _ in range(cfg.num_layers):
        shared.append(torch.nn.ModuleList([
            lin(d, cfg.num_heads * cfg.head_dim), lin(d, cfg.num_kv_heads * cfg.head_dim),
            lin(d, cfg.num_kv_heads * cfg.head_dim), lin(cfg.num_heads * cfg.head_dim, d),
            lin(d, cfg.num_experts), torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)]))
        experts += [torch.nn.ModuleList([lin(d, f), lin(d, f), lin(f, d)])
                    for _ in range(cfg.num_experts)]
    return shared, experts


def _count(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def test_parameter_counts_match_torch_modules():
    cfg = _tiny()
    shared, experts = _modules(cfg)
    assert cfg.shared_params == _count([shared])
    assert cfg.expert_params == _count(experts[:1])
    assert cfg.total_params == _count([shared]) + _count(experts)
    assert cfg.active_params == _count([shared]) + cfg.num_layers * cfg.top_k * _count(experts[:1])


def test_mixtral_is_the_published_size():
    m = calc.MIXTRAL_8X7B
    assert m.total_params / 1e9 == pytest.approx(46.7, abs=0.05)
    assert m.active_params / 1e9 == pytest.approx(12.9, abs=0.05)


@pytest.mark.parametrize("ep", [1, 2, 3, 6])
def test_expert_memory_per_gpu_deals_out_whole_experts(ep):
    cfg = _tiny()
    shared, experts = _modules(cfg)
    # layer l's experts are experts[l*E:(l+1)*E]; GPU g keeps a contiguous block of each layer's
    E = cfg.num_experts
    mine = [experts[l * E + e] for l in range(cfg.num_layers) for e in range(E // ep)]
    assert calc.ep_expert_bytes_per_gpu(cfg, ep, 2) == 2 * _count(mine)
    assert calc.ep_memory_per_gpu(cfg, ep, 2) == 2 * (_count(mine) + _count([shared]))


def test_ep_size_must_divide_the_experts():
    with pytest.raises(ValueError, match=r"ep_size=4 does not divide the 6 experts.*\[1, 2, 3, 6\]"):
        calc.ep_expert_bytes_per_gpu(_tiny(), 4, 2)
    with pytest.raises(ValueError, match="top_k=7 exceeds num_experts=6"):
        MoEConfig("bad", 1, 8, 8, 6, 7, 2, 1, 4, 10)


@pytest.mark.parametrize("num_experts, top_k, ep", [(8, 2, 8), (8, 2, 4), (6, 3, 3), (4, 1, 2), (8, 2, 1)])
def test_all_to_all_bytes_average_every_routing(num_experts, top_k, ep):
    """Enumerate every GPU a token can start on and every set of top_k experts it can be
    routed to (uniform routing): the mean count of remote experts, times two trips of one
    hidden vector, is the formula."""
    hidden, dtype_bytes = 48, 2
    per_gpu = num_experts // ep
    home = lambda e: e // per_gpu  # noqa: E731
    remote = [sum(home(e) != g for e in chosen)
              for g in range(ep) for chosen in itertools.combinations(range(num_experts), top_k)]
    want = 2 * sum(remote) / len(remote) * hidden * dtype_bytes
    got = calc.ep_all_to_all_bytes_per_token(hidden, top_k, ep, dtype_bytes)
    assert got == pytest.approx(want)


def test_top2_all_to_all_moves_what_two_tp_allreduces_move():
    """The lab's comparison: at top-2, EP's all-to-all per token per layer equals TP's two ring
    all-reduces of one hidden vector over the same number of GPUs."""
    for n in (2, 4, 8):
        assert calc.ep_all_to_all_bytes_per_token(4096, 2, n, 2) == pytest.approx(
            2 * calc.ring_allreduce_bytes(4096 * 2, n))
