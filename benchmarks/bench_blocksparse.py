"""Block-sparse attention on one GPU: prefill time versus density, and sparse decode versus
plain decode at the same context, side by side in one run.

    PYTHONPATH=src python benchmarks/bench_blocksparse.py [--sections prefill,decode]
        [--lens 8192,16384,32768] [--ctxs 8192,32768] [--batches 32,1] [--local-blocks 4]
        [--block-size 64] [--tiles] [--sweep] [--baseline OLD.py] [--out results.md]

Prefill: one sequence of L tokens, 32 q / 8 KV heads, head 128, bf16. "dense" is the
FLASH_ATTN Triton kernel (causal); density is attended (query, key) pairs over causal pairs,
averaged over heads (exact, from the pattern). Target: sparse ms <= 1.3 x dense ms x density.
Decode: a batch of single-token queries over a paged cache (scattered blocks), graph-replayed,
beside plain decode (FLASH_ATTN's kernel) of the same cache. "blocks read" is the fraction of
the cache each KV head must read (the union of its query heads' blocks); TB/s counts those
bytes, "% copy" compares it with a device copy measured in the same run. Targets: time <=
1.05 x plain; homo patterns <= 1.3 x plain x blocks read.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util

import torch
import triton

from pagedattn.ops.blocksparse_prefill import LocalStridedBlockSparseAttn
from pagedattn.ops.paged_attn import PagedAttention
from pagedattn.ops.torch.blocksparse import head_offsets
from pagedattn.ops.triton import blocksparse as kernels
from pagedattn.ops.triton.op_plans import varlen_attention

H, HKV, D = 32, 8, 128
DT = torch.bfloat16
OUT: list[str] = []
BASELINE: list = []  # an older ops/triton/blocksparse.py (--baseline), timed beside


def load_baseline(path: str) -> None:
    spec = importlib.util.spec_from_file_location("blocksparse_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    BASELINE.append(module)


def emit(line: str = "") -> None:
    print(line, flush=True)
    if OUT:
        with open(OUT[0], "a") as f:
            f.write(line + "\n")


def _safe(timer):
    """A row whose kernel fails reports NaN (and why) instead of ending the run."""
    @functools.wraps(timer)
    def run(fn) -> float:
        try:
            return timer(fn)
        except Exception as e:  # noqa: BLE001 - a benchmark row, not a library path
            emit(f"<!-- failed: {type(e).__name__}: {str(e).splitlines()[0][:200]} -->")
            return float("nan")
    return run


@_safe
def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


@_safe
def bench_graph(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def block_visibility(n_blocks, offsets, local_blocks, vert_stride) -> torch.Tensor:
    """[heads, q blocks, k blocks] bool: the pattern at block level (causal blocks only)."""
    qb = torch.arange(n_blocks)[:, None]
    kb = torch.arange(n_blocks)[None, :]
    near = (qb - kb < local_blocks) & (kb <= qb)
    strided = ((kb + offsets[:, None, None]) % vert_stride == 0) & (kb <= qb)
    return near | strided


def prefill_density(seq_len, block_size, local_blocks, vert_stride, step) -> float:
    n = seq_len // block_size
    vis = block_visibility(n, head_offsets(H, H // HKV, 0, step, torch.device("cpu")),
                           local_blocks, vert_stride)
    diag = torch.eye(n, dtype=torch.bool)
    pairs = (vis & ~diag).sum() * block_size ** 2 + (vis & diag).sum() * block_size * (
        block_size + 1) // 2
    causal = H * seq_len * (seq_len + 1) // 2
    return float(pairs) / causal


def section_prefill(lens, block_size, local_blocks, tiles) -> None:
    emit(f"\n#### Prefill: 1 sequence, {H} q / {HKV} KV heads, head {D}, bf16, sparse block "
         f"{block_size}, local_blocks {local_blocks}\n")
    emit("| len | vert_stride | density | sparse ms | dense ms | dense x density ms | ratio "
         "| ours at vert_stride 1 ms |" + (" baseline ms |" if BASELINE else ""))
    emit("|---|---|---|---|---|---|---|---|" + ("---|" if BASELINE else ""))
    for L in lens:
        q = torch.randn(L, H, D, device="cuda", dtype=DT)
        k, v = (torch.randn(L, HKV, D, device="cuda", dtype=DT) for _ in "kv")
        cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        dense = bench(functools.partial(
            varlen_attention, q, k, v, out, cu_seqlens_q=cu, seqused_k=cu[1:] - cu[:1],
            cu_seqlens_k=cu, block_table=None, max_seqlen_q=L, max_seqlen_k=L,
            softmax_scale=D ** -0.5, causal=True, window_left=-1, window_right=-1, softcap=0.0,
            alibi_slopes=None, sinks=None, q_descale=None, k_descale=None, v_descale=None,
            softmax_lse=None))
        ours_dense = None
        for vs in (1, 2, 4, 8, 16):
            for qbs in ((None, 64, 128) if tiles else (None,)):
                attn = LocalStridedBlockSparseAttn(H, L, local_blocks, vs, block_size,
                                                   q_block_size=qbs)
                ms = bench(functools.partial(attn, q, k, v, cu, sm_scale=D ** -0.5, out=out))
                if vs == 1 and qbs is None:
                    ours_dense = ms
                dens = prefill_density(L, block_size, local_blocks, vs, attn.head_sliding_step)
                tag = "" if qbs is None else f" (q tile {qbs})"
                extra = ""
                if BASELINE and qbs is None:
                    base_ms = bench(functools.partial(
                        BASELINE[0].varlen_attention, q, k, v, out, cu_seqlens_q=cu,
                        cu_seqlens_k=cu, sm_scale=D ** -0.5, head_base=0,
                        head_sliding_step=attn.head_sliding_step, block_size=block_size,
                        local_blocks=local_blocks, vert_stride=vs))
                    extra = f" {base_ms:.3f} |"
                emit(f"| {L} | {vs}{tag} | {dens:.3f} | {ms:.3f} | {dense:.3f} | "
                     f"{dense * dens:.3f} | {ms / (dense * dens):.2f} | {ours_dense:.3f} |"
                     + extra)
        del q, k, v, out
        torch.cuda.empty_cache()


def decode_bytes(ctx, block_size, local_blocks, vert_stride, step, union=True) -> int:
    """K/V bytes the decode must read: per KV head, the union of its query heads' keys (or,
    union=False, the sum over query heads of each one's own keys)."""
    n = -(-ctx // block_size)
    offsets = head_offsets(H, H // HKV, 0, step, torch.device("cpu"))
    vis = block_visibility(n, offsets, local_blocks, vert_stride)[:, n - 1]  # [H, k blocks]
    per_kv = vis.view(HKV, H // HKV, n).any(1) if union else vis
    keys = per_kv.sum() * block_size - per_kv[:, -1].sum() * (n * block_size - ctx)
    return int(keys) * D * 2 * 2


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (the ceiling)."""
    src = torch.empty(1 << 29, dtype=DT, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(functools.partial(dst.copy_, src))
    return 2 * (1 << 30) / ms / 1e9  # TB/s


FAMILIES = {"per head": 1, "homo_head": 0, "homo_head_group": -1}
# (family, vert_stride, sparse block, local_blocks); Phi-3-small is (per head, 8, 64, 16).
DECODE_ROWS = ([("per head", vs, 64, 4) for vs in (1, 2, 4, 8, 16)]
               + [(f, vs, 64, 4) for f in ("homo_head", "homo_head_group") for vs in (4, 8, 16)]
               + [("per head", 8, 64, 16), ("homo_head", 8, 64, 16), ("per head", 8, 16, 4),
                  ("homo_head", 8, 16, 4)])


def _warm_one(row) -> None:
    """Compile one decode variant (both split modes) on a small cache of the same strides."""
    family, vs, sbs, local, tiles = row
    kv = torch.randn(2, 512, 16 * HKV * D, device="cuda", dtype=DT)
    kc, vc = PagedAttention.split_kv_cache(kv, HKV, D)
    table = torch.arange(512, device="cuda", dtype=torch.int32).view(1, 512)
    q = torch.randn(1, H, D, device="cuda", dtype=DT)
    for splits in (1, 2):
        kernels.paged_decode(q, kc, vc, torch.empty_like(q), block_tables=table,
                             seq_lens=torch.full((1,), 8192, dtype=torch.int32, device="cuda"),
                             scale=D ** -0.5, head_base=0, head_sliding_step=FAMILIES[family],
                             block_size=sbs, local_blocks=local, vert_stride=vs,
                             alibi_slopes=None, k_scale=None, v_scale=None, max_seq_len=8192,
                             num_splits=splits, tiles=tiles)
    torch.cuda.synchronize()


def warm_decode(sweep, workers: int) -> None:
    """Fill Triton's cache from `workers` processes first (compiles run in parallel)."""
    import multiprocessing
    rows = [r + (t,) for r in DECODE_ROWS for t in (sweep or [None])]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_warm_one, rows, chunksize=1)


def decode_case(batch, ctx, page=16) -> dict:
    """A paged cache of `batch` sequences of ctx keys (scattered blocks), the same bytes in
    FLASH_ATTN's layout, and the plain decode's time over it."""
    nblk = -(-ctx // page)
    kv = torch.randn(2, batch * nblk, page * HKV * D, device="cuda", dtype=DT)
    kc, vc = PagedAttention.split_kv_cache(kv, HKV, D)
    table = torch.randperm(batch * nblk, device="cuda", dtype=torch.int32).view(batch, nblk)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    flash = kv.view(2, batch * nblk, page, HKV, D)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    plain = bench_graph(functools.partial(
        varlen_attention, q, flash[0], flash[1], out, cu_seqlens_q=cu, seqused_k=lens,
        cu_seqlens_k=None, block_table=table, max_seqlen_q=1, max_seqlen_k=ctx,
        softmax_scale=D ** -0.5, causal=True, window_left=-1, window_right=-1, softcap=0.0,
        alibi_slopes=None, sinks=None, q_descale=None, k_descale=None, v_descale=None,
        softmax_lse=None))
    workspace = kernels.decode_workspace(q.device, batch, H, HKV, D)
    return dict(kv=kv, plain=plain, decode=functools.partial(
        kernels.paged_decode, q, kc, vc, out, block_tables=table, seq_lens=lens,
        scale=D ** -0.5, head_base=0, alibi_slopes=None, k_scale=None, v_scale=None,
        max_seq_len=ctx, workspace=workspace))


def pick_tiles(candidates, ctx) -> tuple:
    """The (BLOCK_N, warps, stages) with the least geometric-mean time over batch 32 per head
    and homo_head, and batch 1 homo_head, at vert_stride 8 (sparse block 64, local 4)."""
    emit(f"\n#### Decode tiles at ctx {ctx} (ms; vert_stride 8, sparse block 64, local 4)\n")
    emit("| tiles | b32 per head | b32 homo_head | b1 homo_head | geomean |")
    emit("|---|---|---|---|---|")
    best, best_score = candidates[0], float("inf")
    cases = {b: decode_case(b, ctx) for b in (32, 1)}
    for tiles in candidates:
        times = [bench_graph(functools.partial(
            cases[b]["decode"], head_sliding_step=FAMILIES[f], block_size=64, local_blocks=4,
            vert_stride=8, tiles=tiles)) for b, f in ((32, "per head"), (32, "homo_head"),
                                                     (1, "homo_head"))]
        score = (times[0] * times[1] * times[2]) ** (1 / 3)
        emit(f"| {tiles} | {times[0]:.4f} | {times[1]:.4f} | {times[2]:.4f} | {score:.4f} |")
        if score < best_score:
            best, best_score = tiles, score
    del cases
    torch.cuda.empty_cache()
    emit(f"\nchosen tiles: {best}")
    return best


def section_decode(batches, ctxs, sweep=(), copy_tbs=3.0, tiles=None) -> None:
    emit(f"\n#### Decode: {H} q / {HKV} KV heads, head {D}, bf16, cache block 16 (scattered "
         f"blocks), CUDA-graph replays; copy ceiling {copy_tbs:.2f} TB/s\n")
    emit("| batch | ctx | pattern (vert_stride, sparse block, local) | blocks read | ms | TB/s "
         "| % copy | plain ms | plain x read ms | / plain | / (plain x read) |"
         + (" baseline ms |" if BASELINE else ""))
    emit("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if BASELINE else ""))
    for batch in batches:
        for ctx in ctxs:
            case = decode_case(batch, ctx)
            plain, full = case["plain"], batch * ctx * HKV * D * 2 * 2
            rows = [r + (tiles, 0) for r in DECODE_ROWS]
            if sweep and batch == 1 and ctx == ctxs[-1]:  # split-KV counts, forced
                rows += [(f, 8, 64, 4, tiles, n) for f in ("per head", "homo_head")
                         for n in (4, 8, 16, 32, 64)]
            for family, vs, sbs, local, row_tiles, splits in rows:
                step = FAMILIES[family]
                name = f"{family}, {vs}, {sbs}, {local}"
                name += f" ({splits} splits)" if splits else ""
                decode = functools.partial(
                    case["decode"], head_sliding_step=step, block_size=sbs, local_blocks=local,
                    vert_stride=vs, num_splits=splits)
                ms = bench_graph(functools.partial(decode, tiles=row_tiles))
                extra = ""
                if BASELINE:
                    kwargs = {k: v for k, v in decode.keywords.items() if k != "workspace"}
                    base = functools.partial(BASELINE[0].paged_decode, *decode.args, **kwargs)
                    extra = f" {bench_graph(base):.3f} |"
                nbytes = batch * decode_bytes(ctx, sbs, local, vs, step)
                frac = nbytes / full
                tbs = nbytes / ms / 1e9
                emit(f"| {batch} | {ctx} | {name} | {frac:.3f} | {ms:.4f} | {tbs:.2f} | "
                     f"{100 * tbs / copy_tbs:.0f}% | {plain:.4f} | {plain * frac:.4f} | "
                     f"{ms / plain:.2f} | {ms / (plain * frac):.2f} |" + extra)
            del case
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lens", default="8192,16384,32768")
    parser.add_argument("--ctxs", default="8192,32768")
    parser.add_argument("--batches", default="32,1")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--local-blocks", type=int, default=4)
    parser.add_argument("--tiles", action="store_true", help="also time q tiles 64 and 128")
    parser.add_argument("--sections", default="prefill,decode")
    parser.add_argument("--baseline", default=None, help="an older blocksparse.py to time beside")
    parser.add_argument("--sweep", action="store_true",
                        help="time decode tiles first and use the best for every row")
    parser.add_argument("--warm", type=int, default=0,
                        help="compile the decode variants in this many processes first")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.out:
        OUT.append(args.out)
    if args.baseline:
        load_baseline(args.baseline)
    emit(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
         f"triton {triton.__version__}")
    if "prefill" in args.sections:
        section_prefill([int(x) for x in args.lens.split(",")], args.block_size,
                        args.local_blocks, args.tiles)
    if "decode" in args.sections:
        sweep = [(64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (32, 4, 4)] \
            if args.sweep else ()
        if args.warm:
            warm_decode(sweep, args.warm)
        ctxs = [int(x) for x in args.ctxs.split(",")]
        tiles = pick_tiles(sweep, ctxs[-1]) if sweep else None
        section_decode([int(x) for x in args.batches.split(",")], ctxs, sweep,
                       copy_bandwidth(), tiles)


if __name__ == "__main__":
    main()
