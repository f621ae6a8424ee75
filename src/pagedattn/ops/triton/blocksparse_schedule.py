"""The block-sparse decode pass's schedule, chosen on the host from Python ints: its vertical
classes, split-KV count, split scratch, tiles and the `launch.SWITCHES` that vary them
(`tools/ab_blocksparse_decode.py` times each; docs/dev/KERNEL_NOTES.md has the outcomes)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from pagedattn.ops.triton import launch

# "short fill": the wave model of `launch.decode_splits` with a program's pipeline fill
# counted as one 128-key tile, not the dense pass's two. A homo-head program streams ~18
# tiles at B64 L16k, where two tiles of fill keep 512 programs unsplit (1.29 waves of three
# an SM, the last wave's SMs a third full) and one splits them in two (2.59 waves).
SHORT_FILL_KEYS = 128
# Four programs an SM over 16-bit caches at heads up to 128: 64-key tiles, one buffer
# ahead, registers capped at 128. H200 (KERNEL_NOTES v31): B64 L16k 1.08-1.33x of dense x
# read with 128-key tiles -> 1.02-1.09x; they need their own wave model, since two of them
# an SM draw less than the SM's share (B32 L32k homo head unsplit 1.33x, in two splits
# 1.18x): one draws FOUR_PER_SM_DRAW of it alone (fitted to that pair of runs).
FOUR_PER_SM_TILES = (64, 4, 2, 128)
FOUR_PER_SM_DRAW = 0.43


def residue_classes(group: int, head_sliding_step: int, vert_stride: int) -> int:
    """Distinct vertical block classes among a KV group's query heads (offsets step apart)."""
    vert = max(1, vert_stride)
    if head_sliding_step <= 0:
        return 1
    return min(group, vert // math.gcd(head_sliding_step, vert))


def split_rule():
    """`SWITCHES.blocksparse_decode_splits`: None, a rule's name, or a forced count (an int
    in [1, MAX_SPLITS], for A/B runs), or a ValueError naming the value."""
    rule = launch.SWITCHES.blocksparse_decode_splits
    if isinstance(rule, int) and not isinstance(rule, bool):
        if 1 <= rule <= launch.MAX_SPLITS:
            return rule
    elif rule is None or rule in launch.BLOCKSPARSE_DECODE_SPLIT_RULES:
        return rule
    raise ValueError(f"SWITCHES.blocksparse_decode_splits={rule!r} must be None, one of "
                     f"{launch.BLOCKSPARSE_DECODE_SPLIT_RULES} or an int in [1, "
                     f"{launch.MAX_SPLITS}]")


def decode_splits(device: torch.device, num_seqs: int, num_kv_heads: int, max_seq_len: int,
                  residues: int, block_size: int, local_blocks: int, vert_stride: int,
                  kv_bytes: int = 2, head_size: int = 128) -> int:
    """Split-KV count: the dense decode's rule over the keys one program reads at most (the
    window plus its classes' vertical blocks); `SWITCHES.blocksparse_decode_splits`
    "waves" splits programs that fill the SMs unsplit as the dense decode pass does
    (`launch.decode_splits`: whole waves of three programs an SM), "short fill" likewise
    with a one-tile fill (`SHORT_FILL_KEYS`), an int forces that count. The wave model
    takes the programs an SM of the tiles `default_tiles(head_size, kv_bytes)` launches
    (`programs_per_sm`)."""
    rule = split_rule()
    if isinstance(rule, int):
        return rule
    keys = min(max_seq_len, (max(local_blocks, 1) + 1) * block_size
               + max_seq_len * residues // max(1, vert_stride))
    # Half the dense rule's 512 keys per split: a sparse program's keys are few (batch 1,
    # 32k, homo vert_stride 8: 16 splits 0.0145 ms, 8 splits 0.0186 on the H100).
    splits = launch.auto_splits(device, num_seqs, 2 * keys, num_kv_heads)
    if rule is not None and splits == 1:
        fill = SHORT_FILL_KEYS if rule == "short fill" else launch.DECODE_FILL_KEYS
        per_sm, draw = programs_per_sm(default_tiles(head_size, kv_bytes))
        splits = launch.decode_splits(launch.sm_count(device), num_seqs * num_kv_heads, keys,
                                      kv_bytes, fill_keys=fill, per_sm=per_sm, draw=draw)
    return splits


def programs_per_sm(tiles: tuple) -> tuple[int, Optional[float]]:
    """(programs an SM, one program's draw of its bandwidth or None for the dense pass's)
    for the wave model of these tiles: the four-an-SM tiles' own, else the dense decode
    pass's three."""
    if tuple(tiles) == FOUR_PER_SM_TILES:
        return 4, FOUR_PER_SM_DRAW
    return launch.DECODE_PROGRAMS_PER_SM, None


def split_count(device: torch.device, num_seqs: int, num_heads: int, num_kv_heads: int,
                max_seq_len: int, head_sliding_step: int, block_size: int, local_blocks: int,
                vert_stride: int, kv_bytes: int = 2, head_size: int = 128) -> int:
    """The split-KV count `paged_decode` chooses for these ints (a plan fixes it once)."""
    vert = max(1, vert_stride)
    residues = residue_classes(num_heads // num_kv_heads, head_sliding_step, vert)
    return decode_splits(device, num_seqs, num_kv_heads, max_seq_len, residues, block_size,
                         local_blocks, vert, kv_bytes, head_size)


def decode_workspace(device: torch.device, max_num_seqs: int, num_heads: int,
                     num_kv_heads: int, head_size: int) -> tuple[torch.Tensor, ...]:
    """Split-KV scratch for every batch of at most max_num_seqs: partial outputs [rows,
    head_size] and LSEs [rows] float32 (rows = splits x num_seqs x num_heads at most) and
    cu_seqlens [max_num_seqs + 1] = 0..max_num_seqs for the reduce. Splits happen only below
    one program per SM, or, under `SWITCHES.blocksparse_decode_splits` "waves", into the
    few whole waves of `launch.decode_splits`, so rows stay small (a few MB)."""
    splits_x_seqs = max(decode_splits(device, n, num_kv_heads, 1 << 30, 1, 1, 0, 1, kv_bytes,
                                      head_size)
                        * n for n in range(1, max_num_seqs + 1) for kv_bytes in (1, 2))
    rows = max(1, splits_x_seqs) * num_heads
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty(rows, head_size, **f32), torch.empty(rows, **f32),
            torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device))


def default_tiles(head_size: int, kv_itemsize: int) -> tuple:
    """(BLOCK_N, warps, stages); measured on the H100 (docs/PERFORMANCE.md, block-sparse).
    `SWITCHES.blocksparse_decode_tiles` replaces them (a fourth entry: maxnreg)."""
    if launch.SWITCHES.blocksparse_decode_tiles is not None:
        return check_tiles(launch.SWITCHES.blocksparse_decode_tiles,
                           "SWITCHES.blocksparse_decode_tiles")
    if launch.interpreting():
        return 16, 4, 1
    if key_lines() and head_size <= 128:
        if kv_itemsize == 2:
            return FOUR_PER_SM_TILES
        # H200, e4m3: 1.25-1.37x of dense x read (the [D, N] load 1.6-1.7x); capped at 168
        # registers for three programs an SM, with page lines 0.83-1.17x (KERNEL_NOTES v49)
        return 128, 4, 2, 168
    return 64, 4, (3 if head_size <= 128 else 2)


def key_lines() -> bool:
    """Whether K tiles are gathered as whole lines (`SWITCHES.blocksparse_decode_key_lines`;
    None: over every cache, as the H200 measured them faster over bf16 and e4m3)."""
    return on_unless_set("blocksparse_decode_key_lines")


def page_lines(block_n: int, page: int, chunk: int) -> bool:
    """Whether K tiles load from one block-table entry a page, and V as whole lines like K
    where `value_lines` says so (`SWITCHES.blocksparse_decode_page_lines`, None: over every
    cache, with key lines on): only where each chunk of a tile starts on a page
    (`chunk % page == 0`, which a tile of whole pages needs)."""
    return (on_unless_set("blocksparse_decode_page_lines") and key_lines()
            and block_n % page == 0 and chunk % page == 0)


def value_lines() -> bool:
    """Whether page lines (`page_lines`) load V as whole lines from the tile's pages too
    (`SWITCHES.blocksparse_decode_value_lines`; None: over every cache), or by its [N, D]
    load from an entry a key. The H200 measured the lines faster over bf16 as well as fp8
    (bf16, four-an-SM tiles: 1.06-1.17x -> 1.00-1.09x of dense x blocks read; KERNEL_NOTES
    v54), though over 16-bit caches the lines' permuted V holds more registers (v51)."""
    return on_unless_set("blocksparse_decode_value_lines")


def on_unless_set(name: str) -> bool:
    """`SWITCHES.<name>` where set (a bool), else True (the forms the H200 measured faster
    over every cache); any other value is a ValueError."""
    switch = getattr(launch.SWITCHES, name)
    if switch is not None and not isinstance(switch, bool):
        raise ValueError(f"SWITCHES.{name}={switch!r} must be None (on) or a bool")
    return True if switch is None else switch


def slot_sums() -> bool:
    """Whether the key loop keeps its row sums per key slot (`SWITCHES.
    blocksparse_decode_slot_sums`, a bool), or a ValueError naming the value."""
    switch = launch.SWITCHES.blocksparse_decode_slot_sums
    if not isinstance(switch, bool):
        raise ValueError(f"SWITCHES.blocksparse_decode_slot_sums={switch!r} must be a bool")
    return switch


def check_tiles(tiles, name: str = "tiles") -> tuple:
    """(BLOCK_N, warps, stages[, maxnreg]) of positive ints, BLOCK_N and warps powers of 2
    (Triton's tensor shapes and warp counts), or a ValueError naming `name`."""
    ok = (isinstance(tiles, tuple) and len(tiles) in (3, 4)
          and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in tiles)
          and tiles[0] >= 16 and not tiles[0] & (tiles[0] - 1) and not tiles[1] & (tiles[1] - 1))
    if not ok:
        raise ValueError(f"{name}={tiles!r} must be (BLOCK_N, warps, stages) or (BLOCK_N, "
                         "warps, stages, maxnreg): positive ints, BLOCK_N >= 16 and warps "
                         "powers of 2")
    return tiles
