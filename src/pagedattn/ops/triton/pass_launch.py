"""One pass of a planned attention launch: a kernel launch that knows its role in the plan."""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops.triton.attention_args import Outputs
from pagedattn.ops.triton.fast_launch import KernelLaunch, spec_key


class PassLaunch(KernelLaunch):
    """One pass of a plan: `name` ("decode", "prefill", "hopper" or "reduce"), its batch
    section, and for a split pass the partial states it writes instead of the outputs.
    `options`: compile options beyond warps and stages (batch-invariant passes compile
    without fused multiply-adds)."""

    def __init__(self, name: str, fn, grid: tuple, constexprs: dict, num_warps: int,
                 num_stages: int, batch: tuple, partials: Optional[Outputs] = None,
                 boxes: tuple = (), device: Optional[torch.device] = None,
                 dtypes: tuple = (), options: Optional[dict] = None):
        # The plan's (q, kv, out) dtypes belong to the launch's static key: run() keys its
        # calls without them (it checks them against the plan's by identity).
        super().__init__(fn, grid, constexprs, num_warps, num_stages,
                         spec_key(batch + (partials or ())) + dtypes, device, options)
        self.name, self.batch, self.partials = name, batch, partials
        self.boxes = boxes  # Hopper: (block_q, query heads per row block, block_n)
