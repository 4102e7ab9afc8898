"""Generation with the contiguous KV cache: one prompt (`generate`, `generate_stream`) or a
static batch of prompts padded to a common length (`generate_batch`).

The loop is the textbook one:

    prefill:  run the whole prompt once, fill the cache, sample token 1
    decode:   feed the last token at position p, append its K/V at p, sample the next

With `use_cache=False` every step re-runs the model on the whole sequence (O(T^2) work):
the baseline that Lab 02 measures the cache against. Both paths must give the same tokens.

`cuda_graph=True` (the default on CUDA) replays each decode step as a CUDA graph over a
static cache (`minillm.decode_graph`); with `compile=True` as well, the captured step is a
torch.compile'd one. `cuda_graph=False` keeps the eager steps (and `compile=True` alone
compiles them with dynamic shapes). On a CPU `cuda_graph=True` runs the graph's static
step uncaptured, with a one-time warning.

Static batching left-pads prompts so every row's last prompt token sits in the same column,
masks the padding slots, and runs until the longest request is done: the finished rows
keep occupying their slots. That waste is what continuous batching (Lab 05) removes.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from . import decode_graph
from .attention import ContiguousCacheContext, NoCacheContext
from .kv_cache import KVCache
from .prompts import check_context_length, check_generation, stop_token_set
from .sampling import make_generator, sample_next, validate_sampling


@torch.inference_mode()
def generate_stream(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None,
                    seed: int | None = None, stop_token_ids=None, ignore_eos: bool = False,
                    use_cache: bool = True, append_fn=None, attend_fn=None,
                    compile: bool = False, cuda_graph: bool | None = None) -> Iterator[int]:
    """Yield new token ids one at a time. A stop token is yielded, then generation ends.

    `append_fn` / `attend_fn` replace the cache write and the cached attention (Lab 02
    plugs the student's versions in here); see `minillm.kv_cache` for their signatures.
    `compile=True` runs the decode steps through torch.compile (`model.compiled_run()`, or
    the compiled-then-captured step with `cuda_graph`); the first call pays the
    compilation. `cuda_graph` (None: True on CUDA) replays decode steps as a CUDA graph
    (see the module doc). Both need the cache and the default functions.
    """
    plain = decode_graph.plain_cache(use_cache, append_fn, attend_fn)
    if compile and not plain:
        raise ValueError("compile=True needs use_cache=True and the default append_fn / "
                         "attend_fn (a student's functions run eagerly)")
    cuda_graph = decode_graph.use_cuda_graph(cuda_graph, model.device, plain)
    prompt = check_generation(model, prompt_ids, max_new_tokens)
    validate_sampling(temperature, top_k, top_p)
    if max_new_tokens == 0:
        return
    stops = stop_token_set(stop_token_ids, model.config.eos_token_id, ignore_eos)
    device = model.device
    generator = make_generator(seed)
    tokens = torch.tensor([prompt], device=device)

    if cuda_graph:
        graph = decode_graph.get(model, 1, len(prompt) + max_new_tokens, compile)
        logits = graph.prefill(tokens)
    elif use_cache:
        cache = KVCache(model.config, 1, len(prompt) + max_new_tokens, model.dtype, device)
        ctx = ContiguousCacheContext(model.attn_backend, cache, 0, append_fn=append_fn,
                                     attend_fn=attend_fn)
        logits = model(tokens, tokens.new_tensor([list(range(len(prompt)))]), ctx,
                       last_only=True)
    else:
        logits = model(tokens, last_only=True)
    # Decode steps: positions were checked above (prompt + max_new_tokens fits), so the
    # compiled path may skip forward()'s checks.
    decode = model.compiled_run() if compile and not cuda_graph else model
    pos = len(prompt)
    if cuda_graph and temperature == 0:
        # Greedy through the graph: each step's argmax is fed back on the device and the
        # host reads the tokens one step behind the GPU (`DecodeGraph.greedy`).
        first = sample_next(logits[0, -1])
        yield first
        if first in stops or max_new_tokens == 1:
            return
        for token in graph.greedy(first, pos, max_new_tokens - 1):
            yield token
            if token in stops:
                return
        return
    for step in range(max_new_tokens):
        next_id = sample_next(logits[0, -1], temperature, top_k, top_p, generator)
        yield next_id
        if next_id in stops or step == max_new_tokens - 1:
            return
        if cuda_graph:
            logits = graph.decode(next_id, pos)
        elif use_cache:
            ctx.start_pos = pos
            logits = decode(tokens.new_tensor([[next_id]]), tokens.new_tensor([[pos]]), ctx)
        else:
            tokens = torch.cat([tokens, tokens.new_tensor([[next_id]])], dim=1)
            logits = model(tokens, last_only=True)
        pos += 1


def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_token_ids=None, ignore_eos: bool = False, use_cache: bool = True,
             append_fn=None, attend_fn=None, compile: bool = False,
             cuda_graph: bool | None = None) -> list[int]:
    """Return the new token ids (the prompt is not included)."""
    return list(generate_stream(model, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                                seed, stop_token_ids, ignore_eos, use_cache, append_fn,
                                attend_fn, compile, cuda_graph))


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens, temperature=0.0,
                   top_k=None, top_p=None, seed=None, stop_token_ids=None,
                   ignore_eos: bool = False, use_cache: bool = True) -> list[list[int]]:
    """Static batching: all prompts advance together, left-padded, until every row is done.

    `max_new_tokens` is one int or one per prompt. Row i samples with seed `seed + i`, so a
    row's tokens do not depend on its neighbours. Returns each row's new tokens.
    """
    if not prompts:
        raise ValueError("prompts is empty")
    limits = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
              else list(max_new_tokens))
    if len(limits) != len(prompts):
        raise ValueError(f"got {len(limits)} max_new_tokens values for {len(prompts)} prompts")
    prompts = [check_generation(model, p, n) for p, n in zip(prompts, limits)]
    validate_sampling(temperature, top_k, top_p)
    stops = stop_token_set(stop_token_ids, model.config.eos_token_id, ignore_eos)
    B, device = len(prompts), model.device
    P = max(len(p) for p in prompts)
    steps = max(limits)
    check_context_length(P, steps, model.config.max_position_embeddings)  # padded length
    generators = [make_generator(None if seed is None else seed + i) for i in range(B)]

    pad_id = model.config.eos_token_id or 0
    ids = torch.full((B, P), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((B, P + steps), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, device=device)
        valid[i, P - len(p):] = True  # prompt slots; generated slots are all valid
    valid[:, P:] = True
    # Each row counts positions from its own first real token.
    positions = (valid[:, :P].long().cumsum(1) - 1).clamp(min=0)

    outputs: list[list[int]] = [[] for _ in range(B)]
    done = [n == 0 for n in limits]
    if use_cache:
        cache = KVCache(model.config, B, P + steps, model.dtype, device)
        ctx = ContiguousCacheContext(model.attn_backend, cache, 0, key_padding_mask=valid)
        logits = model(ids, positions, ctx, last_only=True)
    else:
        logits = model(ids, positions, NoCacheContext(model.attn_backend, valid[:, :P]),
                       last_only=True)
    next_pos = positions[:, -1] + 1
    for step in range(steps):
        if all(done):
            break
        new = []
        for i in range(B):
            tok = pad_id if done[i] else sample_next(logits[i, -1], temperature, top_k, top_p,
                                                     generators[i])
            if not done[i]:
                outputs[i].append(tok)
                done[i] = tok in stops or len(outputs[i]) >= limits[i]
            new.append(tok)
        if all(done):
            break
        new_ids = torch.tensor(new, device=device)[:, None]
        if use_cache:
            ctx.start_pos = P + step
            logits = model(new_ids, next_pos[:, None], ctx)
        else:
            ids = torch.cat([ids, new_ids], dim=1)
            positions = torch.cat([positions, next_pos[:, None]], dim=1)
            logits = model(ids, positions, NoCacheContext(model.attn_backend,
                                                          valid[:, :ids.shape[1]]),
                           last_only=True)
        next_pos = next_pos + 1
    return outputs
