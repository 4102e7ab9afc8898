"""The serving benchmark's workload: 64 requests, written to benchmarks/workload.json.
The generator lives in `minillm.serve.workload` (the load generator uses it too).

Seeded (numpy default_rng(0)): prompt lengths uniform in [16, 256], then output lengths
uniform in [16, 256], then the prompt tokens. Prompts are random token ids drawn uniformly
from the real vocabulary of SmolLM2 (ids 3 .. 49151, skipping the special tokens 0-2):
the model's speed does not depend on what the tokens mean, and every prompt is distinct,
so no prefix cache can flatter the throughput numbers. Decoding is greedy and ignores EOS,
so each request generates exactly its output length.

    python benchmarks/workload.py            # writes benchmarks/workload.json
    python benchmarks/workload.py --check    # fails if the file differs from the generator
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.serve.workload import FIRST_ID, VOCAB_SIZE, make_workload  # noqa: E402,F401

PATH = Path(__file__).with_name("workload.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify workload.json, write nothing")
    args = ap.parse_args(argv)
    wl = make_workload()
    if args.check:
        ok = PATH.exists() and json.loads(PATH.read_text()) == wl
        print(f"{PATH.name}: {'up to date' if ok else 'DIFFERS from make_workload(); rerun'}")
        return 0 if ok else 1
    PATH.write_text(json.dumps(wl, separators=(",", ":")) + "\n")
    print(f"wrote {PATH}: {wl['description']}; {wl['num_prompt_tokens']} prompt and "
          f"{wl['num_output_tokens']} output tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
