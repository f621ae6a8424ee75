"""Batch-invariant mode: a request's attention rows are the same bits whatever else its batch
holds, however its prompt was split into chunks, and whether a token was computed inside a
prompt or as a decode step.

The mode is decided when a batch is planned, innermost first: a planner's or op's
`batch_invariant=` argument (the builders pass their EngineConfig's mode,
`config.batch_invariant_mode`), a `batch_invariant()` block, else the environment variable
PAGEDATTN_BATCH_INVARIANT. A plan keeps the mode it was made in. The providers take the result
as a plain bool; what they do with it is in `ops/torch/invariant.py` and
`ops/triton/invariant.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Optional

from pagedattn import envs

_mode: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar(
    "batch_invariant", default=None)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Plan the batches of this block batch-invariant (`enabled`) or not, whatever
    PAGEDATTN_BATCH_INVARIANT says."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled={enabled!r} must be a bool")
    token = _mode.set(enabled)
    try:
        yield
    finally:
        _mode.reset(token)


def batch_invariant_enabled(requested: Optional[bool] = None) -> bool:
    """`requested` when given; else the innermost `batch_invariant()` block's choice; else
    PAGEDATTN_BATCH_INVARIANT."""
    if requested is not None:
        return bool(requested)
    mode = _mode.get()
    return envs.get("PAGEDATTN_BATCH_INVARIANT") if mode is None else mode
