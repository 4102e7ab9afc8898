"""`QuantLinear`: a `Linear` whose weight is stored packed (see `packing`) and which runs on
the fastest path that reads it that way.

It plugs into the model through the `Linear` seam: same call, same `in_features` and
`out_features`, no float `weight` attribute. Paths, chosen per call:

- CPU, fp32, at most `cpu_kernels.MAX_ROWS` rows (decode, speculative verify, a small
  batch): the C++ kernels of `cpu_kernels`, which read the packed bytes and never build the
  float matrix. This is where quantization makes decode faster: the step streams 1/8 (W4)
  or 1/4 (W8) of fp32's bytes. Which build runs is measured per host
  (`cpu_kernels.kernel_for`); where the measurement found dequantize + BLAS faster for a
  bucket of rows, those rows take the next path.
- CUDA with 4-bit storage: the Triton W4A16 kernel (`minillm.kernels.w4a16`): a split-K
  GEMV at one row (decode), tiled above; a symmetric 4-bit weight passes no zeros (all 8),
  so the kernel reads only the nibbles and the scales. No value of a CUDA tensor is read on
  the host, so a CUDA graph can capture the decode step.
- CUDA with 8-bit storage (5 to 8 bits): the Triton W8A16 kernel (`minillm.kernels.w8a16`):
  tl.dot tiles that dequantize each weight tile in registers, so the step reads the bytes
  once instead of building the float matrix; capturable in a CUDA graph as above.
- CPU, more rows (prefill, a large engine step: compute-bound): `cpu_kernels.dequantize`
  writes the float matrix in one pass, then a BLAS GEMM. The same bits as the reference,
  several times faster than its elementwise PyTorch version (`benchmarks/quant_linear.py`).
- anything else: dequantize to x's dtype with PyTorch ops and `F.linear`
  (`reference_forward`), the reference every fast path is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers import Linear
from . import cpu_kernels
from .packing import dequantize_packed, pack, packed_bytes, storage_bits
from .weights import QuantizedWeight


class QuantLinear(Linear):
    """y = x Ŵᵀ with Ŵ = (u − zeros) · scales stored as `qweight`, `scales`, `zeros`."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int,
                 sym: bool, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        torch.nn.Module.__init__(self)  # not Linear.__init__: there is no float weight
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.sym = bits, group_size, sym
        cols = in_features * storage_bits(bits) // 8
        groups = in_features // group_size
        if tuple(qweight.shape) != (out_features, cols) or qweight.dtype != torch.uint8:
            raise ValueError(f"qweight must be uint8 [{out_features}, {cols}], got "
                             f"{qweight.dtype} {tuple(qweight.shape)}")
        for name, t in (("scales", scales), ("zeros", zeros)):
            if tuple(t.shape) != (out_features, groups):
                raise ValueError(f"{name} must be [{out_features}, {groups}], got {tuple(t.shape)}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.float())
        self.register_buffer("zeros", zeros.float())

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight) -> "QuantLinear":
        out_features, in_features = qw.shape
        return cls(in_features, out_features, qw.bits, qw.group_size, qw.sym, *pack(qw))

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) / .half() must move the packed weight but keep the scales and
        # zeros in fp32, bit for bit: every kernel computes (u − z) · s in fp32, and a scale
        # cast to bf16 and back has lost its low bits. They sit out the cast as int32 views
        # (Module casts floating-point tensors only) and move with everything else.
        for name in ("scales", "zeros"):
            self._buffers[name] = self._buffers[name].float().view(torch.int32)
        try:
            super()._apply(fn, recurse)
        finally:
            for name in ("scales", "zeros"):
                self._buffers[name] = self._buffers[name].view(torch.float32)
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Ŵ [out, in]."""
        return dequantize_packed(self.qweight, self.scales, self.zeros, self.bits, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (cpu_kernels.applies(x, self.qweight)
                and (variant := cpu_kernels.kernel_for(x, self.bits)) is not None):
            return cpu_kernels.quant_linear(x, self.qweight, self.scales, self.zeros,
                                            self.group_size, self.bits, variant)
        if x.is_cuda and storage_bits(self.bits) == 4:
            from ..kernels.w4a16 import w4a16_linear
            return w4a16_linear(x, self.qweight, self.scales, self._kernel_zeros(),
                                self.group_size)
        if x.is_cuda and storage_bits(self.bits) == 8:
            from ..kernels.w8a16 import w8a16_linear
            return w8a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size)
        if (x.device.type == "cpu" and self.qweight.device.type == "cpu"
                and not torch.compiler.is_compiling()  # Inductor fuses the reference's ops
                and cpu_kernels.load_kernel() is not None):
            w = cpu_kernels.dequantize(self.qweight, self.scales, self.zeros, self.bits)
            return F.linear(x, w.to(x.dtype))
        return self.reference_forward(x)

    def gemv_weight(self):
        """A 4-bit weight as the decode GEMV reads it (`kernels.decode_gemv.Int4Weight`; a
        symmetric one without zeros), so the glue before the product runs inside it on
        CUDA; None for other widths (their own paths run)."""
        if storage_bits(self.bits) != 4 or type(self) is not QuantLinear:
            return None
        from ..kernels.decode_gemv import int4_weight
        return int4_weight(self.qweight, self.scales, self._kernel_zeros(), self.group_size)

    def _kernel_zeros(self) -> torch.Tensor | None:
        """The zeros the Triton kernels read: None for a symmetric 4-bit weight (every zero
        point is 8, so they read none)."""
        return None if self.sym and self.bits == 4 else self.zeros

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize, then `F.linear`: the plain path."""
        return F.linear(x, self.dequantize(x.dtype))

    def nbytes(self) -> int:
        """Bytes of the weight as stored (what a decode step reads)."""
        return packed_bytes(self.out_features, self.in_features, self.bits, self.group_size,
                            self.sym)

    def extra_repr(self) -> str:
        g = "per-channel" if self.group_size == self.in_features else f"g{self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"w{self.bits} {g} {'sym' if self.sym else 'asym'}")
