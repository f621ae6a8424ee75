"""Where a token's K/V lives under decode context parallelism (DCP).

Token position p of a request is stored on DCP rank `(p // interleave) % world_size`: runs of
`interleave` consecutive positions go round-robin over the ranks. Each rank stores its own
positions back to back, in position order, so its local cache holds a sorted subsequence of
the request and "the first n local keys" is always "the local keys before some position".
Functions take ints, integer tensors or integer numpy arrays alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor, np.ndarray)


@dataclass(frozen=True)
class KVSharding:
    """One rank's share of every request's positions; world_size 1 is "everything here"."""

    world_size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size <= 0:
            raise ValueError(f"world_size={self.world_size!r} must be a positive int")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r} must be in [0, {self.world_size})")
        if not isinstance(self.interleave, int) or self.interleave <= 0:
            raise ValueError(f"interleave={self.interleave!r} must be a positive int")

    def owner(self, pos: IntOrTensor) -> IntOrTensor:
        """The DCP rank that stores position `pos`."""
        return (pos // self.interleave) % self.world_size

    def local_len(self, length: IntOrTensor) -> IntOrTensor:
        """How many of positions 0 .. length-1 this rank stores."""
        period = self.interleave * self.world_size
        rest = length % period - self.rank * self.interleave
        if isinstance(rest, torch.Tensor):
            rest = rest.clamp(0, self.interleave)
        elif isinstance(rest, np.ndarray):
            rest = np.clip(rest, 0, self.interleave)
        else:
            rest = min(max(rest, 0), self.interleave)
        return length // period * self.interleave + rest

    def global_pos(self, local: IntOrTensor) -> IntOrTensor:
        """The position of this rank's `local`-th stored token."""
        i = self.interleave
        return (local // i * self.world_size + self.rank) * i + local % i
