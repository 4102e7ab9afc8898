"""`Linear`: the one layer through which the model multiplies by a weight matrix.

Every weight product of `LlamaModel` goes through a `Linear`: the four projections of each
layer (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`) and the LM head. That makes it the
seam for the techniques that change how a weight is stored or where it lives:

- quantization replaces a `Linear` by a subclass that keeps integer weights and scales;
- tensor parallelism replaces it by a column- or row-parallel subclass that holds a shard;
- a test replaces it by a subclass that counts calls.

The model's forward only calls `module(x)`; it never reads `.weight` itself. The contract a
replacement keeps: `forward(x [..., in_features]) -> [..., out_features]`, and the
attributes `in_features` and `out_features`.

Invariants: `weight` is [out_features, in_features] (what `F.linear` wants) whatever its
memory layout; there is no bias (Llama has none). A weight may be shared with another
module (the tied LM head shares the embedding's Parameter): code that replaces
`weight` must re-tie it (`LlamaModel.use_matvec_layout` does).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import cpu_linear


class Linear(nn.Module):
    """y = x Wᵀ with W [out_features, in_features] and no bias.

    `weight=None` allocates W (initialized as `nn.Linear` does, drawing the same random
    numbers); passing a Parameter shares it instead (the tied LM head).
    """

    def __init__(self, in_features: int, out_features: int,
                 weight: nn.Parameter | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features))
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        elif tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"a shared weight must be [out_features, in_features] = "
                             f"[{out_features}, {in_features}], got {tuple(weight.shape)}")
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A few fp32 or bf16 rows on the CPU (decode, speculative verify, a small batch): the
        # C++ kernel that streams W once. Anything else (prefill, GPU, autograd): F.linear.
        # Which build (or BLAS) runs these rows was measured on this CPU (`cpu_select`).
        if cpu_linear.applies(x, self.weight) and (
                kernel := cpu_linear.kernel_for(x, self.weight)) is not None:
            return cpu_linear.linear(x, self.weight, kernel)
        return F.linear(x, self.weight)

    def gemv_weight(self):
        """The weight as the decode GEMV reads it (`minillm.layers.fused.norm_linear`), or
        None: a subclass with a forward of its own (a sharded or counting Linear) must be
        called, not bypassed."""
        return self.weight if type(self) is Linear else None

    def use_matvec_layout(self) -> None:
        """Store the weight in the layout that decoding reads fastest on this machine. Same
        values, same [out, in] shape (a transposed view where needed), same `F.linear`.

        Why: batch-1 decode does one matrix-vector product per weight, and on a CPU its
        speed is how fast the matrix streams from memory. With the C++ small-M kernel
        (`cpu_linear`, where this CPU's selection runs it for some row count of this dtype
        and width), that is W as stored by `nn.Linear`, [out, in] contiguous: each
        output's weights are one contiguous row. Without it, BLAS's matrix-vector product
        streams long contiguous rows faster than short ones, so gate|up [3072, 576] and the
        49152 x 576 LM head run faster stored as [in, out], and down_proj [576, 1536] as it
        is (`benchmarks/matvec_layout.py` measures each shape both ways). A subclass whose
        weight is not a float matrix (a quantized one) is left alone.
        """
        w = getattr(self, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
            return
        if w.device.type == "cpu" and cpu_linear.uses_kernel(w.dtype, w.shape[1]):
            want_transposed = False
        else:
            want_transposed = w.shape[0] >= w.shape[1]
        if want_transposed and not w.t().is_contiguous():
            new = w.t().contiguous().t()
        elif not want_transposed and not w.is_contiguous():
            new = w.contiguous()
        else:
            return
        with torch.no_grad():
            self.weight = nn.Parameter(new, requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
