"""A batch's metadata into a builder's persistent buffers, in one launch.

A metadata builder copies four tensors per step (query_start_loc, seq_lens, the block table's
columns, slot_mapping) into buffers that captured CUDA graphs read, and pads them for the
largest captured batch (empty requests, skipped slots): four to seven torch calls of
5-12 us of host time each on a GPU host. This kernel does all of it: program (i, s) copies
block i of segment s (0: query_start_loc, 1: seq_lens, 2: block-table rows, 3: slots),
converting to the buffers' dtypes, and writes the padding past the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedattn.ops.triton.fast_launch import KernelLaunch, aligned

BLOCK = 1024


@triton.jit(do_not_specialize=["num_reqs", "width", "num_tokens", "pad_reqs", "pad_tokens",
                               "end_tokens", "stride_src", "stride_dst"])
def _batch_copy_kernel(qsl_src, seq_src, table_src, slot_src, qsl_dst, seq_dst, table_dst,
                       slot_dst, num_reqs, width, num_tokens, pad_reqs, pad_tokens, end_tokens,
                       stride_src, stride_dst, BLOCK: tl.constexpr):
    segment = tl.program_id(1)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if segment == 0:  # query_start_loc; padded requests start (and end) at the last token
        n = num_reqs + 1
        starts = tl.load(qsl_src + i, mask=i < n, other=0).to(tl.int32)
        tl.store(qsl_dst + i, tl.where(i < n, starts, end_tokens),
                 mask=i < tl.maximum(n, pad_reqs + 1))
    elif segment == 1:  # seq_lens; padded requests have none
        lens = tl.load(seq_src + i, mask=i < num_reqs, other=0).to(tl.int32)
        tl.store(seq_dst + i, lens, mask=i < tl.maximum(num_reqs, pad_reqs))
    elif segment == 2:  # block-table rows [num_reqs, width] into rows of stride_dst
        row = i // tl.maximum(width, 1)  # (an empty batch: nothing stored)
        col = i - row * width
        ok = i < num_reqs * width
        blocks = tl.load(table_src + row.to(tl.int64) * stride_src + col, mask=ok, other=0)
        tl.store(table_dst + row.to(tl.int64) * stride_dst + col, blocks.to(tl.int32), mask=ok)
    else:  # slot_mapping; padded tokens are skipped (-1)
        slots = tl.load(slot_src + i, mask=i < num_tokens, other=-1).to(tl.int64)
        tl.store(slot_dst + i, tl.where(i < num_tokens, slots, -1),
                 mask=i < tl.maximum(num_tokens, pad_tokens))


class TritonBatchCopyPlan:
    """The copy of batches of `num_reqs` requests, `width` block-table columns and
    `num_tokens` slots, padded to `pad_reqs` requests and `pad_tokens` slots (0: no
    padding); `run` launches it with the step's tensors."""

    def __init__(self, num_reqs: int, width: int, num_tokens: int, pad_reqs: int,
                 pad_tokens: int, device: torch.device):
        self.ints = (num_reqs, width, num_tokens, pad_reqs, pad_tokens)
        span = max(num_reqs + 1, pad_reqs + 1, num_reqs * width, num_tokens, pad_tokens, 1)
        self.launch = KernelLaunch(_batch_copy_kernel, (triton.cdiv(span, BLOCK), 4),
                                   dict(BLOCK=BLOCK), 4, 1, (), device)

    def run(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_table: torch.Tensor, slot_mapping: torch.Tensor, qsl_dst: torch.Tensor,
            seq_dst: torch.Tensor, table_dst: torch.Tensor, slot_dst: torch.Tensor,
            end_tokens: int) -> None:
        """Sources: the batch's tensors (int32 or int64, block-table columns unit-stride);
        destinations: the whole persistent buffers (int32; slots int64)."""
        sources = (query_start_loc, seq_lens, block_table, slot_mapping)
        call_key = None
        if aligned(*sources, qsl_dst, seq_dst, table_dst, slot_dst):
            call_key = tuple(t.dtype for t in sources)
        self.launch((*sources, qsl_dst, seq_dst, table_dst, slot_dst, *self.ints, end_tokens,
                     block_table.stride(0), table_dst.stride(0)), call_key)
