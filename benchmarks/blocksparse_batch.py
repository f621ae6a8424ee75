"""A block-sparse decode batch with the same interface as `decode_peers.DecodeBatch` (engine,
passes, splits, kv_bytes), so `ncu_decode.py` profiles it beside the dense decode pass.

32 q / 8 KV heads, head 128, bf16, cache block 16 (shuffled blocks) as the dense batch; the
cache is one buffer seen as the v0 key and value caches (`PagedAttention.split_kv_cache`), as
tools/ab_blocksparse_decode.py builds it; the pattern is issue 19's: sparse block 64, local
4, a family (per head, homo_head) and a vertical stride. `kv_bytes` counts the blocks the
pattern reads (the union of a KV head's query heads' blocks), `lookups` the block-table
entries those are (one per page and KV head). `switches` are `launch.SWITCHES` fields set
while the batch runs (a variant: `blocksparse_decode_key_lines`, tiles, splits).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from bench_blocksparse import FAMILIES, decode_bytes

from pagedattn.ops.paged_attn import PagedAttention
from pagedattn.ops.triton import blocksparse_decode as kernels
from pagedattn.ops.triton import launch

H, HKV, D, PAGE = 32, 8, 128, 16
SPARSE_BLOCK, LOCAL = 64, 4
DT = torch.bfloat16


@contextlib.contextmanager
def switched(switches: dict):
    """`launch.SWITCHES` fields set to `switches` inside, restored after."""
    before = {name: getattr(launch.SWITCHES, name) for name in switches}
    for name, value in switches.items():
        setattr(launch.SWITCHES, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(launch.SWITCHES, name, value)


class SparseDecodeBatch:
    """`batch` requests of `ctx` cached keys, one query each, decoded under a pattern."""

    def __init__(self, batch: int, ctx: int, family: str, vert_stride: int,
                 switches: dict | None = None, device: str = "cuda"):
        self.batch, self.ctx, self.family, self.vert = batch, ctx, family, vert_stride
        self.switches = dict(switches or {})
        blocks = math.ceil(ctx / PAGE)
        kv = torch.randn(2, batch * blocks, PAGE * HKV * D, dtype=DT, device=device)
        self.kc, self.vc = PagedAttention.split_kv_cache(kv, HKV, D)
        self.block_table = torch.randperm(batch * blocks, dtype=torch.int32,
                                          device=device).view(batch, blocks)
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, H, D, dtype=DT, device=device)
        self.out = torch.empty_like(self.q)
        self.kv_bytes = batch * decode_bytes(ctx, SPARSE_BLOCK, LOCAL, vert_stride,
                                             FAMILIES[family])
        self.lookups = self.kv_bytes // (2 * PAGE * D * DT.itemsize)
        with switched(self.switches):
            self._splits = kernels.split_count(torch.device(device), batch, H, HKV, ctx,
                                               FAMILIES[family], SPARSE_BLOCK, LOCAL,
                                               vert_stride)
            self._tiles = kernels.default_tiles(D, DT.itemsize)
            self.workspace = kernels.decode_workspace(torch.device(device), batch, H, HKV, D)

    def engine(self) -> Callable[[], None]:
        """The block-sparse decode over the v0 views, writing self.out."""
        def run():
            with switched(self.switches):
                kernels.paged_decode(
                    self.q, self.kc, self.vc, self.out, block_tables=self.block_table,
                    seq_lens=self.lens, scale=D ** -0.5, head_base=0,
                    head_sliding_step=FAMILIES[self.family], block_size=SPARSE_BLOCK,
                    local_blocks=LOCAL, vert_stride=self.vert, alibi_slopes=None,
                    k_scale=None, v_scale=None, max_seq_len=self.ctx,
                    workspace=self.workspace)
        return run

    def passes(self) -> list[dict]:
        """The launches as `DecodeBatch.passes` lists them (the attention pass is "decode")."""
        block_n, warps, stages = self._tiles[:3]
        out = [dict(name="decode", kernel="_decode_kernel", grid=[self.batch, HKV, self._splits],
                    num_warps=warps, num_stages=stages, block_m=16, block_n=block_n)]
        if self._splits > 1:  # reduce_splits' launch (its grid as reduce.py sizes it)
            out.append(dict(name="reduce", kernel="reduce_splits_kernel", grid=[self.batch, H],
                            num_warps=4, num_stages=1, block_m=None, block_n=None))
        return out

    def splits(self) -> int:
        return self._splits
