"""Compile every CUDA autotune configuration of minillm's Triton kernels, without a GPU.

    TRITON_INTERPRET=0 python benchmarks/triton_compile_sweep.py [--arch 90] [--dtype bf16]
                                                                 [--only NAME] [--most N]

The interpreter accepts programs the compiler rejects, and the autotuner only meets its
configurations on a GPU. This compiles each one ahead of time for one target (triton's
``triton.compile`` with its bundled ptxas: sm_90 is H100, sm_80 A100) and reports, per
kernel, how many compiled, how many need more shared memory than the target has (the
autotuner skips those at run time), and any other error (a real bug), with the seconds
compilation took: a first GPU run pays that once per autotune key.
Exit code 1 if any configuration failed to compile.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections import Counter
from pathlib import Path

import torch

torch.cuda.is_available = lambda: True  # define the kernels as compiled, not interpreted
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile  # noqa: E402

# The modules (the package re-exports functions under the same names).
fa = importlib.import_module("minillm.kernels.flash_attention")
pd = importlib.import_module("minillm.kernels.paged_decode")
wk = importlib.import_module("minillm.kernels.w4a16")

SHARED_BYTES = {90: 232448, 89: 101376, 86: 101376, 80: 166912, 75: 65536}  # per block, max


def compile_one(fn, types: dict, consts: dict, cfg, arch: int) -> int:
    """Shared memory bytes of one compiled configuration."""
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    kernel = triton_compile(ASTSource(fn, sig, {**consts, **cfg.kwargs}),
                            target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return kernel.metadata.shared


def cases(dt: str):
    """(kernel name, jit function, pointer types, constexprs, configs), one per autotune key
    family; head_dim 64 and 128 for FlashAttention, SmolLM2's decode shape for the rest."""
    attn = {n: "*" + dt for n in ("Q", "K", "V", "Out")}
    attn.update(Lse="*fp32", cu_seqlens_q="*i32", cu_seqlens_k="*i32", qk_scale="fp32")
    for d in (64, 128):
        yield (f"flash_attention D={d}", fa._attn_fwd_kernel, attn,
               dict(IS_VARLEN=False, CAUSAL=True, STORE_LSE=False, BLOCK_D=d), fa._cuda_configs())
    paged = dict(Q="*" + dt, KC="*" + dt, VC="*" + dt, BlockTables="*i32", ContextLens="*i32",
                 Out="*fp32", Lse="*fp32", qk_scale="fp32")
    for lse in (False, True):
        yield (f"paged_decode STORE_LSE={lse}", pd._paged_decode_kernel, paged,
               dict(STORE_LSE=lse, BLOCK_H=16, BLOCK_D=64), pd._paged_decode_tuned.configs)
    w4 = dict(X="*" + dt, QW="*u8", Scales="*fp32", Zeros="*fp32", Out="*" + dt)
    for bucket in (0, 1, 2):
        yield (f"w4a16 M bucket {bucket}", wk._w4a16_kernel, w4,
               dict(BLOCK_K=64, GROUP_ALIGNED=True, EVEN_K=True),
               wk._prune_configs(wk._cuda_configs(), {"m_bucket": bucket}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_BYTES))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--only", default="", help="only the kernels whose name contains this")
    ap.add_argument("--most", type=int, help="at most this many configurations per kernel")
    args = ap.parse_args()
    failed = 0
    for name, fn, types, consts, configs in cases(args.dtype):
        if args.only not in name:
            continue
        configs = configs[:args.most]
        t0, outcome = time.perf_counter(), Counter()
        for cfg in configs:
            try:
                shared = compile_one(fn, types, consts, cfg, args.arch)
                fits = shared <= SHARED_BYTES[args.arch]
                outcome["ok" if fits else "too much shared memory"] += 1
            except Exception as e:  # noqa: BLE001  (reported; the sweep goes on)
                outcome["FAILED"] += 1
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:300]}")
        failed += outcome["FAILED"]
        secs = time.perf_counter() - t0
        print(f"sm_{args.arch} {args.dtype} {name}: {dict(outcome)} of {len(configs)} "
              f"configurations, {secs:.0f} s ({secs / len(configs):.1f} s each)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
