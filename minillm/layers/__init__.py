"""Layers that other parts of minillm swap in and out. Today: `Linear`, the one seam for
every weight matrix product in the model (see `minillm.layers.linear`)."""
from .linear import Linear

__all__ = ["Linear"]
