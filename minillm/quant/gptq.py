"""GPTQ (Frantar et al., 2022): round one column at a time and push each rounding error onto
the columns not yet rounded, weighted by the inverse Hessian of the layer's inputs.

For a linear layer y = W x, the error that matters is the output's, ‖W X − Ŵ X‖², not the
weights'. Its Hessian in each row of W is H = 2 X Xᵀ / n ([in, in], the same for every row).
Rounding column i changes the output by (ŵ_i − w_i) x_i; the best correction of the columns
after i (Optimal Brain Surgeon) is

    W[:, i+1:] −= (w_i − ŵ_i) / [H⁻¹]_ii · [H⁻¹]_{i, i+1:}

and with the upper Cholesky factor U of H⁻¹ (H⁻¹ = Uᵀ U) the row i of U holds exactly the
factors needed at step i, with the earlier columns already eliminated. So:

- damp: H += percdamp · mean(diag H) · I (keeps the Cholesky stable);
- dead columns (diag H = 0: an input that is always zero) get H_ii = 1 and weight 0;
- U = cholesky(H⁻¹, upper);
- for each block of `blocksize` columns: round column by column with error feedback inside
  the block, then apply the block's accumulated errors to all later columns at once (the
  "lazy batch" update: the same result, far fewer memory passes);
- `act_order`: columns with the largest diag(H) (the most active inputs) go first, while
  there is the most freedom left to absorb their error; the permutation is undone at the end.

Groups: a group's (scale, zero) are fixed when the first of its columns is reached, from
the weights as they are then (already corrected for the errors of earlier columns), so the
grid fits what is actually rounded. Groups are always contiguous in the original column
order (with `act_order` too), so the result has the same layout as `rtn`'s.

Invariant (tested): with H = I nothing couples the columns, and GPTQ equals RTN.
"""
from __future__ import annotations

import torch

from .weights import (QuantizedWeight, check_bits_and_group, check_matrix, group_params,
                      quantize_with)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X Xᵀ / n for inputs x [..., in] (n rows), in float64 for a stable inverse."""
    x = x.reshape(-1, x.shape[-1]).double()
    return 2.0 * x.T @ x / x.shape[0]


def gptq(w: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int | None = 64,
         sym: bool = False, percdamp: float = 0.01, blocksize: int = 128,
         act_order: bool = False) -> QuantizedWeight:
    """Quantize `w` [out, in] with GPTQ given the inputs' Hessian `H` [in, in] (`hessian`)."""
    w = check_matrix(w)
    out_features, in_features = w.shape
    g = check_bits_and_group(bits, group_size, in_features)
    if not isinstance(H, torch.Tensor) or tuple(H.shape) != (in_features, in_features):
        raise ValueError(f"H must be the [in, in] = [{in_features}, {in_features}] Hessian of "
                         f"the layer's inputs, got "
                         f"{tuple(H.shape) if isinstance(H, torch.Tensor) else type(H).__name__}")
    if not 0 <= percdamp < 1:
        raise ValueError(f"percdamp must be in [0, 1), got {percdamp}")
    if not isinstance(blocksize, int) or blocksize <= 0:
        raise ValueError(f"blocksize must be a positive integer, got {blocksize!r}")

    W = w.detach().double().clone()
    H = H.detach().double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    # Index bookkeeping stays on the host (read per column: no device sync); the matrices
    # stay on w's device.
    col_of = perm.cpu() if perm is not None else torch.arange(in_features)  # original column

    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(in_features, dtype=H.dtype,
                                                          device=H.device)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    num_groups = in_features // g
    scale = torch.zeros(out_features, num_groups, dtype=torch.float64, device=W.device)
    zero = torch.zeros_like(scale)
    fixed = torch.zeros(num_groups, dtype=torch.bool)
    Q = torch.zeros_like(W)
    # Where each original column sits in the working (possibly permuted) order.
    pos = torch.empty(in_features, dtype=torch.long)
    pos[col_of] = torch.arange(in_features)

    for b0 in range(0, in_features, blocksize):
        b1 = min(b0 + blocksize, in_features)
        W1, U1 = W[:, b0:b1].clone(), U[b0:b1, b0:b1]
        Err1 = torch.zeros_like(W1)
        for i in range(b1 - b0):
            grp = int(col_of[b0 + i]) // g
            if not fixed[grp]:
                # The group's columns as they are now: those in this block from W1 (already
                # corrected), the rest from W (corrected up to this block).
                cols = pos[grp * g:(grp + 1) * g]
                current = W[:, cols].clone()
                inside = (cols >= b0) & (cols < b1)
                current[:, inside] = W1[:, cols[inside] - b0]
                s, z = group_params(current.float(), bits, sym)
                scale[:, grp], zero[:, grp] = s[:, 0].double(), z[:, 0].double()
                fixed[grp] = True
            s, z = scale[:, grp:grp + 1], zero[:, grp:grp + 1]
            col = W1[:, i:i + 1]
            q = quantize_with(col, s, z, bits, sym).double()
            Q[:, b0 + i] = q[:, 0]
            dq = (q - z) * s
            err = (col - dq) / U1[i, i]
            W1[:, i:] -= err @ U1[i:i + 1, i:]
            Err1[:, i] = err[:, 0]
        W[:, b0:b1] = W1
        W[:, b1:] -= Err1 @ U[b0:b1, b1:]  # the lazy update of every later column

    if perm is not None:
        Q = Q[:, pos]
    return QuantizedWeight(q=Q.round().to(torch.int16), scale=scale.float(), zero=zero.float(),
                           bits=bits, group_size=g, sym=sym)
