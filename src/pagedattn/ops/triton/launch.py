"""Launch heuristics for the attention kernel: tile shapes and the split-KV count, and
`SWITCHES`, every pass's switches (batch-invariant mode's configs: invariant_config.py).

Everything here is a function of Python ints the caller already holds (shapes, max_seqlen_q,
max_seqlen_k, the SM count): choosing a schedule never reads a device tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from pagedattn import envs
from pagedattn.ops.triton.tile_math import decode_query_count

# A split must stream at least this many keys, or the second (reduce) pass and the extra
# partial-state traffic cost more than the parallelism gains.
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 64
# The decode pass's programs one SM holds at once (its head-128 tiles, bf16 and fp8 alike:
# shared memory and registers each allow three; ncu on the H200, docs/dev/KERNEL_NOTES.md v21),
# the share of its SM's bandwidth one program draws alone (bf16: 256 programs read at the
# copy limit, so two an SM saturate; an fp8 program converts every element and takes three),
# and the keys a program's pipeline fill costs as if it streamed them (two 128-key tiles).
DECODE_PROGRAMS_PER_SM = 3
DECODE_DRAW = {1: 1 / 3, 2: 0.75, 4: 0.75}
DECODE_FILL_KEYS = 256
# The split-count rules `SWITCHES.blocksparse_decode_splits` may name (blocksparse_decode.py).
BLOCKSPARSE_DECODE_SPLIT_RULES = ("waves", "short fill")
# A prefill batch whose longest key range is this many times its longest query is mostly
# cached context: the portable pass serves it (see attention_plan.plan_attention).
CONTEXT_HEAVY = 4


@dataclass
class Switches:
    """Kernel features whose defaults were chosen by measurement (docs/dev/KERNEL_NOTES.md);
    `benchmarks/bench_kernels.py --sweep` flips them to time both sides."""
    fp16_dot_for_fp8_kv: bool = True
    fp8_v_in_regs: bool = True
    # The Hopper prefill pass (attention_hopper.py): None on sm_90 only, True also elsewhere
    # (the interpreter: CPU tests), False never. `hopper_tiles` (block_m, block_n, warps,
    # stages), or a dict of them by head size, overrides its tiles for sweeps;
    # `hopper_pack_gqa` packs a KV head's query heads into one program's rows.
    hopper_prefill: Optional[bool] = None
    hopper_tiles: Optional[tuple] = None
    hopper_pack_gqa: Optional[bool] = None
    # The warp-specialised Gluon prefill pass (attention_gluon.py): None where it can serve
    # (sm_90 with Triton 3.6's Gluon; it then takes the place of the Hopper `tl` pass), False
    # never (benchmarks time the `tl` passes beside it).
    gluon_prefill: Optional[bool] = None
    # The warp-specialised Gluon decode pass (gluon_decode_launch.py) in place of the `tl`
    # decode pass where it serves (sm_90 with Triton 3.6's Gluon, a paged cache, a 16-bit q
    # over its dtype or an e4m3 q over e4m3, no ALiBi; the split count and the reduce stay
    # the `tl` pass's): None where it measured faster (`gluon_decode_launch.pays`: an e4m3 q
    # over an e4m3 cache, splits of 1,024+ keys; H200 1.02-1.17x the `tl` pass there, 0.87x
    # on B1 L32k's 668-key splits, bf16 0.97-1.02x: KERNEL_NOTES v29), True wherever it
    # serves, False never.
    gluon_decode: Optional[bool] = None
    # Its programs a SM: 1 (tiles that fill shared memory), 2 (half-size rings, maxnreg 128;
    # heads up to 128, else 1), or None: 2 (H200, fp8: 1.02-1.17x one a SM on four of
    # issue 41's five rows, 0.93x on B8 L128k; KERNEL_NOTES v29).
    gluon_decode_per_sm: Optional[int] = None
    # Its persistent form (gluon_decode_persistent.py): True runs min(units, programs a SM x
    # SMs) programs that each walk work units (request, KV head, split), building the
    # descriptors once and keeping the K / V rings filling across units, and a step of
    # decodes alone takes that form's split count (`gluon_decode_units.persistent_splits`:
    # units that fill the programs evenly, 1,024+ keys a split) in place of the `tl` pass's;
    # False the grid (request, KV head, split). H200, two programs a SM
    # (tools/ab_gluon_decode.py; KERNEL_NOTES v33): fp8 1.16-1.29x the `tl` pass on issue
    # 41's five rows (the grid form 0.87-1.20x), 3,711 GB/s at B64 L16k; bf16 1.00-1.05x.
    gluon_decode_persistent: bool = True
    # Its P V over an e4m3 cache (both forms): True runs it as an fp8 wgmma, P = 2^8 2^(s - m)
    # rounded to e4m3 and carried as words of four keys, over V^T tiles the converter makes
    # by byte permutes over the words ldmatrix delivers (the prefill's fp8 P V, its numerics:
    # DESIGN.md), instead of converting each V tile e4m3 -> fp16 for an fp16 P V; False the
    # fp16 P V. H200 (tools/ab_gluon_decode.py --timer unrolled, the peers table's timer;
    # KERNEL_NOTES v44): B64 L16k 3,439 -> 3,823 GB/s of fp8 bytes, B8 L128k 3,433 -> 3,835
    # (1.11-1.12x), max error 1.3e-3 (1.3e-4 with the fp16 P V; P's e4m3 rounding): on.
    gluon_decode_fp8_pv: bool = True
    # Its O rescale (both forms, every cache): -1 every tile; 0 only in the warps one of whose
    # rows moved its max (`gluon_softmax.lazy_rescale`: a warp-uniform branch; exact); 1-8
    # also keeps a row's max until a tile's exceeds it by more than that many powers of 2
    # (FA4's rule, the prefill's `gluon_max_slack`; exact after the division; an fp8 P's
    # shift becomes 8 minus it). The 64-row tile's padding rows (a zero q: scores 0) never
    # move theirs after the first tile, so three of a GQA-4 decode's four warps skip it
    # (sm_90 SASS: 66 of a 64-key tile's ~300 instructions a consumer thread; KERNEL_NOTES
    # v44). 0: H200 (tools/ab_gluon_decode.py --timer unrolled, 2026-12-02), the fp8 P V's
    # B64 L16k 3,774 -> 3,996 GB/s and B8 L128k 3,741 -> 4,055; bf16 1.00-1.01x, same bits.
    gluon_decode_max_slack: int = 0
    # Its longest-first order across requests: None lets `attention_gluon.lpt_group` pick,
    # 1 forces block r of every request before block r + 1 of any, G >= 2 groups of G
    # requests (G must divide the batch; a batch it does not divide takes 1), 0 one request
    # after the other (the compact slots, heaviest block of each request first).
    gluon_lpt_group: Optional[int] = None
    # Its item hand-out: None lets `attention_gluon.item_order` pick, True takes items from
    # a counter as programs free up, False the static round robin.
    gluon_dynamic: Optional[bool] = None
    # A 16-bit q over an fp8 cache (heads up to 128): Q K^T as two fp8 products of q's
    # two e4m3 terms over K where it lands, instead of converting K (KERNEL_NOTES v19).
    gluon_split_q: bool = True
    # An fp8 q over an fp8 cache: P V as an fp8 wgmma too (P in e4m3, V^T transposed by the
    # converter) instead of P V in fp16 over converted V tiles. None: where the H200
    # measured it faster (`attention_gluon.fp8_pv`: heads above 64, with P as words and V^T
    # by PRMT: 1.12-1.15x the fp16 P V on issue 40's head-128 fp8 rows, 1.05x at head 256
    # with V^T over the ldmatrix words, errors equal to FA3 fp8's; head 64 0.94x; KERNEL_NOTES
    # v34, v37); True every fp8 q, False never (v23 alone: 0.71-0.80x).
    gluon_fp8_pv: Optional[bool] = None
    # Its O rescale: None or -1 every tile; 0 only where some row of the consumer's
    # warpgroup moved its max (a uniform branch; exact); 1-8 also keeps a row's max until a
    # tile's exceeds it by more than that many powers of 2 (FA4's rule, exact after the
    # final division: fp8 P's shift becomes 8 minus it, so P stays <= 256; KERNEL_NOTES
    # v34). H200: 4 with an fp8 P V 1.03x faster, but its max error 1.31x FA3 fp8's at
    # 1 x 8192 (e4m3's subnormal weights), past issue 40's 1.25x; 8 with a 16-bit P V
    # 1.01-1.05x on the fp8-q rows, not measured over 16-bit caches yet. Off.
    gluon_max_slack: Optional[int] = None
    # With an fp8 P V: the converter pairs V's bytes for V^T by two PRMT over packed words
    # (`gluon_convert.pair_bytes`) instead of masks and shifts on each int16. None or True:
    # on (H200, with P as words: 1.16-1.22x at head 128, 0.95x at head 64; v34); False off.
    gluon_fp8_v_prmt: Optional[bool] = None
    # Where the converter pairs V's bytes by PRMT: over the words ldmatrix delivered, one
    # PRMT a word written (`gluon_convert.word_bytes`), instead of over int16 halves that
    # Triton packs into words again (sm_90 SASS, the converter's unmasked V tile: head 64
    # 130 -> 98 instructions, 128 and 256 likewise 64 and 128 fewer PRMT). H200: head 256
    # 754 TFLOP/s against 685 over int16 halves (and 719 with the fp16 P V), head 128
    # 1.00-1.01x, errors unchanged (KERNEL_NOTES v37): on.
    gluon_fp8_v_words: bool = True
    # With an fp8 P V: P crosses the consumers' tile loop as 32-bit words of four e4m3
    # keys (`gluon_operands.p_words`) instead of 64 8-bit values taken apart and packed
    # again around each wgmma (sm_90 SASS at head 128: 660 -> 475 instructions a tile and
    # thread; H200 1.14-1.32x; KERNEL_NOTES v34; head 256, 64-key tiles: 476 -> 386, one
    # P tile live, since made before the P V wait ptxas serialised every wgmma). None or
    # True: on; False off.
    gluon_fp8_p_words: Optional[bool] = None
    # With an fp8 P V and P as words (heads 128 and 256, no ALiBi or soft cap): FA3's wider
    # key tiles, head 128 256 keys and head 256 128 (`gluon_schedule.wide_config_for`: one Q
    # buffer, masks by lane, head 128's P V waited for before its S is issued), so each
    # tile's fixed work spreads over more keys (sm_90 SASS: consumer instructions a key 3.7
    # -> 3.1 at head 128, 6.0 -> 4.3 at head 256; KERNEL_NOTES v38). True or False forces
    # them; None: where the longest request reads `attention_gluon.WIDE_MIN_KEYS` keys or
    # more (H200, tools/ab_fp8_pv.py: 1.03-1.07x there at heads 128 and 256, 0.78-0.99x on
    # shorter requests, whose causal diagonal tiles mask a larger share of their keys).
    gluon_fp8_wide_tiles: Optional[bool] = None
    # And at head 64 by the same rule (`gluon_fp8_wide_tiles`), where a launch runs the fp8
    # P V (`gluon_fp8_pv` True) on two consumers: 256-key tiles (`wide_config_for`; FA3 fp8
    # takes 160 keys over three consumers). sm_90 SASS: consumer 751 instructions a 256-key
    # tile (2.9 a key against 3.4 on 128-key tiles, FA3's 3.0), no spill (KERNEL_NOTES v55).
    # Not measured yet: off.
    gluon_fp8_wide_tiles_64: bool = False
    # With an fp8 P V at Dv >= 128: the converter transposes V in slabs of 128 columns
    # instead of 64 (`gluon_convert.transpose_tile`), so its two warps wait at half the
    # barriers a tile (Triton puts one before every store to V^T after the first: head
    # 256's 128-key tile 34 -> 18, its 64-key tile 18 -> 10; sm_90 SASS, KERNEL_NOTES v46).
    # And the V^T ring's slots on the fp8 P V's default tiles (`gluon_fp8_vt_slots`: None
    # keeps `gluon_schedule.config_for`'s 2; 3 or 4; the wide tiles have no room): a tile
    # must be transposed between the later consumer's release of the slot two tiles back
    # and the earlier one's P V of it, half a tile's time with two slots. H200
    # (tools/ab_fp8_pv.py, 2026-12-02): 128-column slabs 1.03x at head 128 (1 x 8192, 2048
    # after 30720 cached) and 1.09-1.11x at head 256 (1 x 8192, 8 x 2048): on; four slots
    # 1.00-1.04x alone and nothing beside the wide slabs: None.
    gluon_fp8_vt_wide_slabs: bool = True
    gluon_fp8_vt_slots: Optional[int] = None
    # With those 128-column slabs at Dv 256: each loaded one slab ahead, before the barrier
    # and store of the one before it, so the ldmatrix latency of every one of a tile's 16
    # barrier steps runs under the previous step instead of inside the chain (sm_90 SASS:
    # converter 271 -> 276 instructions a wide tile, its 8 local loads unchanged; KERNEL_NOTES
    # v52). H200, fp8 q over e4m3, one process beside FA3 fp8 (tools/ab_fp8_pv.py, 2026-12-02):
    # head 256 1 x 8192 856 -> 940 TFLOP/s, 8 x 2048 690 -> 698, head 128 rows (which it
    # leaves alone) within 1%; errors unchanged (KERNEL_NOTES v54).
    gluon_fp8_vt_prefetch: bool = True
    # With an fp8 P V and P as words above Dv 128 (head 256): the consumers rescale O by a
    # tile's alpha once the previous tile's P V is waited for, FA3's fp8 order, instead of
    # between their S and P V issues, so the ping-pong turn holds the two issues alone
    # (sm_90 SASS, head 256's wide tile: 190 -> 62 instructions from the turn's wait to its
    # hand-over, FA3's 62; KERNEL_NOTES v52). Not measured yet: off.
    gluon_fp8_rescale_after_pv: bool = False
    # Its consumer warpgroups of 64 query rows: 2 (128-row work items), 3 (192-row items,
    # FA3's head-64 shape: three consumers at 160 registers share each K/V tile), or None:
    # 3 where requests average 8,192+ causal queries (`attention_gluon.long_prompts`;
    # H200: 1.08-1.11x there, 0.79-1.01x on shorter ones; KERNEL_NOTES v26), else 2. Three
    # serve a 16-bit q over 16-bit K/V at head sizes up to 64, and an fp8 q over an fp8
    # cache there with `gluon_fp8_three_consumers` (`gluon_schedule.three_consumers_refusal`);
    # other launches keep two. racecheck and
    # synccheck ran the three-consumer forms clean (docs/dev/RELIABILITY.md, 2026-12-01).
    gluon_consumers: Optional[int] = None
    # An fp8 q over an fp8 cache at head 64 may take those three consumers too (by the same
    # rule: `gluon_consumers`), FA3 fp8's head-64 shape (192 rows; its tiles 160 keys, ours
    # 128), with the P V `gluon_fp8_pv` gives it (None: 16-bit at head 64). sm_90 SASS:
    # no spill in the consumers' or the converter's tile loop (16-bit P V 437-469
    # instructions a 128-key tile, fp8 P V 440; KERNEL_NOTES v55). Not measured yet: off.
    gluon_fp8_three_consumers: bool = False
    # Block-sparse decode (blocksparse_decode.py): `blocksparse_decode_tiles` (BLOCK_N,
    # warps, stages) or (BLOCK_N, warps, stages, maxnreg) replaces its default tiles (None:
    # `blocksparse_schedule.default_tiles`); `blocksparse_decode_splits` "waves" (B64 L16k
    # 1.31-1.41x -> 1.08-1.34x of dense x read, KERNEL_NOTES v29) takes the dense decode's
    # wave-filling split count (`decode_splits`, with the tiles' programs an SM) over the
    # keys a program reads where its programs fill the SMs unsplit (None: `auto_splits`,
    # which never splits those); "short fill" (the default: `SHORT_FILL_KEYS`) counts a
    # program's fill as one tile, which splits homo-head programs of few tiles into whole
    # waves (H200, B64 L16k homo head 1.33 -> 1.18x, the other rows unchanged; KERNEL_NOTES
    # v31); an int forces that split count (A/B runs).
    blocksparse_decode_tiles: Optional[tuple] = None
    blocksparse_decode_splits: Optional[object] = "short fill"
    # Its K tiles gathered page by page as whole 128-byte lines (`_key_lines`) instead of
    # the [D, N] load whose warp requests take one sector from each of 16 lines: None or
    # True over every cache (H200, bf16: 1.61-2.18x of dense x blocks read -> 1.08-1.34x
    # with "waves", KERNEL_NOTES v29; e4m3: 1.59-1.75x -> 1.25-1.37x, v31), False never.
    blocksparse_decode_key_lines: Optional[bool] = None
    # Its K and V tiles from one block-table entry a page, V gathered as whole lines like
    # K (`blocksparse_decode._value_lines`: a page's V is one 2 KB run at fp8, where the
    # [N, D] load takes 64 bytes of each of 8 lines a warp request), instead of an entry a
    # key that the key loop widens to 64 bits, reduces by shuffles to one a page and moves
    # through shared memory between layouts (sm_90 SASS, e4m3, 128-key tiles: 2 barriers
    # and ~40 instructions a trip). None or True: over every cache (H200, e4m3 with its
    # 128-key tiles capped at 168 registers, tools/ab_blocksparse_decode.py --kv e4m3,
    # 2026-12-02: 1.07-1.39x of dense x read -> 0.83-1.17x, KERNEL_NOTES v49; bf16 with V
    # as lines too: 1.06-1.17x -> 1.00-1.09x, v54); False never.
    blocksparse_decode_page_lines: Optional[bool] = None
    # Its row sums kept per key slot through the key loop and summed once after it
    # (`tile_math.slot_softmax_step`) instead of a sum across the warps a tile (a shared
    # memory round trip and three barriers a trip; sm_90 SASS, bf16 with page lines: 64-key
    # tiles 9 -> 6 barriers, 3.94-4.83 -> 3.50-4.36 instructions a key; 128-key tiles at 168
    # registers 10 -> 7, 2.91-4.48 -> 2.70-4.35, no spills; KERNEL_NOTES v51). False: not
    # yet measured (tools/ab_blocksparse_decode.py); over e4m3 at 168 registers its 16 more
    # registers a thread spill.
    blocksparse_decode_slot_sums: bool = False
    # Under page lines, V as whole lines from the pages too (`_value_lines`), or by its
    # [N, D] load from an entry a key (K still from the pages). None or True: lines over
    # every cache (`blocksparse_schedule.value_lines`; H200, bf16 in its four-an-SM 64-key
    # tiles, page lines alone 1.06-1.17x of dense x read, with V as lines 1.00-1.09x;
    # KERNEL_NOTES v54), False by key.
    blocksparse_decode_value_lines: Optional[bool] = None
    # Batch-invariant mode (invariant_plan.py; the tiles, splits and arithmetic these
    # switches give it are invariant_config.py's, which defines the functions and constants
    # the comments below name). Its results depend on these (not on the batch): keys per
    # fixed split (a multiple of the tiles' block_n; an int, or a dict of them by largest
    # head size), and the one tile config of every row, (block_m, block_n, warps, stages) or
    # a dict of them by largest head size (None: `invariant_config`'s).
    # fp_fusion: compile its kernels with fused multiply-adds (faster; then a masked and an
    # unmasked tile's code, and the in-program and reduce folds, may round differently: the
    # GPU tests and tools/sweep_invariant.py say whether they do).
    invariant_split_keys: object = 1024
    invariant_tiles: Optional[object] = None
    invariant_fp_fusion: bool = False
    # Its schedule (never its bits): a program per split, then a fold launch, where the
    # batch's programs (query blocks x KV heads) number fewer than this many times the SMs;
    # above it each program folds its rows' splits itself. A number, or a dict of them by
    # largest head size (1.0 for a head size it does not name); None: INVARIANT_SPLIT_BELOW.
    # 1.0: split a batch that cannot fill the GPU once; more splits batches of a few waves
    # whose long contexts would leave the last wave's SMs idle.
    invariant_split_below: object = None
    # A step whose queries all fit its rows (decodes alone) may run its own tiles,
    # (block_m, warps, stages) or a dict of them by largest head size, with the one
    # config's block_n and loop form, only where a row keeps its bits: both configs wgmma
    # warpgroups stacked along M, 16 rows a warp (`invariant_tiles_agree`), so every row
    # meets one instruction and one order of adds; e.g. 128-row, 8-warp `invariant_tiles`
    # beside 64-row, 4-warp decode tiles. (16-row tiles would run mma.sync, which rounds
    # fp16 sums apart from wgmma: KERNEL_NOTES v25.) None: `INVARIANT_DECODE_TILES` beside
    # `invariant_config`'s own tiles (`invariant_tiles` None too), else the one config.
    invariant_decode_tiles: Optional[object] = None
    # The batch-invariant matmul's tiles (block_m, block_n, block_k, warps, stages) for every
    # shape (None: `matmul.matmul_tiles`, by the weight's shape).
    invariant_matmul_tiles: Optional[tuple] = None
    # Batch-invariant prompts on the Gluon pass's invariant consumer (`gluon_invariant.py`,
    # `invariant_plan.plan_invariant_gluon`) where it serves: the `tl` pass's operations per
    # row, so the same bits (H200: bit-equal in the GPU tests and tools/sweep_invariant.py's
    # check), decodes staying on the `tl` pass; prompts 1.55-1.61x the default mode's time
    # instead of 1.85-2.36x (KERNEL_NOTES v29). False: every row on the `tl` pass.
    invariant_gluon: bool = True
    # Its consumer without work that cannot change a bit (`gluon_invariant.py`'s LEAN: an
    # item's first fold as the select it reduces to, masks by one compare a key, O stored
    # by 16-byte stores): the same bits, prompts 0.81-0.97x the time without it (H200,
    # tools/sweep_invariant.py; KERNEL_NOTES v32).
    invariant_gluon_lean: bool = True
    # Its arithmetic, every pass alike (so a row's bits change with it, as with the split
    # keys): the score scale in the exponent, p = 2^fma(s, scale, -m) where neither soft cap
    # nor ALiBi is given (`tile_math.exact_scaled_step`: one instruction a score fewer, one
    # rounding fewer): prompts 0.93-0.97x the time without it, decodes unchanged (H200,
    # tools/sweep_invariant.py, the guarantee checked; KERNEL_NOTES v32).
    invariant_scale_in_exp: bool = True
    # Batch-invariant decodes on the Gluon decode pass's layout (`gluon_decode_invariant.py`,
    # `invariant_plan.plan_invariant_decode`) where it serves: the `tl` pass's operations per
    # row (a 64-row wgmma tile of a request's GQA-packed decode rows, 64-key tiles from key
    # 0, the fixed splits folded in order), so the same bits (H200: bit-equal in
    # tests/test_invariant_gluon_decode.py and tools/sweep_invariant.py's check); decodes
    # 1.00-1.07x the default mode's time from batch 32 instead of 1.33x, 1.77x at batch 1
    # instead of 2.45x (KERNEL_NOTES v30). False: decodes on the `tl` pass.
    invariant_gluon_decode: bool = True
    # Batch-invariant layers of head size 256 on the Gluon kernels alone, prompts on
    # `gluon_invariant.py` and decodes on `gluon_decode_invariant.py` with one arithmetic a
    # row (a 64-row wgmma tile, 64-key tiles from key 0, the fixed splits' states kept in
    # float32 memory and folded in order: O and a second state do not fit the registers at
    # head 256), so their rows agree in any batch but are not the `tl` pass's, whose head-256
    # tiles split a row over two warps: such a layer never runs the `tl` pass
    # (`invariant_plan.gluon_256_refusal` decides per layer, from its static facts; the
    # `tl` pass serves the layers it refuses). Needs invariant_gluon and
    # invariant_gluon_decode too. H200 (tools/sweep_invariant.py, its guarantee check
    # passed): 8 x 2048 head 256 1.54x the default mode (the `tl` pass 3.55x), 32 x 8192
    # decodes 1.54x (1.62x); its 7 GPU tests pass (2026-12-02, after the compile fix of
    # KERNEL_NOTES v37: the layer over an e4m3 cache with sinks and a window had hung): on.
    invariant_gluon_256: bool = True
    # Batch-invariant layers of largest head size 64 or 128 in 128-key tiles for every pass
    # together (`INVARIANT_TILES_128`: the `tl` passes' one config and decode tiles, the
    # Gluon prompt consumer and the Gluon decode kernel, whose unsplit programs then keep
    # their fold state in float32 memory, `gluon_decode_invariant.py`'s FOLD_MEM), so a
    # request's rows keep one arithmetic in any batch; the bits differ from 64-key tiles'
    # (another order of adds). An `invariant_tiles` naming other key tiles for such a head
    # size is refused. True: heads 64 and 128; False: neither; None: head 64 alone. H200
    # (tools/sweep_invariant.py, 2026-12-02, the guarantee checked): head 64 decodes 1.06x
    # the default mode's time instead of 1.17x, prompts 1.24x instead of 1.38x; head 128
    # mixed (decodes 1.05-1.16x instead of 1.03-1.24x, prompts 1.35-1.53x instead of
    # 1.37-1.44x), so it keeps 64-key tiles.
    invariant_tiles_128: Optional[bool] = None
    # Batch-invariant split programs that fold their own request's splits (schedule only,
    # never the bits): each split program writes its partial state, then takes a ticket from
    # a counter per (query block, KV head) with acquire-release order at GPU scope; the one
    # that draws the last ticket folds every split in the order 0..n-1 with `fold_split`, as
    # `fold_splits_kernel` does, stores the rows and sets the counter back to 0 (CUDA-graph
    # replay safe; the plan owns the counters, zeroed once when made). It saves the fold
    # launch where the plan runs split programs (a few decodes over long contexts), on the
    # `tl` pass and the Gluon decode kernel (heads 64 / 128; head 256 keeps the launch).
    # Its GPU tests pass (H200, 2026-12-02: the bits equal the fold launch's); off until timed
    # (KERNEL_NOTES v43): False, the fold launch; True, none.
    invariant_self_fold: bool = False
    # Batch-invariant mode's Gluon kernels (the prompt consumer and, since v50, the decode
    # kernel) skip O's rescale in a warp none of whose 16 rows moved its max (schedule only,
    # never the bits: alpha is then exactly 1 on each row, `tile_math.exact_softmax_step`,
    # and O times 1 is O; `gluon_softmax.lazy_rescale` with round-to-nearest multiplies, a
    # warp-uniform branch). On decodes within +-1% on the H200 (v49); the prompt rows and
    # its use beside 128-key tiles at head 128 are untimed (KERNEL_NOTES v45, v50).
    invariant_lazy_rescale: bool = False
    # Batch-invariant mode's running max, every pass alike (so a row's bits change with it,
    # as with the split keys): a row's max moves only where a tile's exceeds it by more than
    # this many powers of 2 (FA4's rule, `tile_math.invariant_max`; 0: every tile, today's
    # bits). P's weights then reach 2^slack and the row sums carry the same factor, which
    # the split's division cancels; a masked tile still leaves the state as it was. The
    # Gluon prompt consumer then skips O's rescale as `invariant_lazy_rescale` does, nearly
    # every tile past a split's first. 8: H200, prompts (tools/sweep_invariant.py, one
    # process, 2026-12-02) 1 x 8192 1.43 -> 1.33x the default mode's time, 32 x 512 1.42 ->
    # 1.39x, head 256 8 x 2048 1.62 -> 1.52x, head 64 1.23 -> 1.22x; decodes within +-1%
    # (KERNEL_NOTES v49, v54). An int of 0-8.
    invariant_max_slack: int = 8
    # Batch-invariant prompts' Gluon consumer passes a split's key tiles (after its first)
    # that lie past the last key its own 64 rows see, without their products: the rings'
    # slots released once filled, the ping-pong turns handed on (schedule only, never the
    # bits: such a tile's exact softmax step leaves a row's state as it was). Under a causal
    # mask that is consumer 0's last 64-key tile of every item (10% of the consumers' tiles
    # at 32 x 512, 1% at 1 x 8192), which the default consumer's half-width last tile saves.
    # Untimed (KERNEL_NOTES v55): False, every tile computed; True, passed.
    invariant_skip_unseen: bool = False


SWITCHES = Switches()


def switch_state() -> tuple:
    """Every switch's value, in field order: part of the key of anything memoised from the
    switches (a flip is a new key). Unhashable where a switch holds a dict or a list."""
    return tuple(vars(SWITCHES).values())
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclass(frozen=True)
class AttnConfig:
    block_m: int  # rows of a program's tile: block_q query tokens x the padded GQA group
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    num_splits: int  # 1: no split-KV (results go straight to `out`)
    # One key loop that masks boundary tiles at run time (one pipeline fill per program) or
    # three (masked / lean unmasked / masked: fewer instructions per tile, three fills).
    one_key_loop: bool = True


def per_head_size(value, head_size: Optional[int], default=None):
    """A switch's value for a layer whose largest head size is `head_size`: a dict's entry
    for it (`default` where the dict names none), else the value itself."""
    return value.get(head_size, default) if isinstance(value, dict) else value


def interpreting() -> bool:
    return envs.TRITON_INTERPRET


def dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype,
              device: torch.device) -> tl.dtype:
    """Operand type of both tensor-core products (float32 accumulation either way)."""
    dot = _DOT_DTYPES.get(q_dtype) or _DOT_DTYPES[out_dtype]
    if kv_dtype.itemsize == 1 and dot == tl.bfloat16 and SWITCHES.fp16_dot_for_fp8_kv:
        # fp8 -> fp16 is one native cvt per pair (sm_89+), fp8 -> bf16 goes through fp16 and
        # fp32 (~3x the instructions). q in fp16 bounds |q| by 65504 (activations are far
        # below); p is in [0, 1] and keeps more mantissa in fp16 than in bf16.
        dot = tl.float16
    if dot == tl.bfloat16 and interpreting():
        dot = tl.float32  # the interpreter's bf16 dot reads raw bits (Triton 3.9)
    return dot


def fp8_v_in_regs(v_dtype: torch.dtype, dot: tl.dtype, device: torch.device) -> bool:
    """Convert fp8 V tiles with inline PTX (`cvt.rn.f16x2.e4m3x2`, sm_89+) before they reach
    shared memory; the interpreter cannot run inline PTX."""
    return (v_dtype.itemsize == 1 and dot == tl.float16 and SWITCHES.fp8_v_in_regs
            and device.type == "cuda" and not interpreting()
            and torch.cuda.get_device_capability(device) >= (8, 9))


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number keeps the split logic exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_config(*, device: torch.device, batch: int, max_seqlen_k: int, num_kv_heads: int,
                  group_pad: int, head_size: int, num_splits: int,
                  override: Optional[AttnConfig] = None, kv_bytes: int = 2,
                  decode_only: bool = False) -> AttnConfig:
    """The decode pass: one program per (sequence, KV head, split), few query rows each.

    It streams K/V, so tiles favour bytes in flight (128 keys a step) over tensor-core shape;
    an fp8 cache (kv_bytes 1) does more work per byte and gains from a third stage.
    `num_splits` > 0 forces the split count. `decode_only`: no prefill pass shares the step,
    so the split scratch holds decode rows only and the count may balance the SMs
    (`decode_splits`); a mixed step splits only below one program per SM (`auto_splits`).
    """
    if override is not None:
        cfg = override
    elif interpreting():
        cfg = AttnConfig(decode_query_count(group_pad) * group_pad, 16, 4, 1, 1)
    else:
        cfg = AttnConfig(decode_query_count(group_pad) * group_pad,
                         128 if head_size <= 128 else 64, 4, 3 if kv_bytes == 1 else 2, 1)
    if num_splits > 0:
        return replace(cfg, num_splits=num_splits)
    if override is not None:
        return cfg
    if decode_only:
        return replace(cfg, num_splits=decode_splits(sm_count(device), batch * num_kv_heads,
                                                     max_seqlen_k, kv_bytes))
    return replace(cfg, num_splits=auto_splits(device, batch, max_seqlen_k, num_kv_heads))


@functools.lru_cache(maxsize=4096)
def decode_splits(sms: int, programs: int, max_seqlen_k: int, kv_bytes: int = 2,
                  fill_keys: int = DECODE_FILL_KEYS, per_sm: int = DECODE_PROGRAMS_PER_SM,
                  draw: Optional[float] = None) -> int:
    """The split count whose decode programs finish first in a model of the GPU.

    The `programs` (sequence, KV head) pairs times the splits spread evenly over the SMs, and
    the busiest SM decides the time. It runs DECODE_PROGRAMS_PER_SM at once; a round of m of
    them moves their keys at min(1, m x draw) of the SM's share of the bandwidth (`draw`, what
    one program takes alone, DECODE_DRAW), and each program also pays its pipeline fill.
    Whole waves are what this buys: 64 sequences x 8 KV heads unsplit fill 1.29 waves of three
    programs an SM, and the 116 programs of the last run one an SM, below their SMs' share;
    in two splits the SMs stay full to the end (H200: 3.9 -> 4.4 TB/s at 16k keys, KERNEL_NOTES
    v21). Keys per split stay >= MIN_KEYS_PER_SPLIT, splits <= MAX_SPLITS. `fill_keys`: the
    keys a program's fill costs (the block-sparse pass's "short fill" rule counts fewer);
    `per_sm` and `draw` (None: DECODE_DRAW's) model other tiles (the block-sparse pass's
    four an SM).
    """
    if draw is None:
        draw = DECODE_DRAW.get(kv_bytes, 0.75)
    programs = max(1, programs)
    best, best_time = 1, math.inf
    for splits in range(1, MAX_SPLITS + 1):
        keys = triton.cdiv(max_seqlen_k, splits)
        if splits > 1 and keys < MIN_KEYS_PER_SPLIT:
            break
        busiest = triton.cdiv(programs * splits, sms)
        full, rest = divmod(busiest, per_sm)
        rounds = full * per_sm / min(1.0, per_sm * draw)
        if rest:
            rounds += rest / min(1.0, rest * draw)
        time = rounds * (keys + fill_keys)
        if time < best_time * (1 - 1e-9):  # ties keep fewer splits (less reduce work)
            best, best_time = splits, time
    return best


def prefill_config(*, max_seqlen_q: int, head_size: int, group_pad: int,
                   override: Optional[AttnConfig] = None) -> AttnConfig:
    """The prefill pass's tiles: query blocks of longer requests (splits: `prefill_splits`)."""
    if override is not None:
        return replace(override, num_splits=1)
    if interpreting():
        return AttnConfig(max(16, group_pad), 16, 4, 1, 1)
    if head_size <= 128 and max_seqlen_q >= 2048:
        return AttnConfig(256, 64, 8, 3, 1, one_key_loop=False)
    if head_size <= 128:  # few tiles per program: small blocks balance the causal triangle
        return AttnConfig(64, 64, 4, 3, 1)
    return AttnConfig(64, 64, 4, 2, 1, one_key_loop=False)


def prefill_splits(*, device: torch.device, q_blocks: int, block_m: int, max_seqlen_k: int,
                   num_kv_heads: int, num_splits: int) -> int:
    """Split the prefill pass's keys when its (query block, KV head) programs cannot fill the GPU.

    A long prefill has plenty of programs and is never split; a few query blocks over many keys
    (cascade's prefix pass: a batch of decodes as one query over a long shared prefix; a short
    chunk over a long context) would each stream every key alone. q_blocks bounds the pass's
    query blocks; `num_splits` > 0 forces the count, as for the decode pass. Two 64-row
    programs fit an SM (shared memory), so those split below 2 x SMs programs: 256 queries over
    16k keys (128 programs) ran 1.9x faster in 2 splits on the H100 (docs/dev/KERNEL_NOTES.md v4).
    """
    if num_splits > 0:
        return num_splits
    return auto_splits(device, q_blocks, max_seqlen_k, num_kv_heads,
                       slots_per_sm=2 if block_m <= 64 else 1)


def auto_splits(device: torch.device, batch: int, max_seqlen_k: int, num_kv_heads: int,
                slots_per_sm: int = 1) -> int:
    """Split the KV axis when the (sequence, KV head) programs cannot fill the GPU.

    Flash-decoding: a batch-1 decode has only num_kv_heads programs; splitting each sequence's
    keys into n ranges gives n times the programs, then a small pass merges their partial states.
    """
    busy = max(1, batch * num_kv_heads)
    if busy >= slots_per_sm * sm_count(device):
        return 1
    by_length = max(1, max_seqlen_k // MIN_KEYS_PER_SPLIT)
    return max(1, min(triton.cdiv(2 * sm_count(device), busy), by_length, MAX_SPLITS))


def hopper_prefill_config(*, device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                          head_size: int, head_size_v: int, dense_keys: bool,
                          features_ok: bool) -> Optional[AttnConfig]:
    """Tiles of the Hopper prefill pass, or None where it does not apply: it needs 16-bit q
    and K/V (fp8 caches and queries take the portable pass), power-of-2 head sizes (TMA
    boxes), and dense rows for the new tokens' keys (`dense_keys`: dense varlen keys, or the
    layer's own key/value handed to the plan)."""
    switch = SWITCHES.hopper_prefill
    if switch is False or not features_ok or not dense_keys:
        return None
    if switch is None and not (device.type == "cuda" and not interpreting()
                               and torch.cuda.get_device_capability(device)[0] == 9):
        return None
    if q_dtype not in (torch.float16, torch.bfloat16) or kv_dtype != q_dtype:
        return None
    if any(d not in (64, 128, 256) for d in (head_size, head_size_v)):
        return None
    tiles = per_head_size(SWITCHES.hopper_tiles, max(head_size, head_size_v))
    if tiles is not None:
        return AttnConfig(*tiles, num_splits=1)
    if interpreting():
        return AttnConfig(16, 16, 4, 1, 1)
    # H100 sweep (docs/dev/KERNEL_NOTES.md v5): one warpgroup on 64 query rows beat two on 128
    # (1 x 8k: 478 vs 416-471 TFLOP/s, 32 x 512: 226 vs 161-173); head 256 needs two.
    if max(head_size, head_size_v) == 256:
        return AttnConfig(128, 64, 8, 2, 1)
    return AttnConfig(64, 64, 4, 3, 1)


def pack_gqa(group: int, head_size: int, cfg: AttnConfig) -> bool:
    """Pack the query heads of a KV head into one Hopper-pass program's rows, so each K/V
    tile crosses from L2 once per KV head instead of once per query head."""
    switch = SWITCHES.hopper_pack_gqa
    fits = 1 < group <= cfg.block_m // 8 and group & (group - 1) == 0  # power-of-2 boxes
    if switch is not None:
        return switch and fits
    # H100, two runs side by side (docs/dev/KERNEL_NOTES.md v5): head 128 gains on long prompts
    # (1 x 16k: 492 vs 465-473 TFLOP/s) and is even elsewhere; heads 64 and 256 lose 6-15%.
    return fits and head_size == 128
