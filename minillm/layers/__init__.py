"""Layers that other parts of minillm swap in and out. Today: `Linear`, the one seam for
every weight matrix product in the model (see `minillm.layers.linear`), and `cpu_linear`,
the C++ kernel it sends a few rows to on a CPU; `fused`, the glue between the weight
products (RMSNorm, RoPE, SiLU·up, residual adds) in one pass per group on a CPU."""
from . import cpu_linear, fused
from .linear import Linear

__all__ = ["Linear", "cpu_linear", "fused"]
