"""A generator step launched on the device and not yet read back: what async scheduling keeps.

With async scheduling (vLLM's name for it) the host prepares and launches step t+1 while the
device still runs step t, and reads step t's sampled tokens back only then. Two things make
that possible without a host sync in between:

- the sampled tokens are copied to the host with a `non_blocking` copy into pinned memory,
  queued right behind the step, and an event recorded after it: reading them waits for step
  t alone, not for step t+1 queued behind it (`LaunchedStep.read_tokens`, the step's one
  sync);
- a decode of step t+1 whose input token step t samples takes it from step t's device
  tensor: `carry_tokens` copies it into step t+1's input ids on the device.

On the CPU every call runs to completion before it returns, so the same code path runs with
nothing to overlap (what lets the tests check it there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


@dataclass
class LaunchedStep:
    """A launched step: its schedule, and its sampled tokens on the device and in flight to
    the host."""

    reqs: list[Any]  # the step's requests, decodes first
    query_lens: np.ndarray  # int64 [len(reqs)]
    num_decodes: int
    sampled: list[Any]  # the requests a token is sampled for, in row order
    tokens: torch.Tensor  # [len(sampled)] int64 on the device: what the next step carries
    graphed: bool  # replayed from a CUDA graph
    overlapped: bool  # launched before the step before it was read back
    tokens_host: Optional[torch.Tensor] = None  # the tokens' copy (pinned on CUDA), in flight
    ready: Any = None  # torch.cuda.Event recorded after that copy (None off CUDA)
    # [len(sampled), vocab] on the device, kept when the generator records logits: a graph
    # step's own logits are its static buffer, which the next replay rewrites.
    logits: Optional[torch.Tensor] = None
    # Requests that stopped at the step before this one, whose blocks this step still reads
    # (it computed one more token of each): freed once it is done.
    free_after: list[Any] = field(default_factory=list)

    def copy_tokens_out(self) -> None:
        """Queue the tokens' copy to the host behind the step (no wait here)."""
        # non_blocking to the CPU lands in pinned memory, so the copy is queued, not waited for
        self.tokens_host = self.tokens.to("cpu", non_blocking=True)
        if self.tokens.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def read_tokens(self) -> tuple[list[int], float]:
        """The sampled tokens, and the seconds spent waiting for the device to produce them
        (the step's one sync: it waits for this step, not for one launched after it)."""
        waited = time.perf_counter()
        if self.ready is not None:
            self.ready.synchronize()
        waited = time.perf_counter() - waited
        return self.tokens_host.tolist(), waited

    def host_logits(self) -> Optional[torch.Tensor]:
        """The kept logits on the host, float32 [len(sampled), vocab] (after `read_tokens`)."""
        return None if self.logits is None else self.logits.to("cpu", torch.float32)


def pending_rows(rows: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """From rows[i] (the row of input i's token among a launched step's sampled tokens, or -1
    where the host has it): (the inputs to carry, their rows), or None where none is pending."""
    dest = np.flatnonzero(rows >= 0)
    return (dest, rows[dest]) if dest.shape[0] else None


def carry_tokens(ids: torch.Tensor, tokens: torch.Tensor, dest: np.ndarray,
                 src: np.ndarray) -> None:
    """ids[dest] = tokens[src] on the device, queued behind the upload of `ids` and ahead of
    the forward that reads them (no host sync). `ids`: a step's input token ids [num_tokens]
    int64; `tokens`: the sampled tokens of the step launched before it."""
    k = dest.shape[0]
    if dest[k - 1] == k - 1 and np.array_equal(src, dest):
        # a steady decode step: its first k inputs are the last step's k tokens, in order
        ids[:k].copy_(tokens[:k])
        return
    index = torch.from_numpy(np.concatenate((dest, src))).to(ids.device, non_blocking=True)
    ids.index_copy_(0, index[:k], tokens.index_select(0, index[k:]))
