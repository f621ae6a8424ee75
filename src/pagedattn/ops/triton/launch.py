"""Launch heuristics for the attention kernel: tile shapes and the split-KV count.

Everything here is a function of Python ints the caller already holds (shapes, max_seqlen_q,
max_seqlen_k, the SM count): choosing a schedule never reads a device tensor.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton

# A split must stream at least this many keys, or the second (reduce) pass and the extra
# partial-state traffic cost more than the parallelism gains.
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 64


@dataclass(frozen=True)
class AttnConfig:
    block_m: int  # rows of a program's tile: block_q query tokens x the padded GQA group
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    num_splits: int  # 1: no split-KV (results go straight to `out`)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number keeps the split logic exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_config(*, device: torch.device, batch: int, total_q: int, max_seqlen_q: int,
                     max_seqlen_k: int, num_kv_heads: int, group_pad: int, head_size: int,
                     num_splits: int, override: Optional[AttnConfig] = None) -> AttnConfig:
    """Pick tiles from the batch shape; `num_splits` > 0 forces the split count."""
    if override is not None:
        cfg = override
    elif interpreting():
        cfg = AttnConfig(max(16, group_pad), 16, 4, 1, 1)
    elif max_seqlen_q * group_pad <= 64:
        # Decode-like: few query rows per KV head, so the kernel streams K/V; more keys per
        # step and deeper pipelining keep enough bytes in flight per SM.
        block_m = max(16, min(64, triton.next_power_of_2(max_seqlen_q * group_pad)))
        cfg = AttnConfig(block_m, 64 if head_size <= 128 else 32, 4,
                         3 if head_size <= 128 else 2, 1)
    elif head_size <= 128:
        cfg = AttnConfig(128, 64, 8, 3, 1)
    else:
        cfg = AttnConfig(64, 64, 4, 2, 1)
    block_q = max(1, cfg.block_m // group_pad)
    if num_splits > 0:
        return replace(cfg, num_splits=num_splits)
    if override is not None:
        return cfg
    return replace(cfg, num_splits=auto_splits(device, batch, total_q, max_seqlen_q,
                                               max_seqlen_k, num_kv_heads, block_q))


def auto_splits(device: torch.device, batch: int, total_q: int, max_seqlen_q: int,
                max_seqlen_k: int, num_kv_heads: int, block_q: int) -> int:
    """Split the KV axis when the (sequence, query block, KV head) programs cannot fill the GPU.

    Flash-decoding: a batch-1 decode has only num_kv_heads programs; splitting each sequence's
    keys into n ranges gives n times the programs, then a small pass merges their partial states.
    """
    q_blocks = min(total_q, batch * triton.cdiv(max_seqlen_q, block_q))
    busy = max(1, q_blocks * num_kv_heads)
    target = 2 * sm_count(device)
    if busy >= target:
        return 1
    by_length = max(1, max_seqlen_k // MIN_KEYS_PER_SPLIT)
    return max(1, min(triton.cdiv(target, busy), by_length, MAX_SPLITS))
