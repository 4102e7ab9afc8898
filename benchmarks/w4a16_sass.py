"""What the W4A16 GEMV's K loop compiles to on sm_90: instructions per weight, without a GPU.

    python benchmarks/w4a16_sass.py [--arch 90] [--dtype bf16] [--sym]

Compiles each GEMV candidate tile of ``minillm.kernels.w4a16`` ahead of time (Triton's
bundled ptxas, as ``pin_configs.py`` does), disassembles the cubin with Triton's bundled
``cuobjdump -sass``, finds the K loop (the longest backward branch) and prints per tile:
the loop's instructions, the weights a thread handles per step (rows x K_THREADS chunks
of 32 columns over the program's threads), their ratio, the registers, and how many
shared-memory accesses or barriers sit in the loop (0 when no layout is converted). The
ratio is the GEMV's ALU cost: an H100 issues ~30 T thread-instructions/s, so 4 per weight
of a 4096 x 4096 matrix is ~2.3 us, well under the ~4 us of its 10 MB at 2.6 TB/s.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pin_configs  # noqa: F401  (compiled, not interpreted: it sets TRITON_INTERPRET=0)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import minillm.kernels.w4a16 as wk

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_gemv(bn: int, warps: int, k_threads: int, dtype: str, arch: int, zeros: bool):
    """The GEMV (BLOCK_M 1, BLOCK_K 64) as a real call specializes it: unit strides,
    16-byte aligned pointers."""
    fn = wk._w4a16_kernel
    types = {n: t.format(dt=dtype) for n, t in wk._SIGNATURE.items()}
    consts = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=64, HAS_ZEROS=zeros, ROW_ALIGN=4,
                  K_THREADS=k_threads, stride_xk=1, stride_on=1, stride_sg=1, stride_zg=1)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if types.get(n, "").startswith("*") or n == "stride_xm"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=1))


def sass_of(kernel) -> tuple[str, str]:
    """(SASS text, resource usage) of a compiled kernel, by cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        run = lambda *a: subprocess.run([str(BIN / "cuobjdump"), *a, f.name],  # noqa: E731
                                        capture_output=True, text=True, check=True).stdout
        return run("-sass"), run("-res-usage")


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop: from a backward branch's target to the branch."""
    code = [(int(a, 16), op.strip()) for a, op in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?);", sass)]
    loops = [[op for a, op in code if int(m.group(1), 16) <= a <= addr]
             for addr, text in code
             if (m := re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)) and int(m.group(1), 16) <= addr]
    return max(loops, key=len) if loops else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--sym", action="store_true", help="no zeros (a symmetric weight)")
    args = ap.parse_args(argv)
    tiles = sorted({(c.kwargs["BLOCK_N"], c.num_warps, c.kwargs["K_THREADS"])
                    for c in wk.W4A16_GEMV.configs})
    print(f"sm_{args.arch} {args.dtype} {'sym' if args.sym else 'asym'} GEMV, BLOCK_K 64")
    for bn, warps, kt in tiles:
        sass, usage = sass_of(compile_gemv(bn, warps, kt, args.dtype, args.arch, not args.sym))
        loop = main_loop(sass)
        weights = bn * kt * 32 / (32 * warps)
        ops = collections.Counter(op.split()[1] if op.startswith("@") else op.split()[0]
                                  for op in loop)
        smem = sum(n for op, n in ops.items() if op.startswith(("LDS", "STS", "BAR")))
        regs = re.search(r"REG:(\d+)", usage)
        print(f"BLOCK_N={bn:4d} warps={warps} K_THREADS={kt}: {len(loop):4d} instructions / "
              f"{weights:4.0f} weights = {len(loop) / weights:.2f} per weight, "
              f"{regs.group(1) if regs else '?'} registers, {smem} shared / barrier in the loop; "
              + ", ".join(f"{op} {n}" for op, n in ops.most_common(6)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
