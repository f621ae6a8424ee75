"""`merge_attn_states`: combine two partial attention results over disjoint key sets.

Used by split-KV decoding, cascade attention (shared prefix + per-request suffix) and
context parallelism. Exact: out = (e^lse_p * out_p + e^lse_s * out_s) / (e^lse_p + e^lse_s).
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops import custom_ops
from pagedattn.ops.checks import check_tensor, require_tensor

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor,
                      prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                      suffix_lse: torch.Tensor,
                      output_lse: Optional[torch.Tensor] = None) -> None:
    """Write the merge of two partial states into `output` (and `output_lse` when given).

    Args:
        output, prefix_output, suffix_output: [num_tokens, num_heads, head_size].
        prefix_lse, suffix_lse, output_lse: [num_heads, num_tokens] float32. An LSE of +inf or
            -inf marks that part as empty; when both are empty the output is 0.
    """
    require_tensor("output", output, 3, _FLOAT)
    device, shape = output.device, tuple(output.shape)
    for name, t in (("output", output), ("prefix_output", prefix_output),
                    ("suffix_output", suffix_output)):
        require_tensor(name, t, 3, _FLOAT, device)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {shape}")
    for name, t in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse),
                    ("output_lse", output_lse)):
        if t is None and name != "output_lse":
            raise TypeError(f"{name} must be a torch.Tensor, got None")
        check_tensor(name, t, 2, (torch.float32,), device)
        if t is not None and tuple(t.shape) != (shape[1], shape[0]):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected [num_heads, num_tokens] = "
                f"{(shape[1], shape[0])}")
    custom_ops.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                                 output_lse)
