"""The Gluon prefill pass's schedule: work items, key ranges and key tiles, and its tiles and
register split per head size.

Every partition of `gluon_prefill.py`'s kernel (the producer that loads tiles, the fp8
converter, the consumers that use them) walks the same items and tiles; they must agree to
the tile, or a barrier waits forever, so the arithmetic lives here once, in two structures
the kernel entry builds and every partition takes: `Items` (which items a program takes
and what each is) and `KeyTiles` (the keys an item's queries see, in tiles). Imports nothing
but Triton (compiles for sm_90 without torch: tools/gluon_sass.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

try:
    from pagedattn.ops.triton.gluon_args import MaybeSmem, MaybeTensor, aggregate, maybe
except ImportError:  # compiled standalone, without torch (tools/gluon_sass.py)
    from gluon_args import MaybeSmem, MaybeTensor, aggregate, maybe

CONSUMER_ROWS = gl.constexpr(64)  # query rows of one consumer warpgroup (a wgmma's M)
BLOCK_M = 128  # query rows of a work item: two consumers of 64 rows (three: 192)


def config_for(head_size: int, kv_fp8: bool = False, q_fp8: bool = False,
               split_q: bool = False, consumers: int = 2) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N keys per tile, NUM_BUF ring slots, NUM_QBUF Q buffers per consumer, STAGES
    fp8 staging slots, consumer and producer registers) for the larger of D and Dv.

    Shared memory, under the 227 KB of an sm_90 block: Q NUM_QBUF x 2 x 64 x D plus the ring
    NUM_BUF x BLOCK_N x (D + Dv), 2-byte elements (head 64: 128 KB, 128: 192 KB, 256: 192
    KB); an fp8 cache adds STAGES x BLOCK_N x (D + Dv) bytes of fp8 tiles as TMA lands them
    (head 64: 160 KB, 128: 224 KB with one Q buffer, 256: 224 KB with one staging slot). An
    fp8 q (q_fp8, over an fp8 cache) has 1-byte Q buffers and no 16-bit K ring, the
    consumers reading K where it lands: STAGES is then the K ring's depth too (head 64: 128
    KB, 128: 192 KB, 256: 192 KB with two Q buffers). A 16-bit q split in two e4m3 terms
    (split_q, over an fp8 cache; heads up to 128) reads K the same way from 16-bit Q
    buffers (head 64: 144 KB; 128: 192 KB with one Q buffer, three staging slots). Two Q
    buffers let the producer load the next item's Q while the consumers still read this
    one's. Registers: 3 warpgroups at the launch's 168 share 64,512, set per partition by
    setmaxnreg. A consumer holds O (Dv / 2 a thread), S (BLOCK_N / 2) and two P tiles
    (BLOCK_N / 4 each): head 256 needs 240 (the producer warps then get 24), smaller heads
    run at 232 and give the producer (and the fp8 converter) 40, where the producer's page
    loop needs no spill (sm_90 SASS).
    consumers=3 (head 64, 16-bit or an fp8 q; `three_consumers_refusal`): 192-row items;
    4 warpgroups share 65,536 registers, consumers at 160 (O 32, S 64, one P tile 32 a
    thread: FA3's split) and the producer's (and the converter's) at 32; the Q buffers grow
    to 48 KB (144 KB in all). An fp8 q keeps two-consumer head 64's rings: 24 KB of Q
    buffers, four staging slots (64 KB), three V slots (16-bit 48 KB, or fp8 V^T 24 KB)."""
    if consumers == 3:
        why = three_consumers_refusal(head_size, kv_fp8 or q_fp8, q_fp8 and not split_q)
        if why:
            raise ValueError(why)
        return 128, 3, 2, 4 if q_fp8 else 2, 160, 32
    if consumers != 2:
        raise ValueError(f"consumers must be 2 or 3, got {consumers!r}")
    if split_q and (q_fp8 or not kv_fp8 or head_size > 128):
        raise ValueError(f"split_q needs a 16-bit q over an fp8 cache and heads up to 128 "
                         f"(q_fp8={q_fp8}, kv_fp8={kv_fp8}, head size {head_size})")
    if head_size <= 64:
        return 128, 3, 2, 4 if q_fp8 or split_q else 2, 232, 40
    if head_size <= 128:
        if q_fp8:
            return 128, 2, 2, 3, 232, 40
        if split_q:
            return 128, 2, 1, 3, 232, 40
        return 128, 2, 1 if kv_fp8 else 2, 2, 232, 40
    return 64, 2, 2 if q_fp8 else 1, 2 if q_fp8 else 1, 240, 24


def wide_config_for(head_size: int) -> tuple[int, int, int, int, int, int]:
    """`config_for`'s tuple for an fp8 q's fp8 P V (P as words) over wider key tiles
    (`SWITCHES.gluon_fp8_wide_tiles`): FA3's fp8 shapes, so each tile's fixed work (barrier
    waits, row max and sum, O's rescale, the loop's bookkeeping) spreads over more keys.
    Head 128: 256 keys (FA3 takes 224; Gluon's aranges want powers of two), head 256: 128.
    Shared memory, fp8 throughout: Q NUM_QBUF x 2 x 64 x D, the K staging ring the
    consumers read in place and the V staging ring STAGES x BLOCK_N x D each, the
    converter's V^T ring NUM_BUF x BLOCK_N x Dv. Both heads take 32 KB a K, V or V^T slot;
    two of each are 192 KB, so one Q buffer (head 128: 16 KB, 208 KB in all, with the 4 KB
    O staging; head 256: 32 KB, 224 KB, no room for the staging: `row_stores`). Registers:
    a consumer holds S (BLOCK_N / 2 fp32 a thread), O (Dv / 2) and one tile of P words
    (BLOCK_N / 8; made after the P V wait, `gluon_consumer`'s ONE_P): 128 + 64 + 32 at head
    128, 64 + 128 + 16 at head 256, at 240; the producer and converter get 24 (the
    converter then takes 16-key slabs, `gluon_convert.transpose_tile`).
    Head 64 (`SWITCHES.gluon_fp8_wide_tiles_64`): 256 keys (FA3 runs 160 over three
    consumers' 192 rows; ours are two consumers' 128), 16 KB a K, V or V^T slot, three of
    each and two Q buffers: 160 KB, and the 4 KB O staging. S 128 + O 32 + P words 32
    registers fit 232, so the producer and converter keep 40 (at 240 / 24 the converter
    spilled 8 registers in its tile loop; sm_90 SASS)."""
    if head_size == 64:
        return 256, 3, 2, 3, 232, 40
    if head_size == 128:
        return 256, 2, 1, 2, 240, 24
    if head_size == 256:
        return 128, 2, 1, 2, 240, 24
    raise ValueError(f"wide fp8 key tiles serve head sizes 64, 128 and 256, not {head_size}")


@gluon.constexpr_function
def row_stores(qk_fp8, kv_fp8, pv_fp8, head_dv, block_n):
    """Whether O leaves through the 4 KB staging of 16-byte stores (`gluon_args.Output`): it
    fits beside every ring but the 16-bit ones over an fp8 cache (a 16-bit q with K
    converted) and head 256's fp8 P V over 128-key tiles (`wide_config_for`: 224 KB)."""
    if pv_fp8 and head_dv > 128 and block_n > 64:
        return False
    return qk_fp8 or not kv_fp8


def three_consumers_refusal(head_size: int, fp8: bool, q_fp8: bool = False) -> str:
    """Why the three-consumer form (192-row items) cannot serve a launch ("" = it can): its
    consumers run at 160 registers (three warpgroups of them and the producer's at 32 share
    an SM's 64K), which hold head 64's O, S and one P tile and no more. fp8: an fp8 cache;
    q_fp8: an fp8 q over it, whose consumers read Q and K as they land (FA3's fp8 head-64
    shape, 192 rows: `SWITCHES.gluon_fp8_three_consumers` decides whether it runs). A
    16-bit q over an fp8 cache is not built for it: q's split has no registers there and
    its converted K ring is sized for two."""
    if head_size > 64:
        return (f"three consumers serve head sizes up to 64 (160 registers a thread hold "
                f"their O, S and P), not {head_size}")
    if fp8 and not q_fp8:
        return ("three consumers serve a 16-bit q over 16-bit K/V or an fp8 q over an fp8 "
                "cache, not a 16-bit q over an fp8 cache")
    return ""


@gluon.jit
def find_seq(cu_seqlens_q, slot, batch, BLOCK_M: gl.constexpr):
    """The request whose block slots hold `slot`: request s owns slots from
    cu_seqlens_q[s] // BLOCK_M + s on (the Hopper `tl` pass's grid). Counted, one vector load
    per 32 x warps requests, not a chain of dependent loads."""
    SPAN: gl.constexpr = 32 * gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    count = 0
    for base in range(0, batch, SPAN):
        s = base + gl.arange(0, SPAN, layout=layout)
        first = gl.load(cu_seqlens_q + s, mask=s < batch, other=0) // BLOCK_M + s
        count += gl.sum(((first <= slot) & (s < batch)).to(gl.int32), axis=0)
    return count - 1


@gluon.jit
def work_item(w, num_items, cu_seqlens_q, batch, skip_q_len, NUM_HEADS: gl.constexpr,
              BLOCK_M: gl.constexpr, LPT_ACROSS: gl.constexpr):
    """Item w -> (valid, seq, head, q_start, q_len, q_block). Heads vary fastest; block r of a
    request is its r-th heaviest (q_block = blocks - 1 - r). LPT_ACROSS 1: slots are
    (r, request), batch x max blocks of them, block r of every request before block r + 1
    of any; G >= 2: the same within groups of G consecutive requests (G divides the batch),
    one group after the other, so the requests in flight share L2 with fewer others; 0: the
    `tl` pass's compact slots. Requests of at most skip_q_len queries belong to another
    pass."""
    head = w % NUM_HEADS
    slot = w // NUM_HEADS
    if LPT_ACROSS == 1:
        seq = slot % batch
        q_start = gl.load(cu_seqlens_q + seq)
        r = slot // batch
    elif LPT_ACROSS > 1:
        span = num_items // (NUM_HEADS * batch) * LPT_ACROSS  # a group's slots
        group = slot // span
        within = slot - group * span
        seq = (group * LPT_ACROSS + within % LPT_ACROSS) % batch  # in bounds past the end
        q_start = gl.load(cu_seqlens_q + seq)
        r = within // LPT_ACROSS
    else:
        seq = find_seq(cu_seqlens_q, slot, batch, BLOCK_M)
        q_start = gl.load(cu_seqlens_q + seq)
        r = slot - (q_start // BLOCK_M + seq)
    q_len = gl.load(cu_seqlens_q + seq + 1) - q_start
    n_blocks = gl.cdiv(q_len, BLOCK_M)
    valid = (q_len > skip_q_len) & (r < n_blocks)
    return valid, seq, head, q_start, q_len, n_blocks - 1 - r


# --- which items a program takes ---------------------------------------------------------------
# Static (DYNAMIC off): round k of program p is item k * grid + p, then k * grid + grid - 1 -
# p (rounds alternate direction: with items heaviest first, plain round robin gives program 0
# the heaviest item of every round; 1 x 8192, 132 programs: 536 tiles on the busiest, 504 on
# average; alternating: 505). Dynamic: the producer takes the next item from a global counter
# as it finishes loading one (`Items.take`), so a program that drew light items takes more,
# whatever the order; the order is then free to keep the items in flight on few requests'
# keys and values (L2). The producer hands each id to the other partitions through ID_SLOTS
# one-int slots of shared memory (`Items.publish`, `Items.next`): id n of a program is the
# n-th item it runs, and an id >= num_items ends every partition's loop.
ID_SLOTS: gl.constexpr = gl.constexpr(4)


@aggregate
class Items:
    """The work items of a launch: item w = (slot, head) over the batch of cu_seqlens_q
    [batch + 1] and seqused_k [batch] (`work_item`), num_items of them on `grid` programs,
    requests of at most skip_q_len queries skipped; GROUP query heads per KV head. DYNAMIC:
    programs take items from the counter queue (int32 [2]) and the producer publishes them
    in the ID_SLOTS slots `ids` (int32 [ID_SLOTS, 32]; id_ready / id_empty their barriers);
    else the static order's (queue and the slots None)."""

    cu_seqlens_q: gl.tensor
    seqused_k: gl.tensor
    batch: gl.tensor
    num_items: gl.tensor
    grid: gl.tensor
    skip_q_len: gl.tensor
    queue: MaybeTensor
    ids: MaybeSmem
    id_ready: MaybeSmem
    id_empty: MaybeSmem
    NUM_HEADS: gl.constexpr
    GROUP: gl.constexpr
    BLOCK_M: gl.constexpr
    LPT_ACROSS: gl.constexpr
    DYNAMIC: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, cu_seqlens_q, seqused_k, batch, num_items, grid, skip_q_len, queue,
                 ids, id_ready, id_empty, NUM_HEADS, GROUP, BLOCK_M, LPT_ACROSS, DYNAMIC):
        self.cu_seqlens_q = cu_seqlens_q
        self.seqused_k = seqused_k
        self.batch = batch
        self.num_items = num_items
        self.grid = grid
        self.skip_q_len = skip_q_len
        self.queue = maybe(queue)
        self.ids = maybe(ids)
        self.id_ready = maybe(id_ready)
        self.id_empty = maybe(id_empty)
        self.NUM_HEADS = gl.constexpr(NUM_HEADS)
        self.GROUP = gl.constexpr(GROUP)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.LPT_ACROSS = gl.constexpr(LPT_ACROSS)
        self.DYNAMIC = gl.constexpr(DYNAMIC)

    @gluon.jit
    def info(self, w):
        """Item w: `work_item` plus the request's key count, (valid, seq, head, q_start,
        q_len, q_block, seq_len). Every load stays in bounds for any w >= 0 (seq < batch),
        so a partition may ask for the item after its last one ahead of time."""
        valid, seq, head, q_start, q_len, q_block = work_item(
            w, self.num_items, self.cu_seqlens_q, self.batch, self.skip_q_len, self.NUM_HEADS,
            self.BLOCK_M, self.LPT_ACROSS)
        return (valid & (w < self.num_items), seq, head, q_start, q_len, q_block,
                gl.load(self.seqused_k + seq))

    @gluon.jit
    def round(self, k):
        """The static order's item of round k of this program."""
        pid = gl.program_id(0)
        return k * self.grid + gl.where(k % 2 == 0, pid, self.grid - 1 - pid)

    @gluon.jit
    def take(self):
        """The next item of the launch's counter queue[0] (ids are only numbers: relaxed)."""
        return gl.atomic_add(self.queue, 1, sem="relaxed")

    @gluon.jit
    def finish(self):
        """The producer's last act: count this program done (queue[1]); the last program
        resets both counters for the plan's next launch (every program has taken its last
        id by then: the acquire-release count orders their takes before it)."""
        if gl.atomic_add(self.queue + 1, 1) == gl.num_programs(0) - 1:
            gl.store(self.queue, 0)
            gl.store(self.queue + 1, 0)

    @gluon.jit
    def publish(self, n, w):
        """Id n := w, once the slot's readers released id n - ID_SLOTS (one warp: the
        producer's). The warp's barrier orders every lane's store before the arrive's
        release."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        slot = n % ID_SLOTS
        mbarrier.wait(self.id_empty.index(slot), ((n // ID_SLOTS) & 1) ^ 1)
        self.ids.index(slot).store(gl.full([32], w, gl.int32, layout=layout))
        gl.thread_barrier()
        mbarrier.arrive(self.id_ready.index(slot))

    @gluon.jit
    def next(self, n):
        """A reader's item n: read from the producer's slots, or the static order's. A slot
        is released once every warp of the partition has read it (the barrier: the release
        arrives from one thread)."""
        if self.DYNAMIC:
            layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
            slot = n % ID_SLOTS
            mbarrier.wait(self.id_ready.index(slot), (n // ID_SLOTS) & 1)
            if self.BLOCK_M > 128:
                # every thread reads the slot's first int (a uniform address): a thread's
                # own int's address is one more register kept across the item, which three
                # consumers' 160 registers do not hold
                w = gl.max(self.ids.index(slot).slice(0, 1).load(layout), axis=0)
            else:
                w = gl.max(self.ids.index(slot).load(layout), axis=0)
            gl.thread_barrier()
            mbarrier.arrive(self.id_empty.index(slot))
        else:
            w = self.round(n)
        return w


@aggregate
class KeyTiles:
    """The keys an item's queries see, in tiles of BLOCK_N: a left window of `left` keys
    (WINDOW_LEFT) and a right one of `right` (WINDOW_RIGHT; causality is right = 0), over
    query blocks of BLOCK_M. SPLIT_AT_CONTEXT: keys in two phases, A [0, context) anchored
    at 0 and B [context, seq_len) anchored at context (dense rows beside the cache), else
    one."""

    left: gl.tensor
    right: gl.tensor
    WINDOW_LEFT: gl.constexpr
    WINDOW_RIGHT: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    SPLIT_AT_CONTEXT: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, left, right, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N,
                 SPLIT_AT_CONTEXT):
        self.left = left
        self.right = right
        self.WINDOW_LEFT = gl.constexpr(WINDOW_LEFT)
        self.WINDOW_RIGHT = gl.constexpr(WINDOW_RIGHT)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.SPLIT_AT_CONTEXT = gl.constexpr(SPLIT_AT_CONTEXT)

    @gluon.jit
    def ranges(self, min_pos, max_pos, seq_len):
        """For queries at positions [min_pos, max_pos]: the keys some of them see, [lo, hi),
        and the keys all of them see, [full_lo, full_hi)."""
        lo = 0
        full_lo = 0
        hi = seq_len
        full_hi = seq_len
        if self.WINDOW_LEFT:
            lo = gl.maximum(min_pos - self.left, 0)
            full_lo = gl.maximum(max_pos - self.left, 0)
        if self.WINDOW_RIGHT:
            hi = gl.maximum(gl.minimum(seq_len, max_pos + self.right + 1), 0)
            full_hi = gl.maximum(gl.minimum(seq_len, min_pos + self.right + 1), 0)
        return lo, hi, full_lo, full_hi

    @gluon.jit
    def of_block(self, q_block, q_len, seq_len):
        """The key tiles of query block `q_block` of a request (the keys some of its queries
        see), as every partition walks them: (a_end, first tile of phase A, tiles of A,
        first tile of B, tiles of B)."""
        context = seq_len - q_len
        key_lo, key_hi, full_lo, full_hi = self.ranges(
            context + q_block * self.BLOCK_M,
            context + gl.minimum((q_block + 1) * self.BLOCK_M, q_len) - 1, seq_len)
        return phase_tiles(key_lo, key_hi, context, seq_len, self.BLOCK_N,
                           self.SPLIT_AT_CONTEXT)

    @gluon.jit
    def at(self, j, a_end, t_a, n_a, t_b, seq_len):
        """Tile j of an item: (first key, keys from `bound` on are not its phase's, in
        phase A)."""
        in_a = j < n_a
        start = gl.where(in_a, t_a + j * self.BLOCK_N, t_b + (j - n_a) * self.BLOCK_N)
        bound = gl.where(in_a, a_end, seq_len)
        return start, bound, in_a


@gluon.jit
def phase_tiles(key_lo, key_hi, context, seq_len, BLOCK_N: gl.constexpr,
                SPLIT_AT_CONTEXT: gl.constexpr):
    """Tiles of keys [key_lo, key_hi) in two phases: A [0, a_end) anchored at 0, B
    [a_end, seq_len) anchored at a_end (a_end = context, or seq_len: one phase).
    Returns (a_end, first tile of A, tiles of A, first tile of B, tiles of B)."""
    if SPLIT_AT_CONTEXT:
        a_end = gl.maximum(context, 0)
    else:
        a_end = seq_len
    a_hi = gl.minimum(a_end, key_hi)
    t_a = key_lo // BLOCK_N * BLOCK_N
    n_a = gl.where(key_lo < a_hi, gl.cdiv(a_hi - t_a, BLOCK_N), 0)
    b_lo = gl.maximum(key_lo, a_end)
    t_b = a_end + (b_lo - a_end) // BLOCK_N * BLOCK_N
    n_b = gl.where(b_lo < key_hi, gl.cdiv(key_hi - t_b, BLOCK_N), 0)
    return a_end, t_a, n_a, t_b, n_b
