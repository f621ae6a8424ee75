"""Error against the float64 oracle on a sample of query rows, for benchmark rows too large for
the whole oracle (16k-token prompts): each sampled row, with every head, is the oracle's
`attend_one_sequence` (tests/reference.py, the project's only oracle) of that one query over
the keys it sees, in float64 on the GPU where there is one.

    rows = sample_rows(query_lens, 128)
    want = oracle_rows(q, k_rows, v_rows, query_lens, seq_lens, rows, scale)
    max_abs, mean_abs = row_errors(out, rows, want)

Inputs are the kernels' own (fp8 ones read as their values: the descales are 1 here), so
every kernel timed on a row is checked against the same float64 outputs.
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import reference  # noqa: E402 - the oracle lives beside the tests, which own it


def sample_rows(query_lens: Sequence[int], n: int = 128, seed: int = 0) -> list[int]:
    """n distinct query rows (token indices into the batch's q), drawn uniformly over all the
    batch's tokens, so long and short requests are sampled by their share; sorted."""
    total = sum(query_lens)
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(total, generator=g)[:min(n, total)].tolist())


def oracle_rows(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                query_lens: Sequence[int], seq_lens: Sequence[int], rows: Sequence[int],
                scale: float, window_left: int = -1) -> torch.Tensor:
    """float64 [len(rows), H, Dv] on the CPU: the oracle's causal output of each sampled row.
    q [total_q, H, D]; k_rows, v_rows [sum(seq_lens), H_kv, D(v)], each request's keys as
    dense rows (its queries are its last query_len positions, as in a paged batch)."""
    cu_q = [0, *itertools.accumulate(query_lens)]
    cu_k = [0, *itertools.accumulate(seq_lens)]
    out, request, k64, v64 = [], -1, None, None
    for token in rows:
        r = bisect.bisect_right(cu_q, token) - 1
        if r != request:  # rows are sorted: each request's keys go to float64 once
            request = r
            k64 = _float64(k_rows[cu_k[r]:cu_k[r + 1]])
            v64 = _float64(v_rows[cu_k[r]:cu_k[r + 1]])
        pos = seq_lens[r] - query_lens[r] + token - cu_q[r]
        o, _ = reference.attend_one_sequence(
            _float64(q[token:token + 1]), k64[:pos + 1], v64[:pos + 1], scale=scale,
            causal=True, window=(window_left, -1))
        out.append(o)
    return torch.cat(out)


def row_errors(out: torch.Tensor, rows: Sequence[int], want: torch.Tensor
               ) -> tuple[float, float]:
    """(max abs, mean abs) of out [total_q, H, Dv] at the sampled rows against `want`
    (NaN where a row was never written: outputs are poisoned before the call)."""
    index = torch.tensor(list(rows), dtype=torch.long, device=out.device)
    got = out.index_select(0, index).to(torch.float32).cpu().to(torch.float64)
    diff = (got - want).abs()
    return diff.max().item(), diff.mean().item()


def error_cell(errors: tuple[float, float]) -> str:
    """"max / mean" for a table cell."""
    return f"{errors[0]:.1e} / {errors[1]:.1e}"


def _float64(x: torch.Tensor) -> torch.Tensor:
    """x in float64 on the oracle's device (fp8 through float32: every build converts that)."""
    return x.to(reference.DEVICE).to(torch.float32).to(torch.float64)
