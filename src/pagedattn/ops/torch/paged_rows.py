"""A paged batch's requests as padded rows, for the PyTorch provider's attention paths.

Requests are grouped (`request_groups`), their keys and values gathered from the cache into
[requests, keys, num_kv_heads, D] float32 (`gather_keys`), their queries taken as padded
[requests, rows, num_heads, D] (`query_rows`), and each (request, row) told which keys it sees
(`visible_keys`). No host synchronisation except on the CPU, where lengths are host values.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn.ops.index_checks import check_attention_indices


def request_groups(cu_seqlens_q, seqused_k, batch, max_seqlen_q, max_seqlen_k, num_heads,
                   chunk_elements, min_padding=0):
    """(request ids, padded query length, padded key length) of each group of requests run
    together, each group's score matrix near `chunk_elements`.

    On the CPU the lengths are host values already (reading them is no sync): requests are
    sorted by query length and grouped so that padding wastes at most a quarter of a
    group's queries, each padded only to its own longest query and key range (a decode
    beside a 300-token chunk is no longer padded to 300 rows). With `min_padding` > 0, also
    at most a quarter of its scores (query rows x keys x heads) once the padded ones number
    more than `min_padding` (each group costs a few more calls: decodes of similar lengths
    go together, short ones no longer padded to the longest). Elsewhere: runs of requests
    padded to the batch's maxima, decided without reading a device value."""
    if cu_seqlens_q.device.type != "cpu" or seqused_k.device.type != "cpu":
        per_req = num_heads * max_seqlen_k * max_seqlen_q
        step = max(1, min(batch, chunk_elements // per_req))
        return [(torch.arange(b0, min(batch, b0 + step), device=cu_seqlens_q.device),
                 max_seqlen_q, max_seqlen_k) for b0 in range(0, batch, step)]
    cu = cu_seqlens_q.tolist()
    q_lens = [cu[r + 1] - cu[r] for r in range(batch)]
    k_lens = [max(1, min(k, max_seqlen_k)) for k in seqused_k.tolist()]
    groups, group, total_q, longest_k, scores = [], [], 0, 0, 0
    for r in sorted(range(batch), key=lambda r: (q_lens[r], k_lens[r])):
        q_r = max(q_lens[r], 1)  # sorted: this request is the group's longest query
        n, k_r = len(group) + 1, max(longest_k, k_lens[r])
        padded = (n * q_r * k_r - scores - q_r * k_lens[r]) * num_heads  # if r joins
        if group and (n * q_r * 4 > (total_q + q_r) * 5
                      or n * q_r * k_r * num_heads > chunk_elements
                      or 0 < min_padding < padded and n * q_r * k_r * num_heads < padded * 4):
            groups.append(group)
            group, total_q, longest_k, scores = [], 0, 0, 0
        group.append(r)
        total_q, longest_k = total_q + q_r, max(longest_k, k_lens[r])
        scores += q_r * k_lens[r]
    if group:
        groups.append(group)
    return [(torch.tensor(g), max(max(q_lens[r] for r in g), 1), max(k_lens[r] for r in g))
            for g in groups]


@contextlib.contextmanager
def named_index_errors(*args):
    """An IndexError of the paths' own indexing (an id past the cache) becomes a ValueError
    naming the argument (`check_attention_indices` over `args`), not torch's index."""
    try:
        yield
    except IndexError as e:
        raise _index_error(e, *args) from e


def _index_error(e: IndexError, *args) -> ValueError:
    try:
        check_attention_indices(*args)
    except ValueError as named:
        return named
    return ValueError(f"cu_seqlens_q, seqused_k, cu_seqlens_k or block_table indexes past "
                      f"q, k or v: {e}")


def spare_rows(q: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output rows [total_q + 1, H, Dv] (out's dtype) and LSE rows [total_q + 1, H] float32:
    the spare last row absorbs the padded (request, row) pairs, so writes need no boolean
    indexing; `write_rows` copies the real ones out."""
    total_q, num_heads = q.shape[:2]
    return (out.new_empty((total_q + 1, num_heads, out.shape[-1])),
            q.new_empty((total_q + 1, num_heads), dtype=torch.float32))


def write_rows(out: torch.Tensor, softmax_lse: Optional[torch.Tensor], out_rows: torch.Tensor,
               lse_rows: torch.Tensor) -> None:
    """`spare_rows`' real rows into out [total_q, H, Dv] and softmax_lse [H, total_q]."""
    total_q = out.shape[0]
    out.copy_(out_rows[:total_q])
    if softmax_lse is not None:
        softmax_lse.copy_(lse_rows[:total_q].T)


@dataclass(frozen=True)
class KeyRows:
    """Where a group of requests finds its keys (or values) in the cache, and which of the
    gathered rows lie past each request's end (`key_rows`)."""

    # paged: [n * num_blocks] int64 block ids (unused columns: block 0); dense: [n, num_keys]
    # key rows, unclamped
    index: torch.Tensor
    num_blocks: int  # paged: blocks gathered per request; dense: 0
    num_keys: int  # keys per request, padded
    past_end: torch.Tensor  # [n, gathered rows] bool
    past_rows: Optional[torch.Tensor]  # on the CPU: past_end's flat row ids [m] int64


def key_rows(reqs: torch.Tensor, lens: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor],
             block_table: Optional[torch.Tensor], num_keys: int, block_size: int) -> KeyRows:
    """The `KeyRows` of requests `reqs` with `lens` keys each, padded to `num_keys`: through
    the block table (pages of `block_size`), else dense keys at cu_seqlens_k."""
    device = lens.device
    if block_table is None:
        index = cu_seqlens_k[reqs].long()[:, None] + torch.arange(num_keys, device=device)
        num_blocks, gathered = 0, num_keys
    else:
        num_blocks = -(-num_keys // block_size)
        gathered = num_blocks * block_size
        # index_select copies whole blocks (~2x faster than indexing); columns a request does
        # not use may hold anything, so they read block 0, and a bad id in a used column
        # raises IndexError (named by the caller) instead of wrapping around. (int64 ids:
        # index_select takes twice as long with int32 ones)
        ids = block_table[reqs, :num_blocks]
        used = -(-lens // block_size)
        index = ids.masked_fill(torch.arange(num_blocks, device=device) >= used[:, None],
                                0).flatten().long()
    past = torch.arange(gathered, device=device)[None, :] >= lens[:, None]  # [n, gathered]
    # On the CPU a broadcast masked_fill_ over every element is ~20x slower than filling
    # just the rows past the end (a decode's few), found from the small mask.
    past_rows = past.view(-1).nonzero().view(-1) if device.type == "cpu" else None
    return KeyRows(index, num_blocks, num_keys, past, past_rows)


def gather_rows(cache: torch.Tensor, rows: KeyRows, zero_past_end: bool) -> torch.Tensor:
    """[n, num_keys, num_kv_heads, D] float32 keys (or values) at `rows` of the cache.

    Paged caches are gathered a whole block per index (one contiguous copy each), not a
    position per index. Positions past a request's length hold whatever the cache held (maybe
    NaN from an uninitialised block): values are zeroed there (`zero_past_end`), since
    0 * NaN would leak through the softmax; keys only for the fused kernel, which adds its
    mask to the scores (the einsum path masks the scores themselves).
    """
    if rows.num_blocks == 0:  # dense keys
        x = cache[rows.index.clamp(max=cache.shape[0] - 1)].float()
    else:
        # (a block as one row of a 2-D view is copied ~4x faster than a block of the 4-D
        # cache; HND caches have strided blocks and take the 4-D copy)
        block_rows = _block_rows(cache)
        source = cache if block_rows is None else block_rows
        x = source.index_select(0, rows.index).view(
            -1, rows.num_blocks * cache.shape[1], *cache.shape[2:]).float()
    if zero_past_end:
        # x is this function's own copy (index_select / indexing / float copy): zeroed in
        # place, before the slice below, so that its token rows are one 2-D view
        if rows.past_rows is not None:
            x.view(-1, math.prod(x.shape[2:])).index_fill_(0, rows.past_rows, 0.0)
        else:  # one kernel, no host sync
            x.masked_fill_(rows.past_end.view(*rows.past_end.shape, 1, 1), 0.0)
    return x[:, :rows.num_keys]


def gather_keys(cache, reqs, lens, cu_seqlens_k, block_table, max_seqlen_k, descale,
                zero_past_end):
    """[n_reqs, max_seqlen_k, num_kv_heads, D] float32 keys (or values) of `reqs`, with
    their descale ([batch, num_kv_heads] or None) applied (`gather_rows`)."""
    x = gather_rows(cache, key_rows(reqs, lens, cu_seqlens_k, block_table, max_seqlen_k,
                                    cache.shape[1]), zero_past_end)
    if descale is not None:
        x = x * descale[reqs][:, None, :, None]
    return x


def _block_rows(cache: torch.Tensor) -> Optional[torch.Tensor]:
    """The paged cache as [num_blocks, block elements] when each block is contiguous (NHD
    caches), else None (HND: a block's rows are strided)."""
    try:
        return cache.view(cache.shape[0], -1)
    except RuntimeError:
        return None


def query_rows(q, reqs, rows, cu_seqlens_q, seqused_k, total_q, q_descale, group):
    """Queries of the chunk's (request, row) pairs, padded: [n, r, H, D] float32, their
    token ids (padding: the spare row total_q), validity, and query/key positions."""
    q_start = cu_seqlens_q[reqs].long()
    q_len = cu_seqlens_q[reqs + 1].long() - q_start
    k_len = seqused_k[reqs].long()
    valid_row = rows[None, :] < q_len[:, None]  # [n, r]
    tokens = torch.where(valid_row, q_start[:, None] + rows[None, :], total_q)
    x = q[tokens.clamp(max=total_q - 1)].float()  # [n, r, H, D]
    if q_descale is not None:
        x = x * q_descale[reqs].repeat_interleave(group, dim=1)[:, None, :, None]
    q_pos = (k_len - q_len)[:, None] + rows[None, :]  # [n, r]
    return x, tokens, valid_row, q_pos, k_len


def visible_keys(valid_row, q_pos, k_len, lk, causal, window_left, window_right):
    """[n, r, lk] which keys each (request, row) sees, and key-minus-query positions."""
    k_pos = torch.arange(lk, device=q_pos.device)
    rel = k_pos[None, None, :] - q_pos[:, :, None]  # [n, r, lk]
    visible = (k_pos[None, None, :] < k_len[:, None, None]) & valid_row[:, :, None]
    if causal:
        visible &= rel <= 0
    if window_left >= 0:
        visible &= -rel <= window_left
    if window_right >= 0:
        visible &= rel <= window_right
    return visible, rel
