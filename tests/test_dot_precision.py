"""fp32 stays fp32 on a GPU: the Triton kernels' fp32 dots compile to no TF32 instruction.

``minillm.kernels._dot.dot`` gives fp32 operands ``input_precision="ieee"``; Triton's
default would round them to TF32 on the tensor cores (an H100 run measured 3.7e-3 error on
fp32 FlashAttention, against 2e-5 allowed). The interpreter computes every dot in fp32
whatever the precision, so only the compiled code can show the difference: each kernel
with a ``tl.dot`` is compiled here for sm_90 (H100) with Triton's bundled ptxas, no GPU
needed, in fp32 (no ``.tf32`` in its PTX) and in bf16 (tensor-core bf16 products: the
16-bit path is unchanged).
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="the kernels are written in Triton")


def test_fp32_dots_compile_without_tf32_and_bf16_dots_use_tensor_cores():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = textwrap.dedent("""
        import torch
        torch.cuda.is_available = lambda: True  # define the kernels as compiled, not interpreted
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from minillm.kernels import tuning

        BUCKETS = {"flash_attention": dict(D=64, L=0, causal=1, varlen=0),
                   "paged_decode": dict(D=64, H=16, lse=1),
                   "w4a16_gemm": dict(M=64, bk=64)}
        for name, bucket in BUCKETS.items():
            t = tuning.tunables()[name]
            cfg = t.default
            for dt, bits in (("fp32", 32), ("bf16", 16)):
                b = {**bucket, "dt": bits}
                constexpr = {p.name for p in t.fn.params if p.is_constexpr}
                consts = {**t.constexprs(b),
                          **{k: v for k, v in cfg.kwargs.items() if k in constexpr}}
                types = {n: v.format(dt=dt) for n, v in t.signature_for(b).items()}
                sig = {n: "constexpr" if n in consts else types.get(n, "i32")
                       for n in t.fn.arg_names}
                ptx = triton.compile(ASTSource(t.fn, sig, consts),
                                     target=GPUTarget("cuda", 90, 32),
                                     options=dict(num_warps=cfg.num_warps,
                                                  num_stages=cfg.num_stages)).asm["ptx"]
                mma = [l.strip().split()[0] for l in ptx.splitlines()
                       if "mma" in l and not l.strip().startswith("//")]
                if dt == "fp32":
                    assert ".tf32" not in ptx, f"{name} fp32: TF32 in {sorted(set(mma))[:3]}"
                else:
                    assert any(".bf16" in m for m in mma), f"{name} bf16: no bf16 mma"
                print(name, dt, sorted(set(mma))[:2])
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-3000:]
