"""Block-sparse decode variants beside dense decode over the same cache, checked and timed in
one run (issue 41's block-sparse target: <= 1.05x dense decode x blocks read).

    bash -c '. tools/device_env.sh && python tools/ab_blocksparse_decode.py \
        --out $OUT/ab_blocksparse_decode.md' [--rows B32L32k,B64L16k] [--rounds 5]
        [--variants "default;short fill;..."] [--patterns p1,p8,h8] [--kv e4m3] [--warm 12]

Rows (issue 19's decode rows, and B64 L16k): a batch of one-token queries, 32 q / 8 KV
heads, head 128, a bf16 q over a bf16 (or, --kv e4m3, an fp8) cache, cache block 16
(shuffled blocks); patterns per head (vert_stride 1/2/4/8/16) and homo_head (4/8), sparse
block 64, local 4. The v0 caches of the block-sparse op and FLASH_ATTN's cache are views of
one buffer, so both read the same bytes (as benchmarks/bench_blocksparse.py does). A variant
is `launch.SWITCHES`' block-sparse fields (`VARIANTS`; the others at their defaults):
`blocksparse_decode_tiles` (BLOCK_N, warps, stages[, maxnreg]), `blocksparse_decode_splits`
(None: auto_splits; "waves": the dense pass's wave-filling count; "short fill": the same
model with a one-tile fill; an int: that count), `blocksparse_decode_key_lines` (K gathered
as whole 128-byte lines), `blocksparse_decode_page_lines` (K as lines from one table entry
a page; V likewise over fp8 caches, by key over others unless
`blocksparse_decode_value_lines`) and `blocksparse_decode_slot_sums` (row sums kept per key
slot, summed after the key loop). Per row each variant's output is first checked against the
float64 oracle (tests/reference.py, the pattern's mask, every head) on sampled sequences,
outputs poisoned before; then the dense decode's and every variant's CUDA graphs are
replayed in turn, the order rotated each round, and a time is the median over rounds.
Columns: ms, the ratio to dense ms x blocks read (the target: <= 1.05), GB/s of the bytes
the pattern reads (the union of a KV head's query heads' blocks), and the split count.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent / "benchmarks", HERE.parent / "tests"):  # timing; reference
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
from bench_blocksparse import FAMILIES, decode_bytes  # noqa: E402
from timing import Emitter, capture_graph, replay_rounds  # noqa: E402

import reference  # noqa: E402
from pagedattn.ops.paged_attn import PagedAttention  # noqa: E402
from pagedattn.ops.triton import blocksparse_decode as kernels  # noqa: E402
from pagedattn.ops.triton import launch  # noqa: E402
from pagedattn.ops.triton.op_plans import varlen_attention  # noqa: E402

H, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
ROWS = {"B32L32k": (32, 32768), "B64L16k": (64, 16384)}
# (family, vert_stride, sparse block, local_blocks): issue 19's decode rows
PATTERNS = ([("per head", vs, 64, 4) for vs in (1, 2, 4, 8, 16)]
            + [("homo_head", vs, 64, 4) for vs in (4, 8)])
# name -> the block-sparse `launch.SWITCHES` it sets (the rest at their defaults): tiles
# (BLOCK_N, warps, stages[, maxnreg]), splits (None: auto_splits; "waves"; "short fill"; an
# int: that count), key_lines (None: over 16-bit caches), page_lines (None: over fp8 caches),
# slot_sums (row sums kept per key slot through the loop; off by default), value_lines (under
# page lines, V as lines too; None: over fp8 caches, else V by key).
KNOBS = ("tiles", "splits", "key_lines", "page_lines", "slot_sums", "value_lines")
DEFAULTS = dict(tiles=None, splits="short fill", key_lines=None, page_lines=None,
                slot_sums=False, value_lines=None)


def variant(tiles=None, splits="short fill", key_lines=None, page_lines=None,
            slot_sums=False, value_lines=None) -> dict:
    return dict(tiles=tiles, splits=splits, key_lines=key_lines, page_lines=page_lines,
                slot_sums=slot_sums, value_lines=value_lines)


VARIANTS = {
    "today": variant(splits=None, key_lines=False),  # before v29: 64 keys, 4 warps, 3 stages
    "waves": variant(key_lines=False),
    "128 keys, 168 regs": variant((128, 4, 2, 168), None, False),  # three an SM, as dense
    "128 keys, 168 regs, waves": variant((128, 4, 2, 168), "waves", False),
    "128 keys": variant((128, 4, 2), None, False),  # 204 registers: two programs an SM
    # K gathered as whole 128-byte lines (KERNEL_NOTES v28): 138-168 registers, three
    # programs an SM at 64 and at 128 keys (no cap needed)
    "key lines": variant(None, None, True),
    "key lines, waves": variant(None, "waves", True),
    "key lines, 128 keys": variant((128, 4, 2), None, True),
    "key lines, 128 keys, waves": variant((128, 4, 2), "waves", True),
    # v31's candidates for the homo-head rows, each beside the default (key lines over
    # 16-bit caches, 128-key tiles, "waves"): the one-tile fill's splits; forced split
    # counts; four programs an SM (64-key tiles, one buffer, 128 registers); and key lines
    # over every cache (fp8: --kv e4m3).
    "default": variant(),
    "short fill": variant(splits="short fill"),
    "2 splits": variant(splits=2),
    "3 splits": variant(splits=3),
    "64 keys, 2 stages, 128 regs": variant((64, 4, 2, 128), key_lines=True),
    "64 keys, 2 stages, 128 regs, 2 splits": variant(
        (64, 4, 2, 128), 2, True),  # B64 L16k homo head: 1,024 programs, 1.94 waves of 4
    # the defaults before v31's outcome (128-key tiles, "waves"; key lines as over bf16)
    "before (128 keys, waves)": variant((128, 4, 2), "waves", True),
    "key lines on": variant(key_lines=True),
    # v42's candidates over fp8 caches (--kv e4m3): the default's 128-key tiles capped at
    # 168 registers (per head vert 8's row masks take 192: two programs an SM, not three);
    # K and V from one table entry a page, V as whole lines too (`page_lines`), alone,
    # capped, and in four-an-SM tiles ("64 keys, 2 stages, 128 regs" is their wave model's
    # tuple, so the split rule models four an SM for them too).
    "168 regs": variant((128, 4, 2, 168)),
    "page lines": variant(page_lines=True),
    "page lines, 168 regs": variant((128, 4, 2, 168), page_lines=True),
    "page lines, 64 keys, 2 stages, 128 regs": variant((64, 4, 2, 128), page_lines=True),
    # v49: the fp8 default before page lines (its tiles were then uncapped), and page lines
    # over bf16 (--kv auto), where None leaves them off
    "no page lines, 128 keys": variant((128, 4, 2), page_lines=False),
    "no page lines": variant(page_lines=False),
    # v51's candidates over bf16 caches (the default --kv; sm_90 SASS, 32 q / 8 KV heads,
    # head 128, tools/blocksparse_sass.py --kv bf16; "per key": the key loop's instructions
    # a key, p1 / p8 / h8; the default 4.50 / 5.20 / 4.97 and 11 barriers a trip, "168
    # regs" 3.05 / 4.65 / 3.16 and 10). Over bf16 "page lines" above take K from an entry
    # a page and V by its [N, D] load from an entry a key (16-byte cp.async already; as
    # the dot's direct operand it holds no registers the lines' permuted V does):
    # 3.94 / 4.83 / 4.30, 9 barriers; "page lines, 168 regs" (128-key tiles) 2.91 / 4.48 /
    # 3.00, 10 barriers, no spills (V as lines there: 14 spill instructions, 2 LDL a trip).
    # Row sums per key slot (`slot_sums`) take the sum's cross-warp round trip (3 barriers)
    # out of the loop: with page lines 3.50 / 4.36 / 3.88 at 64 keys, 2.70 / 4.35 / 2.81 at
    # 128 keys capped at 168 registers (three an SM, no spills). "page lines, value lines":
    # the fp8 form over bf16 (V as lines too), 3.84 / 4.83 / 4.19, 8 barriers.
    "page lines, slot sums": variant(page_lines=True, slot_sums=True),
    "page lines, slot sums, 168 regs": variant((128, 4, 2, 168), page_lines=True,
                                               slot_sums=True),
    "slot sums, 168 regs": variant((128, 4, 2, 168), slot_sums=True),
    "page lines, value lines": variant(page_lines=True, value_lines=True),
}
# --patterns keys: p<vert_stride> per head, h<vert_stride> homo_head
PATTERN_KEYS = {f"{'p' if family == 'per head' else 'h'}{vs}": (family, vs, sbs, local)
                for family, vs, sbs, local in PATTERNS}
SAMPLED_SEQS = 2  # sequences per row checked against the oracle (every head)
# max abs error of an output: bf16 (the GPU tests' bf16 bound); over an e4m3 cache q and P
# meet K and V in fp16 (the oracle reads the cache's own fp8 values)
TOLERANCE = {"bf16": 2e-2, "e4m3": 4e-2}
KV_DTYPES = {"bf16": DT, "e4m3": torch.float8_e4m3fn}


def switched(name: str) -> None:
    for knob, value in VARIANTS[name].items():
        setattr(launch.SWITCHES, f"blocksparse_decode_{knob}", value)


def restore() -> None:
    for knob, value in DEFAULTS.items():
        setattr(launch.SWITCHES, f"blocksparse_decode_{knob}", value)


def gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache[pages] as float64, indexed through an integer view (fp8 tensors index too)."""
    bits = {1: torch.uint8, 2: torch.int16}[cache.element_size()]
    return cache.view(bits)[pages].view(cache.dtype).double()


class Cache:
    """One batch's K/V bytes as the v0 caches and as FLASH_ATTN's paged cache."""

    def __init__(self, batch: int, ctx: int, kv_dtype: torch.dtype = DT):
        blocks = -(-ctx // PAGE)
        self.kv = torch.randn(2, batch * blocks, PAGE * HKV * D, device="cuda",
                              dtype=DT).to(kv_dtype)
        fp8 = kv_dtype.itemsize == 1
        one = torch.ones((), device="cuda")
        self.scale = one if fp8 else None  # the block-sparse op's k / v scales
        self.descale = one.expand(batch, HKV) if fp8 else None  # the dense pass's
        self.kc, self.vc = PagedAttention.split_kv_cache(self.kv, HKV, D)
        self.flash = self.kv.view(2, batch * blocks, PAGE, HKV, D)
        self.table = torch.randperm(batch * blocks, device="cuda",
                                    dtype=torch.int32).view(batch, blocks)
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch, H, D, device="cuda", dtype=DT)
        self.out = torch.empty_like(self.q)
        self.cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        self.batch, self.ctx = batch, ctx

    def dense(self) -> None:
        varlen_attention(
            self.q, self.flash[0], self.flash[1], self.out, cu_seqlens_q=self.cu,
            seqused_k=self.lens, cu_seqlens_k=None, block_table=self.table, max_seqlen_q=1,
            max_seqlen_k=self.ctx, softmax_scale=D ** -0.5, causal=True, window_left=-1,
            window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None, q_descale=None,
            k_descale=self.descale, v_descale=self.descale, softmax_lse=None)

    def sparse(self, pattern, workspace, num_splits: int = 0) -> None:
        family, vs, sbs, local = pattern
        kernels.paged_decode(
            self.q, self.kc, self.vc, self.out, block_tables=self.table, seq_lens=self.lens,
            scale=D ** -0.5, head_base=0, head_sliding_step=FAMILIES[family], block_size=sbs,
            local_blocks=local, vert_stride=vs, alibi_slopes=None, k_scale=self.scale,
            v_scale=self.scale, max_seq_len=self.ctx, workspace=workspace,
            num_splits=num_splits)

    def oracle(self, pattern, seqs: list[int]) -> torch.Tensor:
        """float64 outputs [len(seqs), H, D] under the pattern's mask (the v0 view's K/V)."""
        family, vs, sbs, local = pattern
        step = FAMILIES[family]

        def mask(h, q_pos, k_pos):
            return reference.blocksparse_visible(
                q_pos, k_pos, offset=reference.blocksparse_offset(h, H // HKV, step),
                block_size=sbs, local_blocks=local, vert_stride=vs)

        outs = []
        for s in seqs:
            pages = self.table[s].long()
            k = gather(self.kc, pages).permute(0, 3, 1, 2, 4).reshape(-1, HKV, D)[:self.ctx]
            v = gather(self.vc, pages).permute(0, 3, 1, 2).reshape(-1, HKV, D)[:self.ctx]
            o, _ = reference.attend_one_sequence(self.q[s:s + 1], k, v, scale=D ** -0.5,
                                                 head_mask=mask)
            outs.append(o)
        return torch.cat(outs)


def _warm_one(job) -> None:
    """Compile one variant's kernels for one pattern, unsplit and split, over a small cache
    with the rows' argument specialisation (Triton's cache then serves the timed run)."""
    name, key, kv = job
    switched(name)
    cache = Cache(1, 4096, KV_DTYPES[kv])
    workspace = kernels.decode_workspace(torch.device("cuda"), 1, H, HKV, D)
    for splits in (1, 2):
        cache.sparse(PATTERN_KEYS[key], workspace, splits)
    torch.cuda.synchronize()


def warm(names: list[str], keys: list[str], kv: str, workers: int) -> None:
    """Compile every (variant, pattern) in `workers` processes first (one process compiles
    one kernel at a time; the device's cores compile them side by side)."""
    import multiprocessing
    jobs = [(name, key, kv) for name in names for key in keys]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_warm_one, jobs, chunksize=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--variants", default=";".join(VARIANTS),
                    help="variant names separated by ';' (names hold commas)")
    ap.add_argument("--patterns", default=",".join(PATTERN_KEYS),
                    help="p<vert_stride> (per head) and h<vert_stride> (homo_head) keys, "
                         f"comma-separated, of {','.join(PATTERN_KEYS)}")
    ap.add_argument("--kv", default="bf16", choices=list(KV_DTYPES),
                    help="the cache's dtype (q and outputs stay bf16)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=10, help="graph replays per timing")
    ap.add_argument("--out", default=None)
    ap.add_argument("--warm", type=int, default=0,
                    help="processes that compile every variant's kernels first (0: none)")
    args = ap.parse_args()
    names = [n.strip() for n in args.variants.split(";")]
    for name in names:
        if name not in VARIANTS:
            ap.error(f"--variants: {name!r} is not one of {list(VARIANTS)}")
    keys = [k.strip() for k in args.patterns.split(",")]
    for key in keys:
        if key not in PATTERN_KEYS:
            ap.error(f"--patterns: {key!r} is not one of {list(PATTERN_KEYS)}")
    patterns = [PATTERN_KEYS[k] for k in keys]
    if args.warm:
        warm(names, keys, args.kv, args.warm)
    emit = Emitter()
    emit.to_file(args.out)
    device = torch.device("cuda")
    emit(f"{torch.cuda.get_device_name()}; SMs {launch.sm_count(device)}; {args.kv} cache; "
         f"{args.rounds} rounds of {args.replays} graph replays, medians")
    kv_dtype, tolerance = KV_DTYPES[args.kv], TOLERANCE[args.kv]
    emit("| row | pattern (family, vert_stride, sparse block, local) | blocks read | variant "
         "| splits | max / mean abs error | ms | / (dense x read) | GB/s |")
    emit("|---|---|---:|---|---:|---|---:|---:|---:|")
    failed = False
    for row in args.rows.split(","):
        cache = Cache(*ROWS[row], kv_dtype)
        seqs = sorted(torch.randperm(cache.batch)[:SAMPLED_SEQS].tolist())
        size = kv_dtype.itemsize
        full = cache.batch * cache.ctx * HKV * D * 2 * size
        replay_rounds({"dense": capture_graph(cache.dense)}, 1, args.replays)  # warm the clocks
        for pattern in patterns:
            family, vs, sbs, local = pattern
            nbytes = (cache.batch * decode_bytes(cache.ctx, sbs, local, vs, FAMILIES[family])
                      * size // 2)  # decode_bytes counts 16-bit K and V
            want = cache.oracle(pattern, seqs)
            graphs, errors, splits = {"dense": capture_graph(cache.dense)}, {}, {}
            # A graph does not keep the tensors it was captured over alive: each variant's
            # split scratch lives as long as its graph. (Dropped, its memory went to the next
            # allocation while the graph still wrote there: the likely cause of v24's crash
            # with several variants in one process.)
            scratch = {}
            for name in names:
                switched(name)
                splits[name] = kernels.split_count(device, cache.batch, H, HKV, cache.ctx,
                                                   FAMILIES[family], sbs, local, vs, size)
                workspace = scratch[name] = kernels.decode_workspace(device, cache.batch, H,
                                                                     HKV, D)
                cache.out.fill_(float("nan"))
                cache.sparse(pattern, workspace)
                torch.cuda.synchronize()
                got = cache.out[seqs].double().cpu()
                diff = (got - want).abs()
                errors[name] = (diff.max().item(), diff.mean().item())
                failed |= not errors[name][0] <= tolerance
                graphs[name] = capture_graph(functools.partial(cache.sparse, pattern, workspace))
            restore()
            ms = replay_rounds(graphs, args.rounds, args.replays)
            dense = ms["dense"]
            frac = nbytes / full
            name_p = f"{family}, {vs}, {sbs}, {local}"
            dense_splits = launch.decode_splits(launch.sm_count(device), cache.batch * HKV,
                                                cache.ctx, size)
            emit(f"| {row} | {name_p} | {frac:.3f} | dense (all blocks) | {dense_splits}"
                 f" | - | {dense:.4f} | - | {full / (dense * 1e-3) / 1e9:.0f} |")
            for name in names:
                emit(f"| {row} | {name_p} | {frac:.3f} | {name} | {splits[name]} | "
                     f"{errors[name][0]:.1e} / {errors[name][1]:.1e} | {ms[name]:.4f} | "
                     f"{ms[name] / (dense * frac):.3f} | "
                     f"{nbytes / (ms[name] * 1e-3) / 1e9:.0f} |")
            del graphs, scratch
        del cache
        torch.cuda.empty_cache()
    restore()
    if failed:
        sys.exit(f"a variant's error exceeds {tolerance}")


if __name__ == "__main__":
    main()
