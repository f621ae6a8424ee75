"""`LocalStridedBlockSparseAttn`: vLLM's block-sparse prefill module (local + vertical stride)
over packed variable-length sequences. On CUDA a Triton kernel visits only the attended key
blocks (time falls with density); elsewhere the PyTorch provider applies the dense mask.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn.ops.batch_invariant import batch_invariant_enabled
from pagedattn.ops.blocksparse import check_pattern, provider
from pagedattn.ops.checks import INDEX_DTYPES, check_dim, check_float, check_shape, check_tensor

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


class LocalStridedBlockSparseAttn(torch.nn.Module):
    """Block-sparse causal attention of the last q_len positions of each sequence.

    Query position p sees key j iff j <= p and (p // block_size - j // block_size <
    local_blocks or (j // block_size + offset_h) % vert_stride == 0), where offset_h =
    h * head_sliding_step + 1 for global query head h; head_sliding_step is 0 with
    homo_head (every head alike), else max(1, int(vert_stride / n_heads)) (vLLM's choice).
    `head_sliding_step` < 0 (an addition) slides per KV head instead (`homo_head_group`), so
    the prefill matches the paged decode of such a layer. n_heads counts all heads of every
    tensor-parallel rank; `active_head_range` = (first, end) are the heads q holds.
    `q_block_size` is the kernel's query tile (a power of two >= 16; default: chosen).
    `max_seqlen` bounds the sequence length; `dense_mask` draws the pattern up to it.
    device and dtype are accepted for vLLM compatibility: the kernels need no layout tensors.
    """

    def __init__(self, n_heads: int, max_seqlen: int, local_blocks: int, vert_stride: int,
                 block_size: int, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None, homo_head: bool = False,
                 active_head_range: Optional[tuple[int, int]] = None,
                 q_block_size: Optional[int] = None, *,
                 head_sliding_step: Optional[int] = None) -> None:
        super().__init__()
        for name, value in (("n_heads", n_heads), ("max_seqlen", max_seqlen)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        check_pattern(block_size, local_blocks, vert_stride)
        if vert_stride < 1:
            raise ValueError(f"vert_stride={vert_stride} must be >= 1 (1 is dense)")
        if q_block_size is not None and (q_block_size < 16 or q_block_size & (q_block_size - 1)):
            raise ValueError(f"q_block_size={q_block_size!r} must be a power of two >= 16")
        first, end = active_head_range if active_head_range is not None else (0, n_heads)
        if not 0 <= first < end <= n_heads:
            raise ValueError(f"active_head_range={active_head_range!r} must be (first, end) "
                             f"with 0 <= first < end <= n_heads={n_heads}")
        if homo_head:
            head_sliding_step = 0
        elif head_sliding_step is None:
            head_sliding_step = max(1, int(vert_stride / n_heads))
        self.n_heads, self.max_seqlen = n_heads, max_seqlen
        self.local_blocks, self.vert_stride, self.block_size = local_blocks, vert_stride, block_size
        self.homo_head, self.head_sliding_step = homo_head, int(head_sliding_step)
        self.active_head_range = (first, end)
        self.q_block_size = q_block_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_k: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
                sm_scale: Optional[float] = None, *, out: Optional[torch.Tensor] = None,
                batch_invariant: Optional[bool] = None) -> torch.Tensor:
        """q [total_q, heads in active_head_range, D], k/v [total_k, num_kv_heads, D] packed;
        cu_seqlens_k / cu_seqlens_q [batch + 1] int32 (cu_seqlens_q defaults to cu_seqlens_k:
        full prompts). Returns out [total_q, heads, D] (written in place when given).
        batch_invariant: as `blocksparse_paged_attention`'s."""
        check_tensor("q", q, 3, _FLOAT)
        device = q.device
        check_tensor("k", k, 3, (q.dtype,), device)
        check_tensor("v", v, 3, (q.dtype,), device)
        check_tensor("cu_seqlens_k", cu_seqlens_k, 1, INDEX_DTYPES, device)
        if cu_seqlens_q is None:
            if q.shape[0] != k.shape[0]:
                raise ValueError(f"q has {q.shape[0]} tokens and k {k.shape[0]}: pass "
                                 "cu_seqlens_q when queries are not the whole sequences")
            cu_seqlens_q = cu_seqlens_k
        check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES, device)
        check_dim("cu_seqlens_q", cu_seqlens_q, 0, cu_seqlens_k.shape[0], "batch + 1")
        first, end = self.active_head_range
        total_q, num_heads, head_size = q.shape
        check_dim("q", q, 1, end - first, f"the heads of active_head_range {(first, end)}")
        if tuple(k.shape) != tuple(v.shape) or k.shape[2] != head_size:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                             f"[total_k, num_kv_heads, {head_size}]")
        if num_heads % k.shape[1]:
            raise ValueError(f"q has {num_heads} heads, not a multiple of k's {k.shape[1]}")
        if out is None:
            out = torch.empty_like(q)
        check_shape("out", out, tuple(q.shape), (q.dtype,), device)
        provider(device).varlen_attention(
            q, k, v, out, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            sm_scale=head_size ** -0.5 if sm_scale is None else check_float("sm_scale", sm_scale),
            head_base=first, head_sliding_step=self.head_sliding_step,
            block_size=self.block_size, local_blocks=self.local_blocks,
            vert_stride=self.vert_stride, q_block_size=self.q_block_size,
            batch_invariant=batch_invariant_enabled(batch_invariant))
        return out

    def dense_mask(self, seq_len: Optional[int] = None, num_kv_heads: Optional[int] = None
                   ) -> torch.Tensor:
        """[active heads, L, L] bool: which key each query position of one full sequence of
        L (default max_seqlen) tokens sees; num_kv_heads is needed when head_sliding_step < 0."""
        from pagedattn.ops.torch.blocksparse import head_offsets, sparse_mask

        first, end = self.active_head_range
        group = self.n_heads // (num_kv_heads or self.n_heads)
        offsets = head_offsets(end - first, group, first, self.head_sliding_step,
                               torch.device("cpu"))
        pos = torch.arange(seq_len or self.max_seqlen)
        return sparse_mask(pos, pos, offsets, self.block_size, self.local_blocks,
                           self.vert_stride)

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, local_blocks={self.local_blocks}, "
                f"vert_stride={self.vert_stride}, block_size={self.block_size}, "
                f"head_sliding_step={self.head_sliding_step}, "
                f"active_head_range={self.active_head_range}")
