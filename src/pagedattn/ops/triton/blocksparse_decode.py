"""Block-sparse paged decode (local + vertical stride) over the v0 cache layout.

One program per (sequence, KV head, split); its rows are the KV head's query heads, so each
attended K/V block is read once for the group, whatever the heads' offsets: the program walks
the union of their vertical blocks (NUM_RESIDUES block classes mod VERT, period by period),
then the local window, as one flat range of BLOCK_N-key tiles that splits evenly. A tile of
the vertical part is CHUNKS chunks of CHUNK keys (a chunk lies in one sparse block), so small
sparse blocks still make wide tiles.

Bandwidth (docs/dev/KERNEL_NOTES.md, block-sparse decode): every key of a full tile is a real key
of the sequence, so its address is (page of the key) + (key % PAGE) without clamping, and the
compiler sees PAGE contiguous keys per page: V (contiguous along the key axis in the v0 layout)
loads in 16-byte vectors instead of one element at a time. Only the last tile of the window can
pass the sequence's end; it is peeled off the loop, reads whole pages (clamped to the last one)
and zeroes V past the end (those slots may hold anything, NaN included, and 0 x NaN is NaN).
A vertical chunk past the window (the last period's classes beyond it) re-reads its class's
previous block, which the program has just read (an L2 hit), fully masked.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedattn.ops.triton import launch
from pagedattn.ops.triton.blocksparse_schedule import (  # noqa: F401 (callers take them here)
    check_tiles,
    decode_splits,
    decode_workspace,
    default_tiles,
    key_lines,
    page_lines,
    residue_classes,
    slot_sums,
    split_count,
    value_lines,
)
from pagedattn.ops.triton.reduce import reduce_splits
from pagedattn.ops.triton.tile_math import (
    LOG2E,
    finish_rows,
    pow2_at_least,
    slot_softmax_step,
    softmax_step,
)


@triton.jit
def _row_offsets(head_base, head, step_size, GROUP: tl.constexpr, PER_KV_HEAD: tl.constexpr):
    """Vertical offset g * step + 1 of query head(s) `head`: g global (or its KV head's)."""
    g = head_base + head
    if PER_KV_HEAD:  # homo_head_group: the heads of one KV group share their blocks
        g = g // GROUP
    return g * step_size + 1


@triton.jit
def _tile_keys(t, num_vert_tiles, local_lo, offset0, step_size, NUM_RESIDUES: tl.constexpr,
               PAGE: tl.constexpr, SBS: tl.constexpr, VERT: tl.constexpr,
               BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Flat tile t: key positions [BLOCK_N], their block-table columns and which keys are
    live (a dead vertical chunk lies past the window and is redirected to a block the
    program reads anyway). Columns are built from `offs_n // PAGE` of a chunk's first
    page, never by dividing a computed key: the compiler then knows PAGE keys share a page
    and V (contiguous along keys) loads in 16-byte vectors."""
    return _keys_at(tl.arange(0, BLOCK_N), t, num_vert_tiles, local_lo, offset0, step_size,
                    NUM_RESIDUES, PAGE, SBS, VERT, BLOCK_N, CHUNK)


@triton.jit
def _keys_at(offs_n, t, num_vert_tiles, local_lo, offset0, step_size,
             NUM_RESIDUES: tl.constexpr, PAGE: tl.constexpr, SBS: tl.constexpr,
             VERT: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """`_tile_keys` at the tile's offsets offs_n (all of them, or each page's first)."""
    CHUNKS: tl.constexpr = BLOCK_N // CHUNK
    PER_BLOCK: tl.constexpr = SBS // CHUNK
    u = t * CHUNKS + offs_n // CHUNK  # vertical chunk: (period, class, chunk of the block)
    block = u // PER_BLOCK
    cls = block % NUM_RESIDUES
    kb = (block // NUM_RESIDUES) * VERT + (VERT - (offset0 + cls * step_size) % VERT) % VERT
    live = kb < local_lo
    kb = tl.where(live, kb, tl.maximum(kb - tl.cdiv(kb - local_lo + 1, VERT) * VERT, 0))
    chunk_start = kb * SBS + (u % PER_BLOCK) * CHUNK
    win_start = local_lo * SBS + (t - num_vert_tiles) * BLOCK_N
    is_vert = t < num_vert_tiles
    key = tl.where(is_vert, chunk_start + offs_n % CHUNK, win_start + offs_n)
    if CHUNK % PAGE == 0:
        column = tl.where(is_vert, chunk_start // PAGE + (offs_n // PAGE) % (CHUNK // PAGE),
                          win_start // PAGE + offs_n // PAGE)
    else:  # pages larger than a chunk (or not a power of 2): plain division
        column = key // PAGE
    return key, column, live | (t >= num_vert_tiles)


@triton.jit
def _key_lines(KC, page, stride_kb, PAGE: tl.constexpr, X: tl.constexpr,
               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """K [BLOCK_D, BLOCK_N] of a tile whose chunks start on pages, gathered page by page as
    [pages, D / X, PAGE x X] and reshaped. The v0 key block is (d // X, slot, d % X): each
    d // X of a page is PAGE x X contiguous elements (256 bytes at bf16). A [D, N] load gives
    the d axis its threads first (16 threads x 16 bytes down d, 256 bytes apart): one warp
    request touches one 32-byte sector in each of 16 lines, and every line is put together
    from four warps' requests. Here a warp's 16 x 16 bytes cover one such run, whole lines
    as the V loads and the dense pass's are; in shared memory a key's X elements sit 16
    bytes after the previous key's, so the MMA's 8-key row reads hit distinct banks."""
    PAGES: tl.constexpr = BLOCK_N // PAGE
    first = tl.max(tl.reshape(page, (PAGES, PAGE)), 1)  # the keys of a page share it
    return _key_lines_of(KC, first, stride_kb, PAGE, X, HEAD_D, BLOCK_D, BLOCK_N)


@triton.jit
def _key_lines_of(KC, first, stride_kb, PAGE: tl.constexpr, X: tl.constexpr,
                  HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_key_lines` from the tile's pages [BLOCK_N / PAGE] (one entry a page)."""
    PAGES: tl.constexpr = BLOCK_N // PAGE
    D_HI: tl.constexpr = BLOCK_D // X
    hi = tl.arange(0, D_HI)
    run = tl.arange(0, PAGE * X)  # slot * X + d % X
    ptrs = (KC + first[:, None, None] * stride_kb + hi[None, :, None] * (PAGE * X)
            + run[None, None, :])
    if BLOCK_D == HEAD_D:
        k3 = tl.load(ptrs)
    else:
        d = hi[None, :, None] * X + run[None, None, :] % X
        k3 = tl.load(ptrs, mask=d < HEAD_D, other=0.0)
    k4 = tl.reshape(k3, (PAGES, D_HI, PAGE, X))  # (page, d // X, slot, d % X)
    return tl.reshape(tl.permute(k4, (1, 3, 0, 2)), (BLOCK_D, BLOCK_N))


@triton.jit
def _value_lines(VC, first, stride_vb, PAGE: tl.constexpr, HEAD_D: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """V [BLOCK_N, BLOCK_D] of a tile whose chunks start on pages, from its pages
    [BLOCK_N / PAGE], loaded as [pages, D, PAGE] and permuted. The v0 value block is
    (d, slot): a page's V is one run of D x PAGE elements (2 KB at fp8), so a warp's
    requests cover whole lines; the [N, D] load by key puts 4 d of 8 pages in a warp
    request at fp8, 64 bytes of each of 8 lines."""
    d = tl.arange(0, BLOCK_D)
    slot = tl.arange(0, PAGE)
    ptrs = (VC + first[:, None, None] * stride_vb + d[None, :, None] * PAGE
            + slot[None, None, :])
    if BLOCK_D == HEAD_D:
        v3 = tl.load(ptrs)
    else:
        v3 = tl.load(ptrs, mask=d[None, :, None] < HEAD_D, other=0.0)
    return tl.reshape(tl.permute(v3, (0, 2, 1)), (BLOCK_N, BLOCK_D))


@triton.jit
def _tile_pages(bt_row, t, num_vert_tiles, local_lo, offset0, step_size, last_col,
                NUM_RESIDUES: tl.constexpr, PAGE: tl.constexpr, SBS: tl.constexpr,
                VERT: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Tile t's cache blocks, one a page [BLOCK_N / PAGE] (int64; columns past the
    sequence's last page read that page), loaded from the block table once a page."""
    _, col, _ = _keys_at(tl.arange(0, BLOCK_N // PAGE) * PAGE, t, num_vert_tiles, local_lo,
                         offset0, step_size, NUM_RESIDUES, PAGE, SBS, VERT, BLOCK_N, CHUNK)
    return tl.load(bt_row + tl.minimum(col, last_col)).to(tl.int64)


@triton.jit
def _decode_tile(acc, l_i, m_i, q, KC, VC, bt_row, t, num_vert_tiles, local_lo, offset0,
                 row_offset, seq_len, q_pos, slope, step_size, stride_kb, stride_vb,
                 NUM_RESIDUES: tl.constexpr, PAGE: tl.constexpr, X: tl.constexpr,
                 SBS: tl.constexpr, LOCAL: tl.constexpr, VERT: tl.constexpr,
                 HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 TAIL: tl.constexpr, page, KEY_LINES: tl.constexpr,
                 PAGE_LINES: tl.constexpr, SLOT_SUMS: tl.constexpr, pages,
                 VALUE_LINES: tl.constexpr):
    """One tile into the state; `page`: its cache blocks, one a key, or (PAGE_LINES)
    `pages`, one a page, K then loaded as whole lines from them, and V too with
    VALUE_LINES (else V by its [N, D] load from `page`). SLOT_SUMS: l_i is [BLOCK_M,
    BLOCK_N], a sum per key slot (`slot_softmax_step`)."""
    ROW_MASK: tl.constexpr = (NUM_RESIDUES > 1) or (LOCAL == 0 and VERT > 1)
    key, column, live = _tile_keys(t, num_vert_tiles, local_lo, offset0, step_size,
                                   NUM_RESIDUES, PAGE, SBS, VERT, BLOCK_N, CHUNK)
    if TAIL:  # the window's last tile: keys past the end read the last page (masked, and
        # their V zeroed below: its slots past the end may hold anything, NaN included)
        live = key < seq_len
        if not (PAGE_LINES and VALUE_LINES):  # (`pages` are clamped where loaded)
            column = tl.minimum(column, (seq_len - 1) // PAGE)
            page = tl.load(bt_row + column).to(tl.int64)
    if CHUNK % PAGE == 0:  # chunks start on a page
        slot = tl.arange(0, BLOCK_N) % PAGE
    else:
        slot = key % PAGE
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    # v0 layout: key (page, d // X, slot, d % X); value (page, d, slot) (KV head folded in).
    # (the last tile with V by key takes K by key too: the pages then die with the loop;
    # carried past it they took a third entry load a trip and spilled 128-key tiles)
    if PAGE_LINES and (VALUE_LINES or not TAIL):
        k = _key_lines_of(KC, pages, stride_kb, PAGE, X, HEAD_D, BLOCK_D, BLOCK_N)
    elif KEY_LINES and CHUNK % PAGE == 0:
        k = _key_lines(KC, page, stride_kb, PAGE, X, HEAD_D, BLOCK_D, BLOCK_N)
    else:
        k = tl.load(KC + page[None, :] * stride_kb + (offs_d[:, None] // X) * (PAGE * X)
                    + slot[None, :] * X + offs_d[:, None] % X, mask=d_ok[:, None], other=0.0)
    s = tl.dot(q, k.to(DOT_DTYPE), input_precision="ieee")
    if slope is not None:
        s += slope[:, None] * (key - q_pos).to(tl.float32)[None, :]
    ok = tl.broadcast_to(live[None, :], s.shape)
    # Rows see a vertical block by their own class; the window whole (at LOCAL > 0).
    if ROW_MASK:
        seen = ((key[None, :] // SBS + row_offset[:, None]) % VERT) == 0
        if LOCAL > 0:
            seen = seen | (t >= num_vert_tiles)
        ok = ok & seen
    s = tl.where(ok, s, float("-inf"))
    if PAGE_LINES and VALUE_LINES:
        v = _value_lines(VC, pages, stride_vb, PAGE, HEAD_D, BLOCK_D, BLOCK_N)
    else:
        v = tl.load(VC + page[:, None] * stride_vb + offs_d[None, :] * PAGE + slot[:, None],
                    mask=d_ok[None, :], other=0.0)
    if TAIL:
        v = tl.where(live[:, None], v, 0.0)
    if SLOT_SUMS:
        p, alpha, l_i, m_i = slot_softmax_step(s, m_i, l_i)
    else:
        p, alpha, l_i, m_i = softmax_step(s, m_i, l_i)
    acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision="ieee")
    return acc, l_i, m_i


@triton.jit
def _decode_kernel(
    Q, KC, VC, Out, PartOut, PartLse, block_tables, seq_lens, alibi_slopes, k_scale, v_scale,
    qk_scale, head_base, step_size, stride_qs, stride_qh, stride_kb, stride_vb, stride_bt,
    stride_os, stride_oh, GROUP: tl.constexpr, PER_KV_HEAD: tl.constexpr,
    NUM_RESIDUES: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, X: tl.constexpr,
    SBS: tl.constexpr, LOCAL: tl.constexpr, VERT: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, KEY_LINES: tl.constexpr, PAGE_LINES: tl.constexpr,
    SLOT_SUMS: tl.constexpr, VALUE_LINES: tl.constexpr,
):
    """Grid (num_seqs, num_kv_heads, splits); rows r < GROUP are the KV head's query heads
    (rows r < NUM_RESIDUES have distinct vertical classes, the rest repeat them)."""
    WINDOW: tl.constexpr = LOCAL if LOCAL > 0 else 1
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    head0 = kv_head * GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    head = head0 + offs_m
    row_ok = offs_m < GROUP
    d_ok = offs_d < HEAD_D
    seq_len = tl.load(seq_lens + seq)
    q_pos = tl.maximum(seq_len - 1, 0)
    q = tl.load(Q + seq.to(tl.int64) * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    scale = qk_scale
    if k_scale is not None:
        scale *= tl.load(k_scale)
    q = (q.to(tl.float32) * scale).to(DOT_DTYPE)
    slope = None
    if alibi_slopes is not None:
        slope = tl.load(alibi_slopes + head, mask=row_ok, other=0.0) * LOG2E
    row_offset = _row_offsets(head_base, head, step_size, GROUP, PER_KV_HEAD)  # [BLOCK_M]
    offset0 = _row_offsets(head_base, head0, step_size, GROUP, PER_KV_HEAD)
    local_lo = tl.maximum(q_pos // SBS - WINDOW + 1, 0)  # first block of the window
    if VERT == 1:  # dense: the window is everything
        local_lo = 0
    vert_chunks = tl.cdiv(local_lo, VERT) * NUM_RESIDUES * (SBS // CHUNK)
    num_vert_tiles = tl.cdiv(vert_chunks, BLOCK_N // CHUNK)
    num_tiles = tl.where(seq_len > 0,
                         num_vert_tiles + tl.cdiv(seq_len - local_lo * SBS, BLOCK_N), 0)
    per_split = tl.cdiv(num_tiles, tl.num_programs(2))
    t_lo = split * per_split
    t_hi = tl.minimum(num_tiles, t_lo + per_split)

    KC += kv_head * (HEAD_D * PAGE)  # packed v0 blocks: a KV head is HEAD_D x PAGE elements
    VC += kv_head * (HEAD_D * PAGE)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if SLOT_SUMS:  # rows summed once after the loop (`slot_softmax_step`)
        l_i = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Each tile's block-table entries are loaded one tile ahead: K/V addresses then depend on
    # no load of their own iteration, and the pipeliner gives them num_stages - 1 buffers
    # (with the load in the loop it gave them one, whatever num_stages).
    last_col = q_pos // PAGE  # (0 for an empty request: no K/V load follows)
    # Entries one a page (PAGE_LINES: no per-key entries for K to widen and reduce) and one
    # a key where a load still takes them (K without page lines; V without value lines,
    # whose [N, D] load then stays the dot's direct operand).
    BY_KEY: tl.constexpr = not (PAGE_LINES and VALUE_LINES)
    page = None
    pages = None
    if PAGE_LINES:
        pages = _tile_pages(bt_row, t_lo, num_vert_tiles, local_lo, offset0, step_size,
                            last_col, NUM_RESIDUES, PAGE, SBS, VERT, BLOCK_N, CHUNK)
    if BY_KEY:
        _, col, _ = _tile_keys(t_lo, num_vert_tiles, local_lo, offset0, step_size,
                               NUM_RESIDUES, PAGE, SBS, VERT, BLOCK_N, CHUNK)
        page = tl.load(bt_row + tl.minimum(col, last_col)).to(tl.int64)
    for t in range(t_lo, tl.minimum(t_hi, num_tiles - 1)):
        if PAGE_LINES:
            pages_next = _tile_pages(bt_row, t + 1, num_vert_tiles, local_lo, offset0,
                                     step_size, last_col, NUM_RESIDUES, PAGE, SBS, VERT,
                                     BLOCK_N, CHUNK)
        if BY_KEY:
            _, col, _ = _tile_keys(t + 1, num_vert_tiles, local_lo, offset0, step_size,
                                   NUM_RESIDUES, PAGE, SBS, VERT, BLOCK_N, CHUNK)
            page_next = tl.load(bt_row + tl.minimum(col, last_col)).to(tl.int64)
        acc, l_i, m_i = _decode_tile(
            acc, l_i, m_i, q, KC, VC, bt_row, t, num_vert_tiles, local_lo, offset0,
            row_offset, seq_len, q_pos, slope, step_size, stride_kb, stride_vb, NUM_RESIDUES,
            PAGE, X, SBS, LOCAL, VERT, HEAD_D, BLOCK_D, BLOCK_N, CHUNK, DOT_DTYPE,
            False, page, KEY_LINES, PAGE_LINES, SLOT_SUMS, pages, VALUE_LINES)
        if PAGE_LINES:
            pages = pages_next
        if BY_KEY:
            page = page_next
    if (t_lo < t_hi) & (t_hi == num_tiles):
        acc, l_i, m_i = _decode_tile(
            acc, l_i, m_i, q, KC, VC, bt_row, num_tiles - 1, num_vert_tiles, local_lo,
            offset0, row_offset, seq_len, q_pos, slope, step_size, stride_kb, stride_vb,
            NUM_RESIDUES, PAGE, X, SBS, LOCAL, VERT, HEAD_D, BLOCK_D, BLOCK_N, CHUNK,
            DOT_DTYPE, True, page, KEY_LINES, PAGE_LINES, SLOT_SUMS, pages, VALUE_LINES)

    if SLOT_SUMS:
        l_i = tl.sum(l_i, 1)
    out, lse = finish_rows(acc, m_i, l_i, None)
    if v_scale is not None:
        out *= tl.load(v_scale)
    mask = row_ok[:, None] & d_ok[None, :]
    if PartOut is not None:
        part = (split * tl.num_programs(0) + seq) * (GROUP * tl.num_programs(1)) + head
        tl.store(PartOut + part[:, None] * HEAD_D + offs_d[None, :], out, mask=mask)
        tl.store(PartLse + part, lse, mask=row_ok)
    else:
        tl.store(Out + seq.to(tl.int64) * stride_os + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 out: torch.Tensor, *, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, head_base: int, head_sliding_step: int, block_size: int,
                 local_blocks: int, vert_stride: int, alibi_slopes: Optional[torch.Tensor],
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                 max_seq_len: int, num_splits: int = 0,
                 workspace: Optional[tuple[torch.Tensor, ...]] = None,
                 tiles: Optional[tuple[int, int, int]] = None,
                 batch_invariant: bool = False) -> None:
    """Same contract as `pagedattn.ops.torch.blocksparse.paged_decode`. `workspace` is
    `decode_workspace`'s scratch (a builder's, for CUDA graphs; allocated here without it);
    `tiles` = (BLOCK_N, warps, stages[, maxnreg]) overrides the launch (benchmarks; a cap
    on registers lets 128-key tiles keep three programs an SM). batch_invariant:
    a split count that does not follow the batch (1 unless num_splits forces one), so a
    row's tiles and merge are its own."""
    num_seqs, num_heads, head_size = query.shape
    if num_seqs == 0:
        return
    num_kv_heads, page, x = key_cache.shape[1], key_cache.shape[3], key_cache.shape[4]
    group = num_heads // num_kv_heads
    packed_k = (head_size * page, page * x, x, 1)
    packed_v = (head_size * page, page, 1)
    if key_cache.stride()[1:] != packed_k or value_cache.stride()[1:] != packed_v:
        raise ValueError("the v0 caches must be packed within a block (as split_kv_cache's "
                         f"views are); got strides {key_cache.stride()} and "
                         f"{value_cache.stride()}")
    vert = max(1, vert_stride)
    residues = residue_classes(group, head_sliding_step, vert)
    splits = num_splits or (1 if batch_invariant else decode_splits(
        query.device, num_seqs, num_kv_heads, max_seq_len, residues, block_size, local_blocks,
        vert, key_cache.dtype.itemsize, head_size))
    part_out = part_lse = None
    if splits > 1:
        rows = splits * num_seqs * num_heads
        if workspace is None or workspace[1].shape[0] < rows or workspace[2].shape[0] <= num_seqs:
            f32 = dict(dtype=torch.float32, device=query.device)  # an eager call's own scratch
            workspace = (torch.empty(rows, head_size, **f32), torch.empty(rows, **f32),
                         torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device))
        part_out, part_lse, cu = workspace
    query = query if query.stride(-1) == 1 else query.contiguous()
    kv_scale = key_cache.dtype.itemsize == 1
    tiles = check_tiles(tiles) if tiles else default_tiles(head_size, key_cache.dtype.itemsize)
    block_n, warps, stages = tiles[:3]
    # maxnreg only where asked: a launch without it compiles as it always has
    extra = dict(maxnreg=tiles[3]) if len(tiles) == 4 else {}
    dot = launch.dot_dtype(query.dtype, key_cache.dtype, out.dtype, query.device)
    chunk = min(block_n, block_size & -block_size)  # the largest power of 2 dividing it
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        query, key_cache, value_cache, out, part_out, part_lse, block_tables, seq_lens,
        alibi_slopes, k_scale if kv_scale else None, v_scale if kv_scale else None,
        scale * LOG2E.value, head_base, abs(head_sliding_step), query.stride(0), query.stride(1),
        key_cache.stride(0), value_cache.stride(0), block_tables.stride(0), out.stride(0),
        out.stride(1), GROUP=group, PER_KV_HEAD=head_sliding_step < 0, NUM_RESIDUES=residues,
        BLOCK_M=max(16, pow2_at_least(group)), PAGE=page, X=x, SBS=block_size,
        LOCAL=local_blocks, VERT=vert, HEAD_D=head_size,
        BLOCK_D=max(16, pow2_at_least(head_size)), BLOCK_N=block_n, CHUNK=chunk,
        DOT_DTYPE=dot, KEY_LINES=key_lines(),
        PAGE_LINES=page_lines(block_n, page, chunk),
        SLOT_SUMS=slot_sums(), VALUE_LINES=value_lines(),
        num_warps=warps, num_stages=stages, **extra)
    if splits > 1:
        reduce_splits(out, None, part_out, part_lse, cu[:num_seqs + 1], num_seqs, 1,
                      splits, decode_pass=True)
