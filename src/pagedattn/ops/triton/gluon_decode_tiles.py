"""The Gluon decode kernel's tiles (`gluon_decode.py`): ring depths and register split by
head size, fp8 cache and programs a SM, from host ints alone, and the V slots' form over an
fp8 cache (`fp8_pv`). Imports nothing (the SASS tool reads it without torch or Triton's GPU
side); `gluon_decode_launch.py` plans with it.
"""

from __future__ import annotations

ROWS = 64  # the kernel's one wgmma tile of rows
SMEM_BYTES = 232448  # sm_90's shared memory a block may take (227 KB)

# (BLOCK_N, NUM_BUF, STAGES, WORKER_REGS) by (head size, fp8 cache), for one program a SM:
# the rings take most of its shared memory and hold as many bytes in flight as fit (16-bit
# h128: 3 slots of 128 keys, 192 KB of K/V; fp8: 3 fp8 K slots, 3 fp8 V stages, 3 fp16 V
# slots). Head 256 takes 64-key tiles.
_TILES = {
    (64, False): (128, 5, 1, 40), (128, False): (128, 3, 1, 40), (256, False): (64, 3, 1, 40),
    (64, True): (128, 4, 4, 72), (128, True): (128, 3, 3, 72), (256, True): (64, 2, 3, 72),
}
# Two programs a SM (compiled with maxnreg 128: the consumer then gets 256 - WORKER_REGS
# registers): half the shared memory each, so one program's prologue and pipeline fill run
# while the other streams (short splits: B1 L32k, B128 L1k). No spill at these counts
# (tools/gluon_decode_sass.py); head 256 has no such tiles.
_TILES_TWO = {
    (64, False): (128, 3, 1, 48), (128, False): (64, 3, 1, 48),
    (64, True): (128, 3, 3, 72), (128, True): (64, 3, 3, 72),
}
TWO_PER_SM_MAXNREG = 128


def decode_tiles(head_size: int, fp8: bool, per_sm: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_N, NUM_BUF, STAGES, WORKER_REGS) of the kernel for the head size and an fp8
    cache (STAGES: the fp8 V staging ring's depth, 1 and unused over a 16-bit cache), for
    `per_sm` programs a SM (2: compile with maxnreg TWO_PER_SM_MAXNREG)."""
    key = (head_size, bool(fp8))
    table = _TILES_TWO if per_sm == 2 else _TILES
    if per_sm not in (1, 2) or key not in table:
        raise ValueError(f"no Gluon decode tiles for head size {head_size} (fp8 {bool(fp8)}) "
                         f"at {per_sm} programs a SM")
    return table[key]


def per_sm_served(head_size: int, fp8: bool, per_sm: int) -> int:
    """`per_sm` where tiles for it exist, else 1."""
    return per_sm if (head_size, bool(fp8)) in (_TILES_TWO if per_sm == 2 else _TILES) else 1


def fp8_pv(switch: object) -> bool:
    """`SWITCHES.gluon_decode_fp8_pv`'s value checked: whether a launch over an fp8 cache
    runs P V as an fp8 wgmma over fp8 V^T slots (a 16-bit cache's never does)."""
    if not isinstance(switch, bool):
        raise TypeError(f"SWITCHES.gluon_decode_fp8_pv must be True or False, got {switch!r}")
    return switch


def max_slack(switch: object) -> int:
    """`SWITCHES.gluon_decode_max_slack`'s value checked: an int from -1 (O rescaled every
    tile) to 8 (`gluon_softmax.stale_max`'s slack)."""
    if isinstance(switch, bool) or not isinstance(switch, int):
        raise TypeError(f"SWITCHES.gluon_decode_max_slack must be an int, got {switch!r}")
    if not -1 <= switch <= 8:
        raise ValueError(f"SWITCHES.gluon_decode_max_slack must be -1 (off), 0 (exact skip) "
                         f"or a slack of 1 to 8, got {switch}")
    return switch


def smem_bytes(head_size: int, fp8: bool, q_bytes: int, per_sm: int = 1,
               pv_fp8: bool = False) -> int:
    """Shared memory of the rings and Q at these tiles (barriers aside): q_bytes is q's
    element size, 2 for a 16-bit cache and 1 with fp8; pv_fp8: the consumer's V slots are
    fp8 V^T (`fp8_pv`), else 16-bit."""
    block_n, num_buf, stages, _ = decode_tiles(head_size, fp8, per_sm)
    kv = 1 if fp8 else 2
    v = 1 if fp8 and pv_fp8 else 2
    return (ROWS * head_size * q_bytes + num_buf * block_n * head_size * (kv + v)
            + (stages * block_n * head_size if fp8 else 0))
