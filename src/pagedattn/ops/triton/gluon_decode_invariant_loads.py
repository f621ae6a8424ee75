"""Which keys a program of batch-invariant mode's Gluon decode kernel reads, and the two
partitions that only load them (`gluon_decode_invariant.py`'s producer and converter).

Every partition of that kernel derives its request, key range and tile count alike
(`program_keys`, `live_program`); the consumer's arithmetic (which decides a row's bits)
is the kernel module's; these only fill its rings, so they change with the key split and
the rings, never with the softmax steps. Imports nothing but Triton, so it compiles
for sm_90 on a machine without torch (tools/gluon_decode_sass.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

try:
    from pagedattn.ops.triton.gluon_convert import convert_tile
    from pagedattn.ops.triton.gluon_producer import load_page_tiles
except ImportError:  # compiled standalone, without torch (tools/gluon_decode_sass.py)
    from gluon_convert import convert_tile
    from gluon_producer import load_page_tiles


@gluon.jit
def program_keys(cu_seqlens_q, seqused_k, keys, QUERIES: gl.constexpr,
                 SPLIT_KEYS: gl.constexpr, SPLIT_KV: gl.constexpr):
    """This program's request and keys, as every partition computes them: (seq, q_start,
    q_len, seq_len, context, key_lo, key_hi, full_lo, full_hi, lo, hi, n). [key_lo, key_hi):
    the keys some of its queries see, [full_lo, full_hi) those all see; the program streams
    keys [lo, hi) in n tiles of BLOCK_N from lo, on the grid of key 0: every split
    (lo = key_lo rounded down to a tile), or with SPLIT_KV split program_id(2)'s keys. n is
    0 for a request of more than QUERIES queries (another pass's) and for a split past the
    sequence (the fold reads none)."""
    BLOCK_N: gl.constexpr = keys.BLOCK_N
    seq = gl.program_id(0)
    q_start = gl.load(cu_seqlens_q + seq)
    q_len = gl.load(cu_seqlens_q + seq + 1) - q_start
    seq_len = gl.load(seqused_k + seq)
    context = seq_len - q_len  # query i sits at position context + i
    key_lo, key_hi, full_lo, full_hi = keys.ranges(context, context + q_len - 1, seq_len)
    lo = key_lo // BLOCK_N * BLOCK_N
    hi = key_hi
    if SPLIT_KV:
        split = gl.program_id(2)
        lo = gl.maximum(split * SPLIT_KEYS, lo)
        hi = gl.minimum(key_hi, (split + 1) * SPLIT_KEYS)
    n = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    n = gl.where(live_program(q_len, seq_len, QUERIES, SPLIT_KEYS, SPLIT_KV), n, 0)
    return seq, q_start, q_len, seq_len, context, key_lo, key_hi, full_lo, full_hi, lo, hi, n


@gluon.jit
def live_program(q_len, seq_len, QUERIES: gl.constexpr, SPLIT_KEYS: gl.constexpr,
                 SPLIT_KV: gl.constexpr):
    """Whether this program writes rows: a request of 1..QUERIES queries, and with SPLIT_KV
    a split that starts inside the sequence (the `tl` pass's split programs past it exit)."""
    live = (q_len <= QUERIES) & (q_len > 0)
    if SPLIT_KV:
        live = live & (gl.program_id(2) * SPLIT_KEYS < seq_len)
    return live


@gluon.jit
def producer(pages, cu_seqlens_q, seqused_k, k_ring, v_ring, v_fix, keys,
             NUM_KV: gl.constexpr, QUERIES: gl.constexpr, SPLIT_KEYS: gl.constexpr,
             SPLIT_KV: gl.constexpr):
    """TMA loads of the program's K and V tiles, one [min(PAGE, BLOCK_N), D] box a page, into
    k_ring / v_ring: the consumer's 16-bit rings (V tails zeroed on the private barrier
    v_fix), or the fp8 staging rings whose converter zeroes them. K and V go in step."""
    seq, q_start, q_len, seq_len, context, key_lo, key_hi, full_lo, full_hi, lo, hi, n = \
        program_keys(cu_seqlens_q, seqused_k, keys, QUERIES, SPLIT_KEYS, SPLIT_KV)
    if n > 0:
        load_page_tiles(pages, k_ring, v_ring, v_fix, seq, seq_len, lo, hi, n, NUM_KV)


@gluon.jit
def converter(cu_seqlens_q, seqused_k, k8_ring, v8_ring, k_ring, v_ring, keys,
              QUERIES: gl.constexpr, SPLIT_KEYS: gl.constexpr, SPLIT_KV: gl.constexpr):
    """The staged fp8 K and V tiles into the consumer's 16-bit rings (exact: every e4m3
    value is an fp16 and a bf16 value; V rows past the sequence zeroed, K rows past it are
    masked by the consumer); over a 16-bit cache (the staging rings are the consumer's) the
    partition idles."""
    if v8_ring.smem.dtype.is_fp8():
        BLOCK_N: gl.constexpr = keys.BLOCK_N
        HEAD_D: gl.constexpr = k_ring.smem.shape[2]
        HEAD_DV: gl.constexpr = v_ring.smem.shape[2]
        seq, q_start, q_len, seq_len, context, key_lo, key_hi, full_lo, full_hi, lo, hi, n = \
            program_keys(cu_seqlens_q, seqused_k, keys, QUERIES, SPLIT_KEYS, SPLIT_KV)
        for j in range(n):
            start = lo + j * BLOCK_N
            stage = j % v8_ring.SLOTS
            staged = (j // v8_ring.SLOTS) & 1
            slot = j % v_ring.SLOTS
            free = ((j // v_ring.SLOTS) & 1) ^ 1  # a fresh barrier passes parity 1 at once
            mbarrier.wait(k8_ring.ready.index(stage), staged)
            mbarrier.wait(k_ring.empty.index(slot), free)
            convert_tile(k8_ring.smem.index(stage), k_ring.smem.index(slot), BLOCK_N,
                         BLOCK_N, HEAD_D, False)
            mbarrier.arrive(k8_ring.empty.index(stage))
            fence_async_shared()  # the writes, before the consumer's wgmma reads them
            mbarrier.arrive(k_ring.ready.index(slot))
            mbarrier.wait(v8_ring.ready.index(stage), staged)
            mbarrier.wait(v_ring.empty.index(slot), free)
            if seq_len - start < BLOCK_N:  # the sequence's last tile
                convert_tile(v8_ring.smem.index(stage), v_ring.smem.index(slot),
                             seq_len - start, BLOCK_N, HEAD_DV, True)
            else:
                convert_tile(v8_ring.smem.index(stage), v_ring.smem.index(slot), BLOCK_N,
                             BLOCK_N, HEAD_DV, False)
            mbarrier.arrive(v8_ring.empty.index(stage))
            fence_async_shared()
            mbarrier.arrive(v_ring.ready.index(slot))
