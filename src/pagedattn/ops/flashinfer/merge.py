"""FlashInfer's merges of partial attention states: `merge_state`, `merge_state_in_place`,
`merge_states`. A state is (v [seq, heads, dim], s [seq, heads] float32), s the base-2 LSE of
the scores over one part of the keys; merging parts over disjoint keys is exact. Each merge is
`merge_attn_states` (Triton on CUDA, PyTorch elsewhere); an LSE of -inf marks an empty part.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops.flashinfer.plan import LOG2E
from pagedattn.ops.merge import merge_attn_states


def _check(v_name: str, v: torch.Tensor, s_name: str, s: torch.Tensor) -> None:
    if not isinstance(v, torch.Tensor) or v.dim() != 3:
        raise ValueError(f"{v_name} must be [seq_len, num_heads, head_dim]; got "
                         f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or \
            tuple(s.shape) != tuple(v.shape[:2]):
        raise ValueError(f"{s_name} is {getattr(s, 'dtype', type(s).__name__)} "
                         f"{tuple(getattr(s, 'shape', ()))}; expected float32 [seq_len, "
                         f"num_heads] = {list(v.shape[:2])}")


def _merge(v_a, s_a, v_b, s_b, out_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of two states; s in and out base 2 [seq, heads]."""
    v = torch.empty(v_a.shape, dtype=out_dtype, device=v_a.device)
    s = torch.empty(s_a.shape[1], s_a.shape[0], dtype=torch.float32, device=s_a.device)
    merge_attn_states(v, v_a, (s_a / LOG2E).T.contiguous(), v_b, (s_b / LOG2E).T.contiguous(),
                      s)
    return v, s.T * LOG2E


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states over disjoint keys: v [seq_len, num_heads, head_dim] (fp16/bf16/fp32)
    and base-2 LSEs s [seq_len, num_heads] float32 -> (v merged in v_a's dtype, s merged)."""
    _check("v_a", v_a, "s_a", s_a)
    _check("v_b", v_b, "s_b", s_b)
    if v_a.shape != v_b.shape:
        raise ValueError(f"v_a {tuple(v_a.shape)} and v_b {tuple(v_b.shape)} differ")
    return _merge(v_a, s_a, v_b, s_b, v_a.dtype)


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor,
                         s_other: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
    """Merge (v_other, s_other) into (v, s) in place; with mask (bool [seq_len]) only the rows
    where it is True (the others keep their state; no host sync, CUDA-graph safe)."""
    _check("v", v, "s", s)
    _check("v_other", v_other, "s_other", s_other)
    if v.shape != v_other.shape:
        raise ValueError(f"v {tuple(v.shape)} and v_other {tuple(v_other.shape)} differ")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (v.shape[0],)):
        raise ValueError(f"mask must be bool [seq_len={v.shape[0]}]; got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    merged_v, merged_s = _merge(v, s, v_other, s_other, v.dtype)
    if mask is None:
        v.copy_(merged_v)
        s.copy_(merged_s)
    else:
        v.copy_(torch.where(mask[:, None, None], merged_v, v))
        s.copy_(torch.where(mask[:, None], merged_s, s))


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge num_states states per row: v [seq_len, num_states, num_heads, head_dim], s
    [seq_len, num_states, num_heads] float32 base 2 -> (v [seq_len, num_heads, head_dim] in v's
    dtype, s [seq_len, num_heads]). Partial results are kept in float32 between merges."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError("v must be [seq_len, num_states, num_heads, head_dim]; got "
                         f"{tuple(getattr(v, 'shape', ()))}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or \
            tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(f"s is {getattr(s, 'dtype', None)} {tuple(getattr(s, 'shape', ()))}; "
                         f"expected float32 [seq_len, num_states, num_heads] = "
                         f"{list(v.shape[:3])}")
    if v.shape[1] == 0:
        raise ValueError("merge_states needs at least one state (num_states = 0)")
    acc_v, acc_s = v[:, 0].float(), s[:, 0]
    for i in range(1, v.shape[1]):
        acc_v, acc_s = _merge(acc_v, acc_s, v[:, i].float(), s[:, i], torch.float32)
    return acc_v.to(v.dtype), acc_s.contiguous()
