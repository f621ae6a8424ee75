"""Merging two partial attention states (LSE-weighted) in plain PyTorch."""

from __future__ import annotations

import math
from typing import Optional

import torch


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor,
                      prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                      suffix_lse: torch.Tensor, output_lse: Optional[torch.Tensor]) -> None:
    """output [T, H, D] = exact softmax merge; LSEs are [H, T] float32, +-inf = empty part."""
    pl = prefix_lse.float().masked_fill(torch.isinf(prefix_lse), -math.inf)
    sl = suffix_lse.float().masked_fill(torch.isinf(suffix_lse), -math.inf)
    m = torch.maximum(pl, sl)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wp, ws = torch.exp(pl - m), torch.exp(sl - m)
    total = wp + ws
    safe = torch.where(total == 0, torch.ones_like(total), total)
    wp, ws = (wp / safe).T[..., None], (ws / safe).T[..., None]
    output.copy_(prefix_output.float() * wp + suffix_output.float() * ws)
    if output_lse is not None:
        output_lse.copy_(torch.log(total) + m)
