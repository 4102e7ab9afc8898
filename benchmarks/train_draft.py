"""Can a tiny draft trained on this CPU in ~10 minutes make speculative decoding pay?

Trains a 2-layer draft of SmolLM2 (its layers start as copies of the target's first and last
layer; it shares the target's embedding and LM head) by distillation on the Lee news corpus
(`minillm.spec.distill`), for --minutes of wall-clock time, then measures it as a
`spec.ModelDraft` exactly as `benchmarks/spec.py` measures the other drafts: batch-1 eager,
greedy, on chat / summarize / edit prompts, lossless-checked against plain decoding, with
α, r, the verify cost c and the formula's prediction beside the measured speedup. The
articles the prompts are built from are held out of training.

    python benchmarks/train_draft.py [--minutes 8] [--layers 0 -1] [--ks 1 2 3 4]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minillm  # noqa: E402
from minillm import spec  # noqa: E402
from minillm.data import lee_corpus  # noqa: E402
from minillm.spec.distill import make_draft, distill, trainable_parameters  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)
from spec import measure, prompt_sets  # noqa: E402  (benchmarks/spec.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--layers", type=int, nargs="+", default=[0, -1])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_draft.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = minillm.load_model()
    sets = prompt_sets(tok, args.prompts)
    held_out = {a for a in lee_corpus() if 500 < len(a) < 900}  # the prompts' pool
    train_ids = [t for a in lee_corpus() if a not in held_out
                 for t in tok.encode(a) + [model.config.eos_token_id]]
    draft = make_draft(model, args.layers)
    n_params = sum(p.numel() for p in trainable_parameters(draft))
    print(f"training a {len(args.layers)}-layer draft ({n_params / 1e6:.1f} M own parameters, "
          f"embedding/head shared) on {len(train_ids)} tokens for {args.minutes} min", flush=True)
    t0 = time.perf_counter()
    seq_len, batch_size = 128, 4
    losses = distill(draft, model, train_ids, seconds=args.minutes * 60, seq_len=seq_len,
                     batch_size=batch_size)
    train_s = time.perf_counter() - t0
    print(f"trained {len(losses)} steps in {train_s:.0f} s; KL {losses[0]:.2f} -> "
          f"{sum(losses[-10:]) / len(losses[-10:]):.2f} nats/token (mean of the last 10)",
          flush=True)
    name = f"distilled-{len(args.layers)}"
    rows, plain = measure(model, sets, {name: lambda: spec.ModelDraft(draft)},
                          {name: args.ks}, args.new_tokens)
    best = max(rows, key=lambda r: r["speedup"])
    print(f"\nbest: k={best['k']} on {best['set']}: {best['speedup']:.2f}x (alpha "
          f"{best['alpha']:.2f}, r {best['r']:.2f})")
    result = {"benchmark": "train_draft", "date": time.strftime("%Y-%m-%d %H:%M"),
              "threads": args.threads, "layers": args.layers, "own_params": n_params,
              "train_tokens": len(train_ids), "train_seconds": train_s, "steps": len(losses),
              "tokens_seen": len(losses) * batch_size * seq_len, "kl_first": losses[0],
              "kl_last10": sum(losses[-10:]) / len(losses[-10:]), "losses": losses,
              "new_tokens": args.new_tokens, "prompts_per_set": args.prompts,
              "plain": plain, "rows": rows}
    write_result(args.out, result, indent=1, device=model.device)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
