"""Index checks of the public ops: the values inside cu_seqlens, seqused_k, block_table and
slot_mapping, against the tensors they index.

They copy those tensors to the host (a GPU sync), so the ops run them only when
PAGEDATTN_CHECK_INDICES=1; the PyTorch provider also runs them to explain an IndexError of
its own indexing. A metadata builder checks the same things on the host copies it already
has, for free (pagedattn.metadata_checks). Each error names the argument, the offending
entry and what is allowed.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedattn import envs


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> torch.Tensor:
    """cu [batch + 1] starts at 0, never decreases, ends <= total; returns the lengths."""
    cu = cu.cpu().long()
    if cu.shape[0] and int(cu[0]) != 0:
        raise ValueError(f"{name}[0]={int(cu[0])}; it must start at 0")
    lens = cu[1:] - cu[:-1]
    if bool((lens < 0).any()):
        (r,) = _first(lens < 0)
        raise ValueError(f"{name} is not monotone: {name}[{r}]={int(cu[r])} > "
                         f"{name}[{r + 1}]={int(cu[r + 1])} (request {r})")
    if cu.shape[0] and int(cu[-1]) > total:
        raise ValueError(f"{name}[-1]={int(cu[-1])} but only {total} tokens are given")
    return lens


def check_attention_indices(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seqused_k: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor],
                            block_table: Optional[torch.Tensor], max_seqlen_q: int,
                            max_seqlen_k: int) -> None:
    """ValueError naming the argument if an index of flash_attn_varlen_func is out of range."""
    q_lens = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    if q_lens.numel() and int(q_lens.max()) > max_seqlen_q:
        (r,) = _first(q_lens > max_seqlen_q)
        raise ValueError(f"request {r} has {int(q_lens[r])} query tokens > max_seqlen_q="
                         f"{max_seqlen_q}; max_seqlen_q must bound every query")
    used = seqused_k.cpu().long()
    bad = (used < 0) | (used > max_seqlen_k)
    if bool(bad.any()):
        (r,) = _first(bad)
        raise ValueError(f"seqused_k[{r}]={int(used[r])} is outside 0..max_seqlen_k="
                         f"{max_seqlen_k}")
    if block_table is None:
        k_lens = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        if bool((used > k_lens).any()):
            (r,) = _first(used > k_lens)
            raise ValueError(f"seqused_k[{r}]={int(used[r])} > {int(k_lens[r])} keys given "
                             f"for request {r} by cu_seqlens_k")
        return
    check_block_table(block_table, used, k.shape[1], k.shape[0])


def check_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                      num_blocks: int) -> None:
    """Block ids in the columns each request uses must be in 0..num_blocks-1 (a negative id
    would wrap around to another request's block)."""
    table = block_table.cpu().long()
    blocks_used = (seq_lens.cpu().long() + block_size - 1) // block_size
    used = torch.arange(table.shape[1])[None, :] < blocks_used[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        r, c = _first(bad)
        raise ValueError(f"block_table[{r}, {c}]={int(table[r, c])} (request {r}) is not a "
                         f"block of the cache: allowed 0..{num_blocks - 1}")


def check_slot_mapping(slot_mapping: torch.Tensor, key_cache: torch.Tensor) -> None:
    """Slots must be < num_blocks * block_size of the cache (negative: skipped)."""
    slots = slot_mapping.cpu().long()
    limit = key_cache.shape[0] * key_cache.shape[1]
    if bool((slots >= limit).any()):
        (t,) = _first(slots >= limit)
        raise ValueError(f"slot_mapping[{t}]={int(slots[t])} is beyond the cache: "
                         f"{key_cache.shape[0]} blocks of {key_cache.shape[1]} hold slots "
                         f"0..{limit - 1} (negative: skip)")


def check_slots_if_asked(slot_mapping: torch.Tensor, key_cache: torch.Tensor) -> None:
    """`check_slot_mapping` when PAGEDATTN_CHECK_INDICES=1 (the cache-write op's gate)."""
    if envs.PAGEDATTN_CHECK_INDICES:
        check_slot_mapping(slot_mapping, key_cache)


def check_query_lens_if_asked(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                              causal: bool) -> None:
    """With PAGEDATTN_CHECK_INDICES=1 and causal attention: no request has more query tokens
    than keys. Its queries are the last query_len positions of its sequence, so a shorter
    `seqused_k` would leave the first rows seeing nothing (silently zero). Cross-attention
    (not causal) may have more queries than keys."""
    if not (causal and envs.PAGEDATTN_CHECK_INDICES):
        return
    cu = cu_seqlens_q.cpu().long()
    q_lens, used = cu[1:] - cu[:-1], seqused_k.cpu().long()
    bad = used < q_lens
    if bool(bad.any()):
        (r,) = _first(bad)
        raise ValueError(
            f"request {r}: seqused_k[{r}]={int(used[r])} is below its query length "
            f"{int(q_lens[r])} (cu_seqlens_q[{r}:{r + 2}]); with causal attention a request's "
            "queries are the last positions of its sequence, so seqused_k >= query length")
