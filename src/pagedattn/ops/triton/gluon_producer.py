"""The producer partition of the Gluon prefill kernel: tensor descriptors and TMA loads.

One warp builds the kernel's tensor descriptors on the device (once per program, in the
launch's global scratch: the host passes pointers and strides, so a launch encodes nothing
on the host) and then walks the work items of `gluon_schedule.py`, loading each item's two
64-row Q halves (into NUM_QBUF buffers per consumer) and its key tiles into the K and V
rings (ready barriers: TMA bytes landed; empty barriers: both consumers done). Dense keys
come as one [BLOCK_N, D] box, the cached context as one [BOX, D] box per page
(BOX = min(PAGE, BLOCK_N)). The paged cache's descriptors and page loads
(`page_descriptors`, `load_pages`, `load_v_pages`) serve the decode kernels' producer too,
whose loop over a unit's key tiles is `load_unit_tiles` (`load_page_tiles` for a program of
one unit: `gluon_decode.py`, `gluon_decode_invariant.py`; the persistent form's units:
`gluon_decode_persistent.py`). Imports nothing but Triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma


@gluon.jit
def _load_rows(desc, smem, bar, row, col):
    """One dense box of BLOCK_N rows (rows past the tensor read as zeros)."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], bar, smem)


@gluon.jit
def page_descriptors(pages, k_smem, v_smem, NUM_KV: gl.constexpr):
    """The paged cache's K and V tensor descriptors (`gluon_args.Pages`), built on the
    device: rows of the cache viewed 2-D, a KV head's columns from kv_head * cols_k(v), one
    [BOX, D] box a page (BOX = min(PAGE, BLOCK_N)) into tiles laid out as k_smem / v_smem
    (a ring's [SLOTS, BLOCK_N, D] slots)."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    HEAD_DV: gl.constexpr = v_smem.shape[2]
    BOX: gl.constexpr = pages.PAGE if pages.PAGE < BLOCK_N else BLOCK_N
    desc_k = tma.make_tensor_descriptor(
        pages.k, [pages.rows, (NUM_KV - 1) * pages.cols_k + HEAD_D], [pages.stride_k, 1],
        [BOX, HEAD_D], k_smem.layout)
    desc_v = tma.make_tensor_descriptor(
        pages.v, [pages.rows, (NUM_KV - 1) * pages.cols_v + HEAD_DV], [pages.stride_v, 1],
        [BOX, HEAD_DV], v_smem.layout)
    return desc_k, desc_v


@gluon.jit
def load_pages(desc, pages, smem, bar, bt_row, start, bound, head_row, col):
    """Keys [start, start + BLOCK_N) of the paged cache (`gluon_args.Pages`), one box of
    BOX = min(PAGE, BLOCK_N) rows per page (a block's slots of one KV head are consecutive
    rows of the cache viewed 2-D: block b, slot s at row b * page_rows + head_row + s). Boxes
    wholly at or past `bound` read rows past the cache (TMA fills zeros), so the barrier
    always expects the full tile."""
    BOX: gl.constexpr = desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = smem.shape[0]
    PAGE: gl.constexpr = pages.PAGE
    mbarrier.expect(bar, (BLOCK_N // BOX) * desc.block_type.nbytes)
    n_boxes = gl.cdiv(gl.minimum(bound, start + BLOCK_N) - start, BOX)
    for i in gl.static_range(BLOCK_N // BOX):
        pos = start + i * BOX
        page = gl.load(bt_row + pos // PAGE, mask=i < n_boxes, other=0)
        row = gl.where(i < n_boxes, page * pages.page_rows + head_row + pos % PAGE, pages.rows)
        tma.async_copy_global_to_shared(desc, [row, col], bar, smem.slice(i * BOX, BOX))


@gluon.jit
def _zero_rows_from(smem, first, BLOCK_N: gl.constexpr, HEAD_DV: gl.constexpr):
    """Rows [first, BLOCK_N) of a V tile := 0: a page's slots past the sequence may hold
    anything (NaN), and P = 0 does not cancel NaN in P V. Gluon slices a 128-byte-swizzled
    tile in whole swizzle atoms (8 rows x 128 bytes), so each atom from the one holding
    `first` on is read, masked and written back (8 registers a thread)."""
    COLS: gl.constexpr = 64  # 128 bytes of 16-bit values
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0])
    rows = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, blk)), 1)
    for g in gl.static_range(BLOCK_N // 8):
        if g * 8 + 8 > first:
            for c in gl.static_range(HEAD_DV // COLS):
                atom = smem.slice(g * 8, 8).slice(c * COLS, COLS, dim=1)
                x = atom.load(blk)
                atom.store(gl.where(rows + g * 8 >= first, gl.zeros_like(x), x))


@gluon.jit
def _load_k(desc_rows, desc_pages, pages, smem, bar, from_pages, bt_row, start, bound,
            head_row, col_rows, col_pages, row_base, DENSE_ROWS: gl.constexpr):
    """A K tile from the pages or the dense rows; the choice is static where only one exists."""
    if not pages.PAGED:
        _load_rows(desc_rows, smem, bar, row_base + start, col_rows)
    elif not DENSE_ROWS:
        load_pages(desc_pages, pages, smem, bar, bt_row, start, bound, head_row, col_pages)
    elif from_pages:
        load_pages(desc_pages, pages, smem, bar, bt_row, start, bound, head_row, col_pages)
    else:
        _load_rows(desc_rows, smem, bar, row_base + start, col_rows)


@gluon.jit
def load_v_pages(desc, pages, smem, ready, fix, fixes, bt_row, start, bound, seq_len,
                  head_row, col):
    """A V tile from the pages. Its boxes may end past seq_len (the last page's unwritten
    slots): then it lands on the private barrier `fix`, those rows are zeroed and the tile is
    handed over by a plain arrive. Returns the count of fix-ups (the private barrier's phase)."""
    BOX: gl.constexpr = desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = smem.shape[0]
    loaded = gl.cdiv(gl.minimum(bound, start + BLOCK_N) - start, BOX) * BOX
    if seq_len - start < loaded:
        load_pages(desc, pages, smem, fix, bt_row, start, bound, head_row, col)
        mbarrier.wait(fix, fixes & 1)
        _zero_rows_from(smem, seq_len - start, BLOCK_N, smem.shape[1])
        fence_async_shared()
        mbarrier.arrive(ready)
        fixes += 1
    else:
        load_pages(desc, pages, smem, ready, bt_row, start, bound, head_row, col)
    return fixes


@gluon.jit
def load_page_tiles(pages, k_ring, v_ring, v_fix, seq, seq_len, lo, hi, n,
                    NUM_KV: gl.constexpr):
    """The decode kernels' producer: the program's descriptors, then its n key tiles
    (`load_unit_tiles`, KV head program_id(1), from the rings' first slots)."""
    kv_head = gl.program_id(1)
    desc_k, desc_v = page_descriptors(pages, k_ring.smem, v_ring.smem, NUM_KV)
    fixes = 0  # a tensor (an assignment makes one): the unit's loop carries it
    load_unit_tiles(desc_k, desc_v, pages, k_ring, v_ring, v_fix, fixes, 0, seq, kv_head,
                    seq_len, lo, hi, n)


@gluon.jit
def load_unit_tiles(desc_k, desc_v, pages, k_ring, v_ring, v_fix, fixes, tile, seq, kv_head,
                    seq_len, lo, hi, n):
    """The decode kernels' producer loop over a unit: its n key tiles from lo (keys below hi
    read) into k_ring and v_ring as the rings' tiles tile .. tile + n - 1 (the persistent
    form counts its earlier units' tiles), K and V in step, one box a page. v_ring is the
    consumer's 16-bit V ring (tails zeroed on the private barrier v_fix, whose phase count
    `fixes` carries across units and is returned) or an fp8 staging ring, whose converter
    zeroes them."""
    BLOCK_N: gl.constexpr = k_ring.smem.shape[1]
    ZERO_V_TAIL: gl.constexpr = not v_ring.smem.dtype.is_fp8()
    head_row = kv_head * pages.head_rows
    bt_row = pages.block_table + seq.to(gl.int64) * pages.stride_bt
    for j in range(n):
        start = lo + j * BLOCK_N
        t = tile + j
        slot = t % k_ring.SLOTS
        free = ((t // k_ring.SLOTS) & 1) ^ 1  # a fresh barrier passes parity 1 at once
        mbarrier.wait(k_ring.empty.index(slot), free)
        load_pages(desc_k, pages, k_ring.smem.index(slot), k_ring.ready.index(slot),
                   bt_row, start, hi, head_row, kv_head * pages.cols_k)
        slot = t % v_ring.SLOTS
        free = ((t // v_ring.SLOTS) & 1) ^ 1
        mbarrier.wait(v_ring.empty.index(slot), free)
        if ZERO_V_TAIL:
            fixes = load_v_pages(desc_v, pages, v_ring.smem.index(slot),
                                 v_ring.ready.index(slot), v_fix, fixes, bt_row, start,
                                 hi, seq_len, head_row, kv_head * pages.cols_v)
        else:
            load_pages(desc_v, pages, v_ring.smem.index(slot), v_ring.ready.index(slot),
                       bt_row, start, hi, head_row, kv_head * pages.cols_v)
    return fixes


@gluon.jit
def producer(rows, pages, q_bufs, k_ring, v_ring, v_fix, items, keys):
    """rows: q as [total_q, H * D] rows, dense keys / values as [kv_rows, H_kv * D(v)]
    (`gluon_args.Rows`; DENSE: a phase of dense rows exists, all keys without PAGED, the new
    tokens' with it); pages: the cache as rows of consecutive slots per block and KV head
    (`gluon_args.Pages`). Loads each item's Q halves into q_bufs (`gluon_args.Ring`: SLOTS
    items deep, one buffer a consumer each) and its tiles into k_ring / v_ring. V page tiles
    of a 16-bit cache that end past the sequence get their tail rows zeroed here (on the
    private barrier v_fix); an fp8 cache's tiles go to a staging ring whose converter zeroes
    them, and then k_ring / v_ring are that ring (v_fix a placeholder). items / keys: the walk
    (`gluon_schedule.Items`, `KeyTiles`). DYNAMIC: items come from the counter queue
    (`Items.take`), each id taken as the last one but one finishes loading and published to
    the other partitions (`Items.publish`): a program holds about one item ahead, so the
    queue's end leaves no program idle long."""
    BLOCK_M: gl.constexpr = keys.BLOCK_M
    BLOCK_N: gl.constexpr = keys.BLOCK_N
    ZERO_V_TAIL: gl.constexpr = not v_ring.smem.dtype.is_fp8()  # 16-bit pages: no converter
    ROWS: gl.constexpr = q_bufs.smem.shape[1]
    PARTS: gl.constexpr = BLOCK_M // ROWS  # the consumers' Q parts
    HEAD_D: gl.constexpr = q_bufs.smem.shape[2]
    HEAD_DV: gl.constexpr = v_ring.smem.shape[2]
    NUM_HEADS: gl.constexpr = items.NUM_HEADS
    NUM_KV: gl.constexpr = NUM_HEADS // items.GROUP
    NUM_QBUF: gl.constexpr = q_bufs.SLOTS
    NUM_BUF: gl.constexpr = k_ring.SLOTS
    PAGED: gl.constexpr = pages.PAGED
    DENSE_ROWS: gl.constexpr = rows.DENSE
    # Over a 16-bit paged cache K runs a tile ahead of V: a K slot frees at a Q K^T, a V
    # slot only at the P V after it, and the consumers' next step wants K first; behind V
    # it waited for that later release, and its page boxes' latency showed (the 2,048-token
    # chunk after 30,720 cached on the engine path: 3% faster in three A/B calls). Dense
    # rows and the fp8 staging ring measured 1-3% slower with it and keep K and V in step
    # (docs/dev/KERNEL_NOTES.md v18).
    K_AHEAD: gl.constexpr = 1 if PAGED and ZERO_V_TAIL else 0
    desc_q = tma.make_tensor_descriptor(rows.q, [rows.total_q, NUM_HEADS * HEAD_D],
                                        [rows.stride_q, 1], [ROWS, HEAD_D], q_bufs.smem.layout)
    desc_k = None
    desc_v = None
    desc_kc = None
    desc_vc = None
    if DENSE_ROWS:
        desc_k = tma.make_tensor_descriptor(rows.k, [rows.kv_rows, NUM_KV * HEAD_D],
                                            [rows.stride_k, 1], [BLOCK_N, HEAD_D],
                                            k_ring.smem.layout)
        desc_v = tma.make_tensor_descriptor(rows.v, [rows.kv_rows, NUM_KV * HEAD_DV],
                                            [rows.stride_v, 1], [BLOCK_N, HEAD_DV],
                                            v_ring.smem.layout)
    if PAGED:
        desc_kc, desc_vc = page_descriptors(pages, k_ring.smem, v_ring.smem, NUM_KV)
    tile = 0
    item = 0  # valid items (Q buffer turns)
    item_n = 0  # items taken, valid or not (id slots, rounds)
    fixes = 0
    if items.DYNAMIC:  # ids 0 and 1 now, id n + 2 when item n's loads are issued
        w = items.take()
        items.publish(0, w)
        w_next = items.take()
        items.publish(1, w_next)
    else:
        w = items.round(0)
        w_next = w
    while w < items.num_items:
        valid, seq, head, q_start, q_len, q_block, seq_len = items.info(w)
        if valid:
            context = seq_len - q_len
            a_end, t_a, n_a, t_b, n_b = keys.of_block(q_block, q_len, seq_len)
            kv_head = head // items.GROUP
            head_row = kv_head * pages.head_rows
            # Q halves, into the buffers of NUM_QBUF items ago: wait until that item's QK^T
            # read them (with two buffers, long done: this item's Q lands while the
            # consumers finish the last one).
            for c in gl.static_range(PARTS):
                qb = (item % NUM_QBUF) * PARTS + c
                mbarrier.wait(q_bufs.empty.index(qb), ((item // NUM_QBUF) & 1) ^ 1)
                mbarrier.expect(q_bufs.ready.index(qb), desc_q.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    desc_q, [q_start + q_block * BLOCK_M + c * ROWS, head * HEAD_D],
                    q_bufs.ready.index(qb), q_bufs.smem.index(qb))
            if PAGED:  # dense rows are the new tokens': position p at row q_start + p - context
                row_base = q_start - context
            else:
                row_base = gl.load(rows.cu_seqlens_k + seq)
            bt_row = 0  # the request's row of the block table (dense keys: none)
            if PAGED:
                bt_row = pages.block_table + seq.to(gl.int64) * pages.stride_bt
            # Step j loads K j and V j - K_AHEAD.
            for j in range(n_a + n_b + K_AHEAD):
                if j < n_a + n_b:
                    t = tile + j
                    slot = t % NUM_BUF
                    phase = ((t // NUM_BUF) & 1) ^ 1  # a fresh barrier passes parity 1 at once
                    start, bound, in_a = keys.at(j, a_end, t_a, n_a, t_b, seq_len)
                    mbarrier.wait(k_ring.empty.index(slot), phase)
                    _load_k(desc_k, desc_kc, pages, k_ring.smem.index(slot),
                            k_ring.ready.index(slot), in_a, bt_row, start, bound, head_row,
                            kv_head * HEAD_D, kv_head * pages.cols_k, row_base, DENSE_ROWS)
                if j >= K_AHEAD:
                    t = tile + j - K_AHEAD
                    slot = t % NUM_BUF
                    phase = ((t // NUM_BUF) & 1) ^ 1
                    start, bound, in_a = keys.at(j - K_AHEAD, a_end, t_a, n_a, t_b, seq_len)
                    mbarrier.wait(v_ring.empty.index(slot), phase)
                    v_s = v_ring.smem.index(slot)
                    if not PAGED:
                        _load_rows(desc_v, v_s, v_ring.ready.index(slot), row_base + start,
                                   kv_head * HEAD_DV)
                    elif not ZERO_V_TAIL:
                        load_pages(desc_vc, pages, v_s, v_ring.ready.index(slot), bt_row,
                                    start, bound, head_row, kv_head * pages.cols_v)
                    elif (not DENSE_ROWS) or in_a:  # pages: all keys, or the context's
                        fixes = load_v_pages(desc_vc, pages, v_s, v_ring.ready.index(slot),
                                              v_fix, fixes, bt_row, start, bound, seq_len,
                                              head_row, kv_head * pages.cols_v)
                    else:
                        _load_rows(desc_v, v_s, v_ring.ready.index(slot), row_base + start,
                                   kv_head * HEAD_DV)
            tile += n_a + n_b
            item += 1
        if items.DYNAMIC:
            w_after = items.take()
            items.publish(item_n + 2, w_after)
            w = w_next
            w_next = w_after
        else:
            w = items.round(item_n + 1)
        item_n += 1
    if items.DYNAMIC:
        items.finish()
