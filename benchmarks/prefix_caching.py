"""Prefix caching on SmolLM2: requests that share a 512-token system prompt, each with a
question of its own (16..64 random tokens), greedy, 2 output tokens each. Two arrivals:

  one at a time   each request runs alone after the previous one finished: mean TTFT of
                  requests 2..n, when the cache holds the system prompt (the chat case)
  together        all n submitted at once through `LLMEngine.generate` (one system prompt,
                  many questions: the common offline case). The first request computes the
                  system prompt's blocks in the same step in which the others are admitted,
                  so the others can only hit them if blocks are offered to the cache when
                  they are scheduled (see minillm.engine.scheduler)

For each, with caching on and off: hit rate, prompt tokens the model computed, wall time.
`benchmarks/serving.py` calls these too and records them in results/serving.json.

    python benchmarks/prefix_caching.py [--requests 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minillm  # noqa: E402
from minillm.engine import LLMEngine, SamplingParams  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

SYSTEM_PROMPT_TOKENS = 512


def shared_prefix_prompts(model, num_requests: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    system = torch.randint(3, vocab, (SYSTEM_PROMPT_TOKENS,), generator=g).tolist()
    return [system + torch.randint(3, vocab, (int(torch.randint(16, 65, (1,), generator=g)),),
                                   generator=g).tolist() for _ in range(num_requests)]


def new_engine(model, caching: bool) -> LLMEngine:
    return LLMEngine(model, enable_prefix_caching=caching, max_num_batched_tokens=1024,
                     kv_cache_memory_bytes=256 << 20)


def one_at_a_time(model, num_requests: int, caching: bool) -> dict:
    engine, ttfts = new_engine(model, caching), []
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    t0 = time.perf_counter()
    for i, prompt in enumerate(shared_prefix_prompts(model, num_requests)):
        engine.add_request(str(i), prompt, sp)  # TTFT is the prefill, not queueing
        while engine.has_unfinished_requests():
            engine.step()
        ttfts.append(engine.finished_metrics[(str(i), 0)].ttft)
    return {"mean_ttft_s": statistics.mean(ttfts[1:]), "first_request_ttft_s": ttfts[0],
            "hit_rate": engine.prefix_cache_hit_rate(), "wall_s": time.perf_counter() - t0,
            "prompt_tokens_computed": engine.stats()["num_computed_prompt_tokens"]}


def together(model, num_requests: int, caching: bool) -> dict:
    engine = new_engine(model, caching)
    prompts = shared_prefix_prompts(model, num_requests)
    t0 = time.perf_counter()
    tokens = engine.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    wall = time.perf_counter() - t0
    ttfts = [m.ttft for m in engine.finished_metrics.values()]
    return {"wall_s": wall, "mean_ttft_s": statistics.mean(ttfts),
            "hit_rate": engine.prefix_cache_hit_rate(), "steps": engine.num_steps,
            "prompt_tokens": sum(map(len, prompts)),
            "prompt_tokens_computed": engine.stats()["num_computed_prompt_tokens"],
            "tokens": tokens}


def measure(model, num_requests: int) -> dict:
    out = {"shared_system_prompt_tokens": SYSTEM_PROMPT_TOKENS, "requests": num_requests}
    for name, fn in (("one_at_a_time", one_at_a_time), ("together", together)):
        on, off = fn(model, num_requests, True), fn(model, num_requests, False)
        if name == "together":
            assert on.pop("tokens") == off.pop("tokens"), "caching changed the outputs"
        out[name] = {"on": on, "off": off,
                     "ttft_speedup": off["mean_ttft_s"] / on["mean_ttft_s"],
                     "wall_speedup": off["wall_s"] / on["wall_s"]}
    return out


def report(r: dict) -> str:
    lines = [f"prefix caching, {r['requests']} requests sharing a "
             f"{r['shared_system_prompt_tokens']}-token system prompt:"]
    for name, m in ((n, r[n]) for n in ("one_at_a_time", "together")):
        on, off = m["on"], m["off"]
        lines.append(f"  {name.replace('_', ' '):14s} hit rate {on['hit_rate']:.0%}; prompt "
                     f"tokens computed {on['prompt_tokens_computed']} on vs "
                     f"{off['prompt_tokens_computed']} off; mean TTFT {on['mean_ttft_s']:.2f}s "
                     f"vs {off['mean_ttft_s']:.2f}s ({m['ttft_speedup']:.1f}x); wall "
                     f"{on['wall_s']:.2f}s vs {off['wall_s']:.2f}s ({m['wall_speedup']:.1f}x)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefix_caching.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = minillm.load_model()
    with torch.inference_mode():
        r = measure(model, args.requests)
    print(report(r))
    r["date"] = time.strftime("%Y-%m-%d %H:%M")
    write_result(args.out, r, device=model.device)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
