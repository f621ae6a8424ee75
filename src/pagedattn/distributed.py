"""Tensor-parallel (TP) and decode-context-parallel (DCP) process groups, on torch.distributed.

`init_parallel_groups(tensor_parallel_size, decode_context_parallel_size)` carves them out of an
initialised default process group (NCCL on GPUs, gloo on CPU; torchrun launches the ranks):
TP groups are runs of `tp` consecutive ranks, and each TP group splits into runs of `dcp`
consecutive ranks, as vLLM does. Without it every accessor answers for one process (rank 0 of
a group of 1), so nothing changes for single-process use.

DCP shards one request's KV cache by token position across the ranks of a DCP group; those
ranks must hold the same KV heads, so a TP layout whose KV heads are replicated at least `dcp`
times is required (`tp_attention_heads` checks it). The collectives used by the DCP path are
here too: they turn a peer that died or stalled into a `ParallelGroupError` within the
group's timeout instead of a hang.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# torch >= 2.12 renamed the tensor collectives; older builds (the GPU image) have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or \
    dist.reduce_scatter_tensor


class ParallelGroupError(RuntimeError):
    """A collective of a parallel group failed: a peer rank died, stalled past the timeout, or
    the groups are not set up the way the call needs."""


@dataclass(frozen=True)
class ParallelGroup:
    """One process group as this rank sees it. `group` is None for a group of one process."""

    name: str
    ranks: tuple[int, ...]
    rank_in_group: int
    group: Optional[dist.ProcessGroup] = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)


_SINGLE = {"tp": ParallelGroup("tensor parallel", (0,), 0),
           "dcp": ParallelGroup("decode context parallel", (0,), 0)}
_groups: dict[str, ParallelGroup] = dict(_SINGLE)


def init_parallel_groups(tensor_parallel_size: int = 1, decode_context_parallel_size: int = 1,
                         timeout: Optional[datetime.timedelta] = None) -> None:
    """Create this rank's TP and DCP groups from the default process group.

    The default group must be initialised (`torch.distributed.init_process_group`, pass it a
    timeout) when either size is above 1. Every rank must call this, with the same sizes.
    """
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    for name, value in (("tensor_parallel_size", tp), ("decode_context_parallel_size", dcp)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if tp % dcp:
        raise ValueError(f"decode_context_parallel_size={dcp} must divide "
                         f"tensor_parallel_size={tp}: DCP groups are carved out of TP groups")
    if not (dist.is_available() and dist.is_initialized()):
        if tp == 1:
            _groups.update(_SINGLE)
            return
        raise ParallelGroupError(
            f"tensor_parallel_size={tp} needs an initialised default process group: call "
            "torch.distributed.init_process_group (launched by torchrun) first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the world size {world}")
    destroy_parallel_groups()
    for name, size in (("tp", tp), ("dcp", dcp)):
        for start in range(0, world, size):  # every rank creates every group, in order
            ranks = tuple(range(start, start + size))
            group = dist.new_group(list(ranks), timeout=timeout) if size > 1 else None
            if rank in ranks:
                _groups[name] = ParallelGroup(_SINGLE[name].name, ranks, rank - start, group)


def destroy_parallel_groups() -> None:
    """Back to the single-process defaults (the default process group stays)."""
    for name in ("tp", "dcp"):
        group = _groups[name].group
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)
        _groups[name] = _SINGLE[name]


def parallel_groups_initialized() -> bool:
    return any(g.group is not None for g in _groups.values())


def get_tp_group() -> ParallelGroup:
    return _groups["tp"]


def get_dcp_group() -> ParallelGroup:
    return _groups["dcp"]


def get_tensor_model_parallel_rank() -> int:
    return _groups["tp"].rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _groups["tp"].world_size


def get_decode_context_parallel_rank() -> int:
    return _groups["dcp"].rank_in_group


def get_decode_context_parallel_world_size() -> int:
    return _groups["dcp"].world_size


# --- tensor-parallel heads ---------------------------------------------------------------
def tp_attention_heads(total_num_heads: int, total_num_kv_heads: int) -> tuple[int, int]:
    """(num_heads, num_kv_heads) of this rank's attention layer under the current groups.

    Query heads split evenly; KV heads split evenly while tp <= num_kv_heads, and are
    replicated (one per rank) beyond that. DCP needs the ranks of a DCP group to hold the same
    KV heads: every KV head replicated on at least `dcp` consecutive ranks.
    """
    tp, dcp = get_tensor_model_parallel_world_size(), get_decode_context_parallel_world_size()
    if total_num_heads % tp:
        raise ValueError(f"num_heads={total_num_heads} is not divisible by "
                         f"tensor_parallel_size={tp}")
    if total_num_heads % total_num_kv_heads:
        raise ValueError(f"num_heads={total_num_heads} is not divisible by "
                         f"num_kv_heads={total_num_kv_heads}")
    if tp <= total_num_kv_heads and total_num_kv_heads % tp:
        raise ValueError(f"num_kv_heads={total_num_kv_heads} is not divisible by "
                         f"tensor_parallel_size={tp}")
    if tp > total_num_kv_heads and tp % total_num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} is not a multiple of num_kv_heads="
                         f"{total_num_kv_heads}, so KV heads cannot be replicated evenly")
    replicas = max(1, tp // total_num_kv_heads)
    if dcp > 1 and replicas % dcp:
        raise ValueError(
            f"decode_context_parallel_size={dcp} needs every KV head on a multiple of {dcp} "
            f"ranks, but tensor_parallel_size={tp} with num_kv_heads={total_num_kv_heads} "
            f"replicates each KV head {replicas} time(s); lower the DCP size or raise TP")
    return total_num_heads // tp, max(1, total_num_kv_heads // tp)


def tp_shard_heads(values: torch.Tensor, num_local_heads: int) -> torch.Tensor:
    """This TP rank's slice of a per-head tensor given for all heads (sinks, ALiBi slopes);
    a tensor that already has `num_local_heads` entries is returned as it is."""
    if values.shape[0] == num_local_heads:
        return values
    tp = get_tensor_model_parallel_world_size()
    if values.shape[0] != num_local_heads * tp:
        return values  # the caller's shape check reports it
    start = get_tensor_model_parallel_rank() * num_local_heads
    return values[start:start + num_local_heads]


# --- collectives of the DCP path -----------------------------------------------------------
@contextlib.contextmanager
def _collective(what: str, group: ParallelGroup) -> Iterator[None]:
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        raise ParallelGroupError(
            f"{what} over the {group.name} group (ranks {list(group.ranks)}) failed: a peer "
            f"rank died or did not answer within the process group's timeout ({e})") from e


def all_gather(x: torch.Tensor, group: ParallelGroup, dim: int = 0) -> torch.Tensor:
    """Concatenation of every group rank's `x` along `dim` (rank order)."""
    if group.world_size == 1:
        return x
    raw = x.view(torch.uint8) if x.element_size() == 1 else x  # fp8: move bytes
    gathered = raw.new_empty((group.world_size * raw.shape[0],) + tuple(raw.shape[1:]))
    with _collective("all_gather", group):
        _all_gather_single(gathered, raw.contiguous(), group=group.group)
    gathered = gathered.view(x.dtype).view((group.world_size,) + tuple(x.shape))
    return torch.cat(gathered.unbind(0), dim=dim) if dim != 0 else gathered.flatten(0, 1)


def reduce_scatter(x: torch.Tensor, group: ParallelGroup, dim: int = 0) -> torch.Tensor:
    """Sum over the group of `x`, split into world_size parts along `dim`; this rank's part."""
    if group.world_size == 1:
        return x
    n = group.world_size
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not "
                         f"divisible by the group size {n}")
    parts = x.movedim(dim, 0).contiguous()  # [.., n * k, ..] with dim first
    out = parts.new_empty((parts.shape[0] // n,) + tuple(parts.shape[1:]))
    with _collective("reduce_scatter", group):
        _reduce_scatter_single(out, parts, group=group.group)
    return out.movedim(0, dim)
