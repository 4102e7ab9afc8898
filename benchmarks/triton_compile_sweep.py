"""Compile every candidate tile configuration of minillm's Triton kernels, without a GPU.

    python benchmarks/triton_compile_sweep.py [--arch 90] [--dtype bf16] [--only NAME] [--most N]

The interpreter accepts programs the compiler rejects, and autotuning (``MINILLM_AUTOTUNE=1``,
``gpu_check.py --autotune``) only meets the candidates on a GPU. This compiles, ahead of
time for one target (``triton.compile`` with Triton's bundled ptxas: sm_90 is H100, sm_80
A100), every candidate of every registered ``tuning.Tunable`` for a few representative
buckets per kernel, and reports per kernel and bucket how many compiled, how many need more
shared memory than the target has (the search skips those at run time), and any other
error (a real bug), with the seconds compilation took: an autotuning run pays that once per
bucket. ``benchmarks/pin_configs.py --check`` compiles the *pinned* configs of *every*
bucket; this sweeps the *candidates* of a few. Exit code 1 if any configuration failed to
compile.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from pin_configs import SHARED_BYTES, compile_time_kwargs, shared_bytes, tuning

DTYPE_BITS = {"bf16": 16, "fp16": 16}

# A few buckets per kernel (the rest differ in sizes only): head dim 64 and 128 for
# FlashAttention, SmolLM2's decode shapes for paged decode, and for W4A16 the GEMV (one
# row) with a g64 / g32 layout, 16 rows, the tiled GEMM at 256 rows; the symmetric
# (no zeros) variant of the W4A16 kernel is compiled too (its constexpr HAS_ZEROS=False);
# the decode GEMV at a 4-bit and a 16-bit product.
REPRESENTATIVE = {
    "flash_attention": [dict(D=64, L=1, causal=1, varlen=0), dict(D=128, L=1, causal=1, varlen=1)],
    "paged_decode": [dict(D=64, H=16, lse=0), dict(D=64, H=16, lse=1)],
    "w4a16_gemv": [dict(M=1, bk=64, N=1, K=1), dict(M=1, bk=32, N=0, K=0)],
    "w4a16_small_m": [dict(M=16, bk=64, N=1, K=1)],
    "w4a16_gemm": [dict(M=256, bk=64)],
    # the decode GEMV: SmolLM2's down in 4 bits (g64, SiLU·up), its q|k|v in 16 bits (norm)
    "decode_gemv": [dict(w=64, p=2, N=0, K=1), dict(w=0, p=1, N=0, K=0)],
}
EXTRA_CONSTEXPRS = {"w4a16_gemv": [{}, {"HAS_ZEROS": False}], "w4a16_small_m": [{}],
                    "w4a16_gemm": [{}]}


def candidates(name: str, t, bucket: dict) -> list:
    """The configs a launch in ``bucket`` may run: the decode GEMV's 4-bit tiles for a 4-bit
    weight and its float tiles for a float one (the other kind's would compile programs no
    launch takes); every candidate of the other kernels."""
    if name == "decode_gemv":
        from minillm.kernels import decode_gemv as dg

        return [dg._config(*tile) for tile in (dg.INT4_TILES if bucket["w"] else dg.DENSE_TILES)]
    return list(t.configs)



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_BYTES))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BITS))
    ap.add_argument("--only", default="", help="only the kernels whose name contains this")
    ap.add_argument("--most", type=int, help="at most this many configurations per kernel")
    args = ap.parse_args()
    failed = 0
    for name, t in tuning.tunables().items():
        if args.only not in name:
            continue
        for partial in REPRESENTATIVE.get(name, [{}]):
            bucket = {**partial, "dt": DTYPE_BITS[args.dtype]}
            configs = candidates(name, t, bucket)[:args.most]
            for extra in EXTRA_CONSTEXPRS.get(name, [{}]):
                t0, outcome, seen = time.perf_counter(), Counter(), set()
                for cfg in configs:
                    key = (tuple(sorted({**compile_time_kwargs(t, cfg), **extra}.items())),
                           cfg.num_warps, cfg.num_stages)
                    if key in seen:  # the same program (W4A16's SPLIT_K is not compiled in)
                        continue
                    seen.add(key)
                    try:
                        shared = shared_bytes(t, bucket, cfg, args.arch, extra, args.dtype)
                        fits = shared <= SHARED_BYTES[args.arch]
                        outcome["ok" if fits else "too much shared memory"] += 1
                    except Exception as e:  # noqa: BLE001  (reported; the sweep goes on)
                        outcome["FAILED"] += 1
                        print(f"  {name} {bucket} {extra} {cfg}: {type(e).__name__}: "
                              f"{str(e)[:300]}")
                failed += outcome["FAILED"]
                secs = time.perf_counter() - t0
                print(f"sm_{args.arch} {args.dtype} {name} {tuning.bucket_key(bucket)}"
                      f"{' ' + str(extra) if extra else ''}: {dict(outcome)} of {len(seen)} "
                      f"configurations, {secs:.0f} s ({secs / max(len(seen), 1):.1f} s each)",
                      flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
