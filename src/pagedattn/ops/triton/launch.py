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


def decode_config(*, device: torch.device, batch: int, max_seqlen_k: int, num_kv_heads: int,
                  group_pad: int, head_size: int, num_splits: int,
                  override: Optional[AttnConfig] = None) -> AttnConfig:
    """The decode pass: one program per (sequence, KV head, split), few query rows each.

    It streams K/V, so tiles favour bytes in flight (128 keys a step) over tensor-core shape.
    `num_splits` > 0 forces the split count.
    """
    if override is not None:
        cfg = override
    elif interpreting():
        cfg = AttnConfig(max(16, group_pad), 16, 4, 1, 1)
    else:
        cfg = AttnConfig(max(16, group_pad), 128 if head_size <= 128 else 64, 4, 2, 1)
    if num_splits > 0:
        return replace(cfg, num_splits=num_splits)
    if override is not None:
        return cfg
    return replace(cfg, num_splits=auto_splits(device, batch, max_seqlen_k, num_kv_heads))


def prefill_config(*, max_seqlen_q: int, head_size: int, group_pad: int,
                   override: Optional[AttnConfig] = None) -> AttnConfig:
    """The prefill pass: query blocks of longer requests; compute-bound, never split."""
    if override is not None:
        return replace(override, num_splits=1)
    if interpreting():
        return AttnConfig(max(16, group_pad), 16, 4, 1, 1)
    if head_size <= 128:
        return AttnConfig(256 if max_seqlen_q >= 2048 else 128, 64, 8, 3, 1)
    return AttnConfig(64, 64, 4, 2, 1)


def auto_splits(device: torch.device, batch: int, max_seqlen_k: int, num_kv_heads: int) -> int:
    """Split the KV axis when the (sequence, KV head) programs cannot fill the GPU.

    Flash-decoding: a batch-1 decode has only num_kv_heads programs; splitting each sequence's
    keys into n ranges gives n times the programs, then a small pass merges their partial states.
    """
    busy = max(1, batch * num_kv_heads)
    if busy >= sm_count(device):
        return 1
    by_length = max(1, max_seqlen_k // MIN_KEYS_PER_SPLIT)
    return max(1, min(triton.cdiv(2 * sm_count(device), busy), by_length, MAX_SPLITS))
