"""A paged batch's requests as padded rows, for the PyTorch provider's attention paths.

Requests are grouped (`request_groups`), their keys and values gathered from the cache into
[requests, keys, num_kv_heads, D] float32 (`gather_keys`), their queries taken as padded
[requests, rows, num_heads, D] (`query_rows`), and each (request, row) told which keys it sees
(`visible_keys`). No host synchronisation except on the CPU, where lengths are host values.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from pagedattn.ops.index_checks import check_attention_indices


def request_groups(cu_seqlens_q, seqused_k, batch, max_seqlen_q, max_seqlen_k, num_heads,
                   chunk_elements):
    """(request ids, padded query length, padded key length) of each group of requests run
    together, each group's score matrix near `chunk_elements`.

    On the CPU the lengths are host values already (reading them is no sync): requests are
    sorted by query length and grouped so that padding wastes at most a quarter of a
    group's queries, each padded only to its own longest query and key range (a decode
    beside a 300-token chunk is no longer padded to 300 rows). Elsewhere: runs of requests
    padded to the batch's maxima, decided without reading a device value."""
    if cu_seqlens_q.device.type != "cpu" or seqused_k.device.type != "cpu":
        per_req = num_heads * max_seqlen_k * max_seqlen_q
        step = max(1, min(batch, chunk_elements // per_req))
        return [(torch.arange(b0, min(batch, b0 + step), device=cu_seqlens_q.device),
                 max_seqlen_q, max_seqlen_k) for b0 in range(0, batch, step)]
    cu = cu_seqlens_q.tolist()
    q_lens = [cu[r + 1] - cu[r] for r in range(batch)]
    k_lens = [max(1, min(k, max_seqlen_k)) for k in seqused_k.tolist()]
    groups, group, total_q, longest_k = [], [], 0, 0
    for r in sorted(range(batch), key=lambda r: (q_lens[r], k_lens[r])):
        q_r = max(q_lens[r], 1)  # sorted: this request is the group's longest query
        n = len(group) + 1
        if group and (n * q_r * 4 > (total_q + q_r) * 5
                      or n * q_r * max(longest_k, k_lens[r]) * num_heads > chunk_elements):
            groups.append(group)
            group, total_q, longest_k = [], 0, 0
        group.append(r)
        total_q, longest_k = total_q + q_r, max(longest_k, k_lens[r])
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


def gather_keys(cache, reqs, lens, cu_seqlens_k, block_table, max_seqlen_k, descale,
                zero_past_end):
    """[n_reqs, max_seqlen_k, num_kv_heads, D] float32 keys (or values) of `reqs`.

    Paged caches are gathered a whole block per index (one contiguous copy each), not a
    position per index. Positions past a request's length hold whatever the cache held (maybe
    NaN from an uninitialised block): values are zeroed there (`zero_past_end`), since
    0 * NaN would leak through the softmax; keys only for the fused kernel, which adds its
    mask to the scores (the einsum path masks the scores themselves).
    """
    if block_table is None:
        pos = torch.arange(max_seqlen_k, device=cache.device)
        index = (cu_seqlens_k[reqs].long()[:, None] + pos).clamp(max=cache.shape[0] - 1)
        x = cache[index].float()
    else:
        block_size = cache.shape[1]
        num_blocks = -(-max_seqlen_k // block_size)
        # index_select copies whole blocks (~2x faster than indexing); columns a request does
        # not use may hold anything, so they read block 0, and a bad id in a used column
        # raises IndexError (named below) instead of wrapping around.
        ids = block_table[reqs, :num_blocks]
        used = -(-lens // block_size)
        ids = ids.masked_fill(torch.arange(num_blocks, device=ids.device) >= used[:, None], 0)
        # (int64 ids: index_select takes twice as long with int32 ones; a block as one row
        # of a 2-D view is copied ~4x faster than a block of the 4-D cache)
        rows = _block_rows(cache)
        source = cache if rows is None else rows
        x = source.index_select(0, ids.flatten().long()).view(*ids.shape, *cache.shape[1:])
        x = x.flatten(1, 2).float()  # [n, num_blocks * block_size, Hkv, D]
    if zero_past_end:
        # x is this function's own copy (index_select / indexing / float copy): zeroed in
        # place, before the slice below, so that its token rows are one 2-D view
        _zero_rows_past(x, lens)
    x = x[:, :max_seqlen_k]
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


def _zero_rows_past(x: torch.Tensor, lens: torch.Tensor) -> None:
    """Zero x[i, j] for j >= lens[i], in place (x: contiguous [n, L, ...])."""
    n, length = x.shape[:2]
    past = torch.arange(length, device=x.device)[None, :] >= lens[:, None]  # [n, L]
    if x.device.type != "cpu":  # one kernel, no host sync
        x.masked_fill_(past.view(n, length, *(1,) * (x.dim() - 2)), 0.0)
        return
    # On the CPU a broadcast masked_fill_ over every element is ~20x slower than filling
    # just the rows past the end (a decode's few), found from the small [n, L] mask.
    x.view(n * length, -1).index_fill_(0, past.view(-1).nonzero().view(-1), 0.0)


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
