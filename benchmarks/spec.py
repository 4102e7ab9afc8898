"""Speculative decoding on SmolLM2, batch 1: plain eager decoding against each draft at
k = 1..8, on three prompt sets, with the formula's prediction beside each measurement.

Prompt sets (chat template, greedy, 64 new tokens, EOS ends a request early):
  chat       short questions: the answer is new text, nothing to copy
  summarize  "summarize this article" over Lee corpus news articles (minillm.data)
  edit       "rewrite this article fixing spelling": the answer copies the input

Per (draft, k, set), summed over the set's prompts, decode only (each prompt's prefill time,
measured once, is subtracted from both sides):
  speedup    plain decode seconds / speculative decode seconds (both eager, same model)
  alpha      accepted guesses / verified guesses;  tokens/pass = new tokens / target passes
  r          draft seconds per guess / plain seconds per token
  c          seconds per verification pass (k + 1 tokens) / plain seconds per token
  predicted  calc.spec_speedup(alpha, k, r, verify_cost=c), and with c = 1 (the GPU
             textbook case) for comparison

Every speculative run's tokens are checked against plain decoding's (lossless).

`--layer-sweep` measures instead the layer-skip draft for every L in --layers at k = 1 on
the input-grounded sets (α, r, measured and predicted speedup): how its default L is chosen.
MINILLM_CPU_KERNEL=0 runs everything with BLAS for every weight product instead of the C++
small-M kernel (the result file records which).

    python benchmarks/spec.py [--quick] [--new-tokens 64] [--prompts 4]
    python benchmarks/spec.py --layer-sweep [--layers 2 4 8 ...] [--prompts 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minillm  # noqa: E402
from minillm import calc, spec  # noqa: E402
from minillm.data import lee_corpus  # noqa: E402
from minillm.layers import cpu_linear  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "Explain why the sky is blue.", "Give three tips for learning to cook.",
        "What causes the seasons on Earth?", "Describe a cat in two sentences."]
TEMPLATES = {"summarize": "Summarize the following news article in two sentences.\n\n{}",
             "edit": "Rewrite the following news article, fixing any spelling mistakes. "
                     "Keep everything else the same.\n\n{}"}


def prompt_sets(tok, n: int) -> dict[str, list[list[int]]]:
    articles = [a for a in lee_corpus() if 500 < len(a) < 900][:n]
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    sets = {"chat": [chat(q) for q in CHAT[:n]]}
    sets.update({name: [chat(t.format(a)) for a in articles] for name, t in TEMPLATES.items()})
    return sets


class Timed:
    """Wraps a draft and counts the seconds spent proposing."""

    def __init__(self, draft):
        self.draft, self.seconds = draft, 0.0
        self.vocab_size = getattr(draft, "vocab_size", None)

    def reset(self, *args):
        self.draft.reset(*args)

    def propose(self, context, k):
        t0 = time.perf_counter()
        out = self.draft.propose(context, k)
        self.seconds += time.perf_counter() - t0
        return out

    def rollback(self, n):
        self.draft.rollback(n)


def prefill_seconds(model, ids) -> float:
    best = float("inf")
    with torch.inference_mode():
        for _ in range(2):
            t0 = time.perf_counter()
            model(torch.tensor([ids]), last_only=True)
            best = min(best, time.perf_counter() - t0)
    return best


def measure(model, sets, drafts, draft_ks, new_tokens):
    """Plain decoding, then every (draft, k) on every prompt set: the rows described above.
    Returns (rows, plain) where plain[set] holds plain decoding's seconds and tok/s."""
    rows, plain = [], {}
    for set_name, prompts in sets.items():
        pre = [prefill_seconds(model, p) for p in prompts]
        t0 = time.perf_counter()
        refs = [minillm.generate(model, p, new_tokens) for p in prompts]
        plain_s = time.perf_counter() - t0 - sum(pre)
        n_tok = sum(map(len, refs))
        plain[set_name] = {"decode_s": plain_s, "tokens": n_tok, "tok_s": n_tok / plain_s}
        step = plain_s / n_tok
        print(f"{set_name}: plain {n_tok / plain_s:.1f} tok/s ({n_tok} tokens)", flush=True)
        for name, make in drafts.items():
            for k in draft_ks[name]:
                draft, passes, guesses, accepted = Timed(make()), 0, 0, 0
                t0 = time.perf_counter()
                for p, ref in zip(prompts, refs):
                    out = spec.speculative_generate(model, draft, p, new_tokens, k=k)
                    assert out.tokens == ref, f"{name} k={k} changed the output: not lossless"
                    passes += out.num_target_passes
                    guesses += out.num_draft_tokens
                    accepted += out.num_accepted
                spec_s = time.perf_counter() - t0 - sum(pre)
                alpha = accepted / guesses if guesses else 0.0
                r = draft.seconds / guesses / step if guesses else 0.0
                c = (spec_s - draft.seconds) / passes / step
                row = {"set": set_name, "draft": name, "k": k, "speedup": plain_s / spec_s,
                       "tok_s": n_tok / spec_s, "alpha": alpha, "tokens_per_pass": n_tok / passes,
                       "guesses_per_pass": guesses / passes, "r": r, "verify_cost": c,
                       "predicted": calc.spec_speedup(alpha, k, r, verify_cost=c),
                       "predicted_verify_1": calc.spec_speedup(alpha, k, r),
                       "expected_tokens_per_pass": calc.spec_expected_tokens(alpha, k)}
                rows.append(row)
                print(f"  {name:13s} k={k}  speedup {row['speedup']:.2f}x (predicted "
                      f"{row['predicted']:.2f}x; {row['predicted_verify_1']:.2f}x if verifying "
                      f"cost one step)  alpha {alpha:.2f}  tokens/pass {row['tokens_per_pass']:.2f} "
                      f"(formula {row['expected_tokens_per_pass']:.2f})  r {r:.3f}  c {c:.2f}",
                      flush=True)
    return rows, plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts per set, k in 1, 4")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--layer-sweep", action="store_true",
                    help="only the layer-skip draft, k = 1, for each L in --layers")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 12, 16, 20, 24, 27])
    ap.add_argument("--out", default=None, help="default: results/spec.json, or "
                    "results/spec_layer_sweep.json with --layer-sweep")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n_prompts, ks = (2, [1, 4]) if args.quick else (args.prompts, list(range(1, 9)))
    model, tok = minillm.load_model()
    sets = prompt_sets(tok, n_prompts)
    if args.layer_sweep:
        sets.pop("chat")
        drafts = {f"layer-skip-{n}": (lambda n=n: spec.LayerSkipDraft(model, n))
                  for n in args.layers}
        draft_ks = dict.fromkeys(drafts, [1])
    else:
        drafts = {"ngram": lambda: spec.NgramDraft(max_ngram=3),
                  "layer-skip": lambda: spec.LayerSkipDraft(model)}
        draft_ks = {"ngram": ks, "layer-skip": [k for k in ks if k <= 2] or ks[:1]}
    out_path = Path(args.out or Path(__file__).parent / "results"
               / ("spec_layer_sweep.json" if args.layer_sweep else "spec.json"))

    rows, plain = measure(model, sets, drafts, draft_ks, args.new_tokens)
    best = max((r for r in rows if r["set"] != "chat"), key=lambda r: r["speedup"])
    print(f"\nbest on input-grounded prompts: {best['draft']} k={best['k']} on {best['set']}: "
          f"{best['speedup']:.2f}x")
    if args.layer_sweep:  # the L with the best speedup summed over the sets
        by_l = {name: sum(r["speedup"] for r in rows if r["draft"] == name) for name in drafts}
        print(f"best layer-skip L over the input-grounded sets: {max(by_l, key=by_l.get)}")
    kernel = cpu_linear.load_kernel() is not None
    result = {"benchmark": "spec_layer_sweep" if args.layer_sweep else "spec",
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "linear_path": "small-M kernel" if kernel else "BLAS",
              "machine": {"cpu_count": os.cpu_count(), "threads": args.threads,
                          "torch": torch.__version__},
              "new_tokens": args.new_tokens, "prompts_per_set": n_prompts, "quick": args.quick,
              "plain": plain, "rows": rows}
    write_result(out_path, result, device=model.device)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
