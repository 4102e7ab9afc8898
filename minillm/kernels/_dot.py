"""``tl.dot`` with fp32 kept fp32: the one place the Triton kernels choose a dot's precision.

On NVIDIA GPUs ``tl.dot`` of two fp32 tiles defaults to TF32 tensor cores: each input is
rounded to a 10-bit mantissa first (about 1e-3 relative error per product). PyTorch's own
fp32 matmuls on CUDA do not do that unless asked (``torch.backends.cuda.matmul.allow_tf32``
is off by default), and fp32 is this project's reference dtype: the attention kernels in
fp32 must give the fp32 answer on a GPU as they do in the interpreter, or a fp32 model
with the Triton backend stops matching the torch backend (an H100 run measured 3.7e-3
against fp32's 2e-5 before this). So fp32 inputs take ``input_precision="ieee"`` (plain
fp32 FMAs, no tensor cores: slower, and only the reference dtype pays it); fp16 and bf16
inputs are multiplied exactly into an fp32 accumulator either way and keep the default.

The branch is on the operands' dtype, a compile-time constant: each dtype compiles its own
program anyway, so this adds no argument and no run-time test. The interpreter computes
every dot in its inputs' precision, so it behaves the same with or without this.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc=None):
    """``a @ b (+ acc)`` in fp32; fp32 operands multiplied in true fp32 (see the module)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
