"""Checks of a batch's metadata on its host copies: what a builder runs before `build`.

A malformed batch must fail at `build()` with a message that names the request and the
value, not later as a silent wrong answer (a negative block id wraps around to another
request's block in PyTorch indexing and reads past the cache in a kernel). Everything here
reads the CPU tensors the engine already keeps (`query_start_loc_cpu`, `seq_lens_cpu`, the
block table and slots on CPU when it has them), so it costs no GPU sync: a few vectorised
numpy ops per step (numpy, not torch: a torch op on a small CPU tensor costs microseconds of
dispatch, a numpy op a fraction of that). Checks that would need a device tensor copied back
run only when PAGEDATTN_CHECK_INDICES=1.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from pagedattn import envs
from pagedattn.kv_sharding import KVSharding
from pagedattn.metadata import CommonAttentionMetadata
from pagedattn.metadata_staging import stager_fields

# Extremes as `a.item(a.argmax())`: argmax is a plain method, about 0.2 us on a short array
# where a ufunc reduction (`np.maximum.reduce`, `a.max()`) costs 1.5-3 us per step.


def check_builder_batch(builder: Any, m: CommonAttentionMetadata) -> None:
    """What `AttentionMetadataBuilder.check_batch` runs: the cache size from the builder's
    engine config (CacheConfig.num_gpu_blocks), the DCP sharding from its planner, if any."""
    cache_config = getattr(builder.vllm_config, "cache_config", None)
    check_common_metadata(m, builder.kv_cache_spec.block_size,
                          getattr(cache_config, "num_gpu_blocks", None),
                          getattr(getattr(builder, "dcp", None), "sharding", None))


def check_common_metadata(m: CommonAttentionMetadata, block_size: int,
                          num_blocks: Optional[int] = None,
                          sharding: Optional[KVSharding] = None) -> None:
    """ValueError if the batch `m` is malformed; `num_blocks` (the cache's size, if known)
    bounds block ids and slots. Under DCP (`sharding`) the block table is this rank's: a
    request uses the blocks of the positions this rank stores."""
    n = m.num_reqs
    mark = m.made_by_stager
    if mark is not None and mark[0] == block_size and mark[1] == stager_fields(m) and (
            sharding is None or sharding.world_size == 1):
        # The stager checked the lengths and made the rest from them (slots from block ids
        # and positions): only the block ids it was given remain to check, on its numpy
        # view of block_table_cpu (the longest sequence fits the table: make checked that).
        table = mark[2]
        if table.size and not _in_range(table, num_blocks):
            _check_block_ids(table, _np(m.seq_lens_cpu), m.max_seq_len, block_size, num_blocks)
        return
    qsl, seq_lens = _np(m.query_start_loc_cpu), _np(m.seq_lens_cpu)
    if qsl.shape[0] != n + 1 or seq_lens.shape[0] != n:
        raise ValueError(
            f"num_reqs={n} but query_start_loc_cpu has {qsl.shape[0]} entries (need {n + 1}) "
            f"and seq_lens_cpu has {seq_lens.shape[0]} (need {n})")
    query_lens = qsl[1:] - qsl[:-1]
    # One pass for both bounds, 0 <= query_len <= seq_len (numpy calls cost ~1-2 us): a
    # bitwise or of two ints is negative iff one of them is.
    either = query_lens | (seq_lens - query_lens)
    if n and (int(qsl[0]) != 0 or either.item(either.argmin()) < 0):
        _raise_for_request(qsl, query_lens, seq_lens)
    last = int(qsl[-1])
    if last != m.num_actual_tokens:
        raise ValueError(f"query_start_loc ends at {last} but num_actual_tokens="
                         f"{m.num_actual_tokens}; the last entry must be the batch's tokens")
    max_seq = 0
    if n:
        max_seq = seq_lens.item(seq_lens.argmax())
        _check_maxima(m, query_lens.item(query_lens.argmax()), max_seq)
    num_slots = m.slot_mapping.shape[0]
    if num_slots < m.num_actual_tokens:
        raise ValueError(f"slot_mapping has {num_slots} slots for num_actual_tokens="
                         f"{m.num_actual_tokens}; every token needs one (negative: skip)")
    table = _host_copy(m.block_table_cpu, m.block_table_tensor)
    if table is not None and n:
        if sharding is None or sharding.world_size == 1:
            stored, max_stored = seq_lens, max_seq
        else:
            stored = sharding.local_len(torch.from_numpy(seq_lens)).numpy()
            max_stored = stored.item(stored.argmax())
        _check_block_ids(table, stored, max_stored, block_size, num_blocks)
    slots = _host_copy(m.slot_mapping_cpu, m.slot_mapping)
    if slots is not None:
        _check_slots(slots, qsl, m.num_actual_tokens, block_size, num_blocks)


def _np(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as int64 numpy (a view when it is int64 already)."""
    return t.numpy().astype(np.int64, copy=False)


def _host_copy(cpu: Optional[torch.Tensor], tensor: torch.Tensor) -> Optional[np.ndarray]:
    """The CPU copy the engine kept; else the tensor itself if on CPU; else (a device sync)
    only when PAGEDATTN_CHECK_INDICES=1. As numpy (int32 block ids stay int32)."""
    if cpu is not None:
        return cpu.numpy()
    if tensor.device.type == "cpu":
        return tensor.numpy()
    return tensor.cpu().numpy() if envs.PAGEDATTN_CHECK_INDICES else None


def _raise_for_request(qsl: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray) -> None:
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc[0]={int(qsl[0])}; it must start at 0")
    r = int(np.flatnonzero((query_lens < 0) | (query_lens > seq_lens))[0])
    start, end = int(qsl[r]), int(qsl[r + 1])
    if end < start:
        raise ValueError(
            f"request {r}: query_start_loc is not monotone: query_start_loc[{r}]={start} > "
            f"query_start_loc[{r + 1}]={end}")
    raise ValueError(
        f"request {r}: query_len={end - start} > seq_len={int(seq_lens[r])}; a request's new "
        "tokens are the last query_len of its sequence, so query_len <= seq_len")


def _check_maxima(m: CommonAttentionMetadata, max_query: int, max_seq: int) -> None:
    # Kernels size their grids and key loops by these bounds: too small drops work silently.
    if m.max_query_len < max_query:
        raise ValueError(f"max_query_len={m.max_query_len} but a request has {max_query} "
                         "query tokens; it must be at least the longest query")
    if m.max_seq_len < max_seq:
        raise ValueError(f"max_seq_len={m.max_seq_len} but a request has seq_len={max_seq}; "
                         "it must be at least the longest sequence")


def _check_block_ids(table: np.ndarray, seq_lens: np.ndarray, max_seq_len: int,
                     block_size: int, num_blocks: Optional[int]) -> None:
    """Block ids in the columns each sequence uses (`seq_lens`: the positions stored here,
    the longest `max_seq_len`): >= 0 and < num_blocks (when known)."""
    n, width = seq_lens.shape[0], table.shape[1]
    if table.shape[0] < n:
        raise ValueError(f"the block table has {table.shape[0]} rows for num_reqs={n}")
    if -(-max_seq_len // block_size) > width:  # the longest request decides: no array op
        blocks_used = (seq_lens + block_size - 1) // block_size  # [n]
        r = int(np.flatnonzero(blocks_used > width)[0])
        raise ValueError(
            f"request {r}: seq_len={int(seq_lens[r])} needs {int(blocks_used[r])} blocks of "
            f"{block_size} but the block table has {width} columns")
    table = table[:n]
    if not table.size or _in_range(table, num_blocks):
        return
    limit = np.iinfo(np.int64).max if num_blocks is None else num_blocks
    blocks_used = (seq_lens + block_size - 1) // block_size  # [n]
    out_of_range = (table < 0) | (table >= limit)
    bad = out_of_range & (np.arange(width)[None, :] < blocks_used[:, None])  # [n, width]
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        allowed = f"0..{num_blocks - 1}" if num_blocks is not None else ">= 0"
        raise ValueError(
            f"request {r}: block_table[{r}, {c}]={int(table[r, c])} is not a valid block id "
            f"(allowed: {allowed}); the request's first {int(blocks_used[r])} columns must "
            "name cache blocks")


def _in_range(table: np.ndarray, num_blocks: Optional[int]) -> bool:
    """Whether every id of a non-empty table is >= 0 and < num_blocks (when known). Only
    the columns a request uses hold real ids, the rest may be anything, but the common case
    is a table whose ids are all in range: its extremes decide, no temporary mask. (argmin
    and argmax, flat indices: several times cheaper than numpy's reductions.)"""
    return table.item(table.argmin()) >= 0 and (
        num_blocks is None or table.item(table.argmax()) < num_blocks)


def _check_slots(slots: np.ndarray, qsl: np.ndarray, num_tokens: int, block_size: int,
                 num_blocks: Optional[int]) -> None:
    """Real tokens' slots below the cache's end; padding tokens (past num_actual_tokens)
    must be skipped (negative), or the cache write would store garbage."""
    if slots.shape[0] > num_tokens and (slots[num_tokens:] >= 0).any():
        t = num_tokens + int(np.flatnonzero(slots[num_tokens:] >= 0)[0])
        raise ValueError(
            f"slot_mapping has {slots.shape[0]} slots for num_actual_tokens={num_tokens}, and "
            f"padding token {t} has slot {int(slots[t])}; slots past num_actual_tokens must be "
            "negative (skipped)")
    if num_blocks is None or not num_tokens:
        return
    limit = num_blocks * block_size
    real = slots[:num_tokens]
    if real.item(real.argmax()) >= limit:
        t = int(np.flatnonzero(real >= limit)[0])
        r = int(np.searchsorted(qsl, t, side="right")) - 1  # t's request
        raise ValueError(
            f"request {r}: slot_mapping[{t}]={int(real[t])} is beyond the cache: "
            f"{num_blocks} blocks of {block_size} hold slots 0..{limit - 1} (negative: skip)")
