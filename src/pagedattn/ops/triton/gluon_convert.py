"""The fp8 converter partition of the Gluon prefill kernel (fp8 e4m3 / e5m2 caches).

The producer TMA-loads a tile's fp8 pages into a STAGES-slot staging ring; two converter warps
turn each staged K and V tile into the 16-bit tile the consumers' wgmma reads (q's dtype), in
shared memory, once per tile: the consumers never convert an fp8 element. With an fp8 q, or
a 16-bit q over an fp8 cache (split by each consumer in two e4m3 terms), the consumers'
Q K^T is an fp8 wgmma that reads the staged K tile itself (both consumers release its slot)
and only V is converted. The conversion is exact (every e4m3 / e5m2 value is a
bf16 and an fp16 value); the descales stay scalars of the consumers (k's in the score
scale, v's in the epilogue). V rows past the sequence are written as zeros: a page's
unwritten slots may hold NaN / inf, which P = 0 would not cancel in P V.
Barriers: k8/v8_ready (TMA landed), k8/v8_empty (the converter read the slot: the producer
may reload it), then the consumers' k/v_ready (plain arrive after the writes and a proxy
fence) and k/v_empty. A V tile's round of these (`convert_v`) is the decode kernel's
converter too (`gluon_decode.py`). Imports nothing but Triton.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier


@gluon.jit
def convert_tile(src, dst, valid_rows, BLOCK_N: gl.constexpr, D: gl.constexpr,
                  ZERO_TAIL: gl.constexpr):
    """dst[r] := src[r] in dst's dtype (ZERO_TAIL: rows r >= valid_rows := 0), in slabs of
    8 or 16 rows x up to 128 columns (whole swizzle atoms of both tiles: Gluon slices
    those). Triton cannot tell that `src` and `dst` (partition arguments) are different
    buffers: it puts a barrier of the partition's warps between each store and the next
    load, which leaves every slab's load latency exposed; so slabs are as large as the 40
    registers of an fp16 conversion allow without spilling in the loop (16 rows; the bf16
    conversion and the 24 registers of head 256 take 8)."""
    COLS: gl.constexpr = 128 if D > 128 else D
    SLAB: gl.constexpr = 16 if dst.dtype == gl.float16 and D <= 128 and BLOCK_N >= 16 else 8
    # 8 values a thread (16 values would put two 128-byte swizzle blocks of the 16-bit tile,
    # 16 KB apart, on the same banks: two-way conflicts on every store) and a whole row of
    # COLS to each COLS // 8 threads. Each quarter warp of a 16-byte store then fills one
    # swizzle block, and each half warp of an 8-byte fp8 load one whole 128-byte row: rows
    # of 128 fp8 values split over 8 threads put both halves' rows on the same 16 banks
    # (two-way conflicts on every load: ncu, KERNEL_NOTES v17).
    TPR: gl.constexpr = COLS // 8
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [gl.num_warps(), 1],
                                         [1, 0])
    rows = gl.expand_dims(gl.arange(0, SLAB, layout=gl.SliceLayout(1, blk)), 1)
    PARTS: gl.constexpr = D // COLS
    SLABS: gl.constexpr = (BLOCK_N // SLAB) * PARTS
    # Each slab's load is issued before the previous slab's stores, so its latency runs
    # under that slab's conversion instead of after the barrier.
    x = src.slice(0, SLAB).slice(0, COLS, dim=1).load(blk)
    for i in gl.static_range(SLABS):
        if i + 1 < SLABS:
            x_next = src.slice(((i + 1) // PARTS) * SLAB, SLAB).slice(
                ((i + 1) % PARTS) * COLS, COLS, dim=1).load(blk)
        if dst.dtype == gl.float16:  # exact: one F2FP per pair (e4m3), a PRMT (e5m2)
            y = x.to(gl.float16)
        else:
            # fp8 -> fp16 -> fp32 -> bf16 keeps to the ALU pipes (a direct fp16 -> bf16
            # convert takes the slow conversion unit); exact, every fp8 value is a bf16.
            y = x.to(gl.float16).to(gl.float32).to(dst.dtype)
        if ZERO_TAIL:
            y = gl.where(rows + (i // PARTS) * SLAB < valid_rows, y, gl.zeros_like(y))
        dst.slice((i // PARTS) * SLAB, SLAB).slice((i % PARTS) * COLS, COLS, dim=1).store(y)
        if i + 1 < SLABS:
            x = x_next


@gluon.constexpr_function
def pairs_layout(slab_n, pairs=32):
    """How the converter's two warps hold a [slab_n, pairs] slab of a V tile viewed as 16-bit
    column pairs (pairs 32, or 64: a second half of columns in each thread's registers): as
    `ldmatrix.trans` delivers 8 x 8 matrices (keys 2k and 2k + 1 of one pair in a thread, 4
    pairs x 8 columns a warp), with the matrix 8 keys below in the same thread: so both
    4-byte words of V^T that one thread writes are its own."""
    regs = [[1, 0], [8, 0]] + ([[16, 0]] if slab_n == 32 else []) + [[0, 8]]
    if pairs == 64:
        regs = regs + [[0, 32]]
    return gl.DistributedLinearLayout(
        reg_bases=regs, lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 16]], block_bases=[], shape=[slab_n, pairs])


@gluon.jit
def _slab(src16, n0: gl.constexpr, j0: gl.constexpr, SLAB_N: gl.constexpr,
          PAIRS: gl.constexpr):
    """Keys [n0, n0 + SLAB_N) x column pairs [j0, j0 + PAIRS) of src16, as `pairs_layout`
    holds them (LDSM.16.MT88)."""
    return src16.slice(n0, SLAB_N).slice(j0, PAIRS, dim=1).load(pairs_layout(SLAB_N, PAIRS))


@gluon.jit
def _transpose_slab(src16, dst16, valid_rows, n0: gl.constexpr, j0: gl.constexpr,
                    SLAB_N: gl.constexpr, ZERO_TAIL: gl.constexpr, PRMT: gl.constexpr = False,
                    PAIRS: gl.constexpr = 32, t=None):
    """Keys [n0, n0 + SLAB_N) x column pairs [j0, j0 + PAIRS) of src16 (an fp8 V tile viewed
    as int16 column pairs) into dst16 (V^T viewed as int16 key pairs), in the key order of
    `transpose_tile`: each pair of one column's bytes at keys 2k and 2k + 1 of a 16-key
    group (a byte from each of two int16 loads) lands as one int16, beside the pair 8 keys
    below it. t: that slab as `_slab` loaded it (None: loaded here)."""
    layout: gl.constexpr = pairs_layout(SLAB_N, PAIRS)
    if t is None:
        t = src16.slice(n0, SLAB_N).slice(j0, PAIRS, dim=1).load(layout)  # LDSM.16.MT88
    if ZERO_TAIL:
        rows = gl.expand_dims(gl.arange(0, SLAB_N, layout=gl.SliceLayout(1, layout)), 1)
        t = gl.where(rows + n0 < valid_rows, t, gl.zeros_like(t))
    t = gl.reshape(t, [SLAB_N // 16, 2, 4, 2, PAIRS])  # [g, n3, k, b, j]: 2k + b + 8 n3 + 16 g
    if PRMT == 2:
        # halves n3 = 0 / 1, each thread's registers still the ldmatrix words (b = 0, 1)
        lo, hi = word_bytes(*gl.split(gl.permute(t, (0, 2, 3, 4, 1))))  # [g, k, n3, j]
        w = gl.permute(gl.join(lo, hi), (3, 4, 0, 1, 2))  # [j, e, g, k, n3]
    else:
        even, odd = gl.split(gl.permute(t, (0, 1, 2, 4, 3)))  # b = 0 / 1: [g, n3, k, j]
        if PRMT:
            lo, hi = pair_bytes(even, odd)
        else:
            lo = (even & 0xFF) | (odd << 8)  # column 2j's bytes of both keys
            hi = ((even >> 8) & 0xFF) | (odd & -256)  # column 2j + 1's
        w = gl.permute(gl.join(lo, hi), (3, 4, 0, 2, 1))  # [j, e, g, k, n3]
    dst16.slice(2 * j0, 2 * PAIRS).slice(n0 // 2, SLAB_N // 2, dim=1).store(
        gl.reshape(w, [2 * PAIRS, SLAB_N // 2]))  # STSM.16.M88


@gluon.jit
def pair_bytes(even, odd):
    """(lo, hi) int16 of `_transpose_slab`'s key pairs: lo the low bytes of even and odd
    (column 2j's at keys 2k and 2k + 1), hi their high bytes, two PRMT over packed words of
    two int16 each instead of Triton's masks and shifts on each int16 apart (sm_90 SASS at
    head 128, an fp8 P V's kernel: 9,376 -> 8,792 instructions, LOP3 702 -> 393, SHF 139 ->
    11, IMAD 160 -> 32). Which two elements share a word does not matter: the bytes move
    within each 16-bit half."""
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $2, $3, 0x6240;\nprmt.b32 $1, $2, $3, 0x7351;", "=r,=r,r,r",
        [even, odd], dtype=(gl.int16, gl.int16), is_pure=True, pack=2)


@gluon.jit
def word_bytes(x, y):
    """`pair_bytes` over the words ldmatrix delivered: x and y [g, k, b, j] int16 (keys
    2k + b + 8 n3 + 16 g of column pair j, n3 = 0 in x, 1 in y), each thread's two
    consecutive elements (b = 0, 1) one loaded word, b = 0 its low half: bytes (key 2k's
    columns 2j, 2j + 1, key 2k + 1's). Returns (lo, hi) [g, k, n3, j], the slot b of x's
    layout now holding n3: lo column 2j's bytes of keys 2k and 2k + 1 (x's bytes 0 and 2,
    then y's), hi column 2j + 1's (bytes 1 and 3). One PRMT a word written, where
    `pair_bytes` over halves split by b first has Triton pack its operands' words again
    (sm_90 SASS of the fp8 P V's converter: 16 PRMT a 32-key slab of head 64 -> 8)."""
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $2, $3, 0x6420;\nprmt.b32 $1, $2, $3, 0x7531;", "=r,=r,r,r",
        [x, y], dtype=(gl.int16, gl.int16), is_pure=True, pack=2)


@gluon.jit
def transpose_tile(src, dst, valid_rows, BLOCK_N: gl.constexpr, D: gl.constexpr,
                   ZERO_TAIL: gl.constexpr, PRMT: gl.constexpr = False,
                   COLS: gl.constexpr = 64, PREFETCH: gl.constexpr = False):
    """dst [D, BLOCK_N] := src [BLOCK_N, D]^T, fp8 (ZERO_TAIL: keys r >= valid_rows := 0): the
    fp8 P V wgmma reads B K-major, V^T's keys contiguous, which TMA cannot make of the
    cache's [keys, columns] pages. Keys are stored permuted within each group of 16: V^T
    column 4k + 2h + b holds key 2k + 8h + b (k < 4; h, b < 2), the order in which a
    thread's accumulator holds S's columns (2k, 2k + 1, 2k + 8, 2k + 9), so the consumers
    take P into the fp8 wgmma's A operand without moving a byte between threads
    (`gluon_consumer.p_keys_as_vt`; FA3 orders its V^T so too). Both tiles are viewed as
    int16 pairs: ldmatrix.trans reads, byte permutes pair keys up, stmatrix writes; 16-key
    slabs at head 256 and over tiles wider than 128 keys (`gluon_schedule.wide_config_for`),
    where the converter has 24 registers, 32-key ones below. A slab spans COLS of V's
    columns (64, or 128 where D allows: `Ring.VT_COLS`): Triton puts a barrier of the two
    warps before every store to dst after the first (it cannot tell the slabs' stores
    apart), so 128 columns a slab halve the barriers a tile (head 256's 128-key tile: 32 ->
    16; FA3's four transposing warps wait on none between their stores). PREFETCH (COLS
    128): each slab is loaded one slab ahead, before that barrier and the previous slab's
    store, so its ldmatrix latency runs under them instead of after (the barrier orders
    stores alone: src and dst are buffers the analysis tells apart)."""
    SLAB_N: gl.constexpr = 16 if D > 128 or BLOCK_N > 128 else 32
    src16 = src._reinterpret(gl.int16, [BLOCK_N, D // 2],
                             gl.NVMMASharedLayout(src.layout.swizzle_byte_width, 16))
    dst16 = dst._reinterpret(gl.int16, [D, BLOCK_N // 2],
                             gl.NVMMASharedLayout(dst.layout.swizzle_byte_width, 16))
    gl.static_assert(D % COLS == 0, "V^T slabs must tile V's columns")
    J_SLABS: gl.constexpr = D // COLS
    SLABS: gl.constexpr = (BLOCK_N // SLAB_N) * J_SLABS
    if PREFETCH:
        gl.static_assert(COLS == 128, "slabs loaded ahead are 128 columns wide")
        t = _slab(src16, 0, 0, SLAB_N, COLS // 2)
        for i in gl.static_range(SLABS):
            if i + 1 < SLABS:
                t_next = _slab(src16, ((i + 1) // J_SLABS) * SLAB_N,
                               ((i + 1) % J_SLABS) * (COLS // 2), SLAB_N, COLS // 2)
            _transpose_slab(src16, dst16, valid_rows, (i // J_SLABS) * SLAB_N,
                            (i % J_SLABS) * (COLS // 2), SLAB_N, ZERO_TAIL, PRMT, COLS // 2, t)
            if i + 1 < SLABS:
                t = t_next
    else:
        for i in gl.static_range(SLABS):
            if COLS == 64:  # the call as it was: the 64-column forms' SASS stays byte-identical
                _transpose_slab(src16, dst16, valid_rows, (i // J_SLABS) * SLAB_N,
                                (i % J_SLABS) * 32, SLAB_N, ZERO_TAIL, PRMT)
            else:
                _transpose_slab(src16, dst16, valid_rows, (i // J_SLABS) * SLAB_N,
                                (i % J_SLABS) * (COLS // 2), SLAB_N, ZERO_TAIL, PRMT,
                                COLS // 2)


@gluon.jit
def _v_tile(src, dst, valid_rows, BLOCK_N: gl.constexpr, D: gl.constexpr,
            ZERO_TAIL: gl.constexpr, PRMT: gl.constexpr = False, COLS: gl.constexpr = 64,
            PREFETCH: gl.constexpr = False):
    """A staged fp8 V tile into the consumers' ring: transposed where that ring is fp8 V^T
    (an fp8 P V; PRMT: `pair_bytes`; COLS V columns a slab, PREFETCH: each loaded a slab
    ahead), else converted to its 16-bit dtype."""
    if dst.dtype.is_fp8():
        transpose_tile(src, dst, valid_rows, BLOCK_N, D, ZERO_TAIL, PRMT, COLS, PREFETCH)
    else:
        convert_tile(src, dst, valid_rows, BLOCK_N, D, ZERO_TAIL)


@gluon.jit
def convert_v(v8_ring, v_ring, t, start, seq_len, BLOCK_N: gl.constexpr):
    """Tile t of a walk over V (keys from start): its staged fp8 tile into a slot of v_ring
    (`_v_tile`; the sequence's last tile with its rows from seq_len zeroed), once both
    barriers allow; then the stage is released and the slot handed to the consumers."""
    HEAD_DV: gl.constexpr = v8_ring.smem.shape[2]
    stage = t % v8_ring.SLOTS
    slot = t % v_ring.SLOTS
    mbarrier.wait(v8_ring.ready.index(stage), (t // v8_ring.SLOTS) & 1)
    mbarrier.wait(v_ring.empty.index(slot), ((t // v_ring.SLOTS) & 1) ^ 1)
    if seq_len - start < BLOCK_N:  # the sequence's last tile
        _v_tile(v8_ring.smem.index(stage), v_ring.smem.index(slot), seq_len - start, BLOCK_N,
                HEAD_DV, True, v_ring.PRMT, v_ring.VT_COLS, v_ring.VT_PREFETCH)
    else:
        _v_tile(v8_ring.smem.index(stage), v_ring.smem.index(slot), BLOCK_N, BLOCK_N,
                HEAD_DV, False, v_ring.PRMT, v_ring.VT_COLS, v_ring.VT_PREFETCH)
    mbarrier.arrive(v8_ring.empty.index(stage))
    fence_async_shared()  # the writes, before the consumers' wgmma reads them
    mbarrier.arrive(v_ring.ready.index(slot))


@gluon.jit
def converter(k8_ring, v8_ring, k_ring, v_ring, items, keys):
    """Walks the producer's tiles (every key from the pages: one phase) in the same order,
    turning the staged fp8 tiles of k8_ring / v8_ring (`gluon_args.Ring`s, SLOTS the
    staging depth) into the consumers' 16-bit k_ring / v_ring. Without an fp8 cache (the
    staging rings are then the consumers' own) the partition exists but idles (one kernel
    body for every cache dtype; the launch has these warps anyway: workers round up to
    whole warpgroups). Where k_ring is the staging ring itself (an fp8 q, or a split one:
    Q K^T reads the fp8 K tiles where they land) it converts V alone. items / keys: the walk
    (`gluon_schedule.Items`, `KeyTiles`); DYNAMIC: items as the producer publishes them (it
    then counts this partition among the readers of its id slots only with KV_FP8)."""
    KV_FP8: gl.constexpr = v8_ring.smem.dtype.is_fp8()
    CONVERT_K: gl.constexpr = k_ring.smem.dtype != k8_ring.smem.dtype
    if not KV_FP8:
        return
    BLOCK_N: gl.constexpr = keys.BLOCK_N
    STAGES: gl.constexpr = v8_ring.SLOTS
    NUM_BUF: gl.constexpr = v_ring.SLOTS
    # An fp8 cache's keys all come from the pages: one phase, as the producer walks them
    # (the body is traced past the return above: the assert holds without KV_FP8 too)
    gl.static_assert(not (KV_FP8 and keys.SPLIT_AT_CONTEXT), "an fp8 plan reads no dense rows")
    tile = 0
    item_n = 0
    w = items.next(0)
    while w < items.num_items:
        valid, seq, head, q_start, q_len, q_block, seq_len = items.info(w)
        if valid:
            a_end, t_a, n_a, t_b, n_b = keys.of_block(q_block, q_len, seq_len)
            for j in range(n_a + n_b):
                t = tile + j
                stage = t % STAGES
                staged = (t // STAGES) & 1
                slot = t % NUM_BUF
                free = ((t // NUM_BUF) & 1) ^ 1  # a fresh barrier passes parity 1 at once
                start, bound, in_a = keys.at(j, a_end, t_a, n_a, t_b, seq_len)
                if CONVERT_K:
                    mbarrier.wait(k8_ring.ready.index(stage), staged)
                    mbarrier.wait(k_ring.empty.index(slot), free)
                    # K rows past the sequence need no zeros: the consumers mask those scores.
                    convert_tile(k8_ring.smem.index(stage), k_ring.smem.index(slot), BLOCK_N,
                                  BLOCK_N, k_ring.smem.shape[2], False)
                    mbarrier.arrive(k8_ring.empty.index(stage))
                    fence_async_shared()  # the writes, before the consumers' wgmma reads them
                    mbarrier.arrive(k_ring.ready.index(slot))
                convert_v(v8_ring, v_ring, t, start, seq_len, BLOCK_N)
            tile += n_a + n_b
        item_n += 1
        w = items.next(item_n)
