"""A mean over the last dimension whose rows do not depend on the other rows: batch-invariant
model ops' CUDA path for aten's mean.dim (an RMSNorm's variance).

torch's reduction kernels split a long reduction over blocks chosen from the tensor's shape,
rows included. Here one program sums one row, in BLOCK_C-wide strips added in order and then
one tree over the strip, a compiled kernel for every row count: a row's adds depend on its
length alone. One launch where the portable form (a halving tree of torch adds) takes a
dozen, which in a decode step's CUDA graph was most of the mode's model-op cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 1024  # columns per strip: a hidden size of up to 1024 in one trip
NUM_WARPS = 4


@triton.jit
def _row_mean_kernel(X, Out, count, stride_x, BLOCK_C: tl.constexpr):
    """Out[r] = mean of X[r, :count] in float32, for row r = program id (a program a row:
    the row count is the grid's, never an argument, so one compiled kernel serves every
    batch)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    base = X + row.to(tl.int64) * stride_x
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, count, BLOCK_C):
        acc += tl.load(base + c0 + cols, mask=c0 + cols < count, other=0.0).to(tl.float32)
    tl.store(Out + row, tl.sum(acc, 0) / count)


def invariant_row_mean(x: torch.Tensor) -> torch.Tensor:
    """The float32 mean of each row of x [rows, count] (the last dimension's stride 1)."""
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)} and "
                         f"strides {x.stride()}")
    rows, count = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    if count == 0:
        return out.fill_(float("nan"))  # torch's mean of nothing
    _row_mean_kernel[(rows,)](x, out, count, x.stride(0), BLOCK_C=BLOCK_C,
                              num_warps=NUM_WARPS)
    return out
