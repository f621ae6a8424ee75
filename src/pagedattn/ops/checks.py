"""Argument checks shared by the public ops: cheap (shape and dtype only, no host sync)."""

from __future__ import annotations

from typing import Optional

import torch

INDEX_DTYPES = (torch.int32,)


def check_tensor(name: str, x: Optional[torch.Tensor], ndim: Optional[int] = None,
                 dtypes: Optional[tuple[torch.dtype, ...]] = None,
                 device: Optional[torch.device] = None) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {x.dtype}; allowed: {[str(d) for d in dtypes]}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but the inputs are on {device}")


def check_dim(name: str, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if x.shape[dim] != expected:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}; dimension {dim} must be {expected} ({what})")
