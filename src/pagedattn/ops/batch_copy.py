"""A batch's metadata copied into persistent buffers (what a metadata builder does each step
so that captured CUDA graphs read it): `plan_batch_copy` once per batch size, `run` per step.

The copy writes the batch's query_start_loc, seq_lens, block-table columns and slot_mapping
into the buffers' leading rows, and pads them for a larger captured batch: requests past the
batch start and end at the last token with no keys, slots past it are -1 (skipped). On CUDA
with Triton it is one kernel launch; elsewhere (and for a block table whose columns are not
unit-stride) the same as torch copies and fills.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops.providers import provider_name


class BatchCopyPlan:
    """The copy of batches of `num_reqs` requests, `num_tokens` slots and `width` block-table
    columns into the given buffers, padded to `pad_reqs` requests and `pad_tokens` slots."""

    def __init__(self, buffers: tuple[torch.Tensor, ...], num_reqs: int, num_tokens: int,
                 width: int, pad_reqs: int, pad_tokens: int, impl):
        qsl, seq_lens, table, slots = self.buffers = buffers
        self.impl = impl
        self.views = (qsl[:num_reqs + 1], seq_lens[:num_reqs], table[:num_reqs, :width],
                      slots[:num_tokens])
        self.pad_requests = (qsl[num_reqs + 1:pad_reqs + 1], seq_lens[num_reqs:pad_reqs]) \
            if pad_reqs > num_reqs else None
        self.pad_slots = slots[num_tokens:pad_tokens] if pad_tokens > num_tokens else None

    def run(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_table: torch.Tensor, slot_mapping: torch.Tensor, num_actual_tokens: int
            ) -> None:
        """The batch's tensors (on the buffers' device, int32 or int64; block_table
        [num_reqs, width]); num_actual_tokens: where padded requests start."""
        if self.impl is not None and block_table.stride(-1) == 1:
            self.impl.run(query_start_loc, seq_lens, block_table, slot_mapping, *self.buffers,
                          num_actual_tokens)
            return
        for dst, src in zip(self.views, (query_start_loc, seq_lens, block_table, slot_mapping)):
            dst.copy_(src, non_blocking=True)
        if self.pad_requests is not None:  # a captured graph reads these as empty requests
            self.pad_requests[0].fill_(num_actual_tokens)
            self.pad_requests[1].fill_(0)
        if self.pad_slots is not None:
            self.pad_slots.fill_(-1)


def plan_batch_copy(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, slot_mapping: torch.Tensor, *, num_reqs: int,
                    num_tokens: int, width: int, pad_reqs: int = 0, pad_tokens: int = 0,
                    provider: Optional[str] = None) -> BatchCopyPlan:
    """Plan the copy into these buffers: query_start_loc [R + 1], seq_lens [R], block_table
    [R, W] int32 and slot_mapping [T] int64, one device, R >= max(num_reqs, pad_reqs),
    W >= width, T >= max(num_tokens, pad_tokens)."""
    buffers = (query_start_loc, seq_lens, block_table, slot_mapping)
    limits = ((max(num_reqs, pad_reqs) + 1, query_start_loc.shape[0], "query_start_loc rows"),
              (max(num_reqs, pad_reqs), seq_lens.shape[0], "seq_lens rows"),
              (max(num_reqs, pad_reqs), block_table.shape[0], "block_table rows"),
              (width, block_table.shape[1], "block_table columns"),
              (max(num_tokens, pad_tokens), slot_mapping.shape[0], "slot_mapping rows"))
    for need, have, what in limits:
        if need > have:
            raise ValueError(f"plan_batch_copy: the batch needs {need} {what}; the buffer has "
                             f"{have}")
    device = query_start_loc.device
    impl = None
    if device.type == "cuda" and (provider or provider_name(device)) == "triton":
        from pagedattn.ops.triton.batch_copy import TritonBatchCopyPlan

        impl = TritonBatchCopyPlan(num_reqs, width, num_tokens, pad_reqs, pad_tokens, device)
    return BatchCopyPlan(buffers, num_reqs, num_tokens, width, pad_reqs, pad_tokens, impl)
