"""How long `generate(..., compile=True)` takes to start: cold, and with Inductor's on-disk
cache warm from an earlier process.

torch.compile's first call traces the decode step (TorchDynamo), lowers it (AOTAutograd)
and generates and builds C++ for it (Inductor). Inductor caches the built graphs on disk
(its FX graph cache and AOTAutograd cache, under TORCHINDUCTOR_CACHE_DIR), so a second
process skips the code generation and the C++ build, but still traces. This script runs
three fresh Python processes against one new, empty cache directory:

    cold        the first process: nothing cached
    warm        a second process: the cache filled by the first
    warm again  a third, to show the warm figure is stable

and in each, the first compiled call's seconds (4 new tokens, so the decode graph is
built) and then a second call's (what every later call costs). The labs keep compile=True
opt-in while the warm first call is above a few seconds.

    python benchmarks/compile_cache.py [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("results") / "compile_cache.json"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minillm.devices import default_device  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

CHILD = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
import minillm
torch.set_num_threads(2)
model, _ = minillm.load_model(dtype=getattr(torch, {dtype!r}))
prompt = [1, 504, 3937, 314, 260, 3575, 282, 4649, 47, 2]
minillm.generate(model, prompt, 4)  # eager warm-up: C++ kernels built, caches touched
t0 = time.perf_counter(); first = minillm.generate(model, prompt, 4, compile=True)
t1 = time.perf_counter(); again = minillm.generate(model, prompt, 4, compile=True)
t2 = time.perf_counter()
assert first == again == minillm.generate(model, prompt, 4)
print(json.dumps({{"first_call_s": t1 - t0, "second_call_s": t2 - t1}}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for name in ("cold", "warm", "warm again"):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c",
                                  CHILD.format(root=str(ROOT), dtype=args.dtype)],
                                 env=env, capture_output=True, text=True, check=True)
            runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name]["process_s"] = time.perf_counter() - t0
            print(f"{name:11s} first compiled call {runs[name]['first_call_s']:6.1f} s, second "
                  f"{runs[name]['second_call_s']:5.2f} s (process {runs[name]['process_s']:.0f} s)",
                  flush=True)
    result = {"benchmark": "compile_cache", "date": time.strftime("%Y-%m-%d %H:%M"),
              "dtype": args.dtype, "runs": runs}
    # The children load the model on the default device, as the parent would.
    write_result(args.out, result, device=default_device())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
