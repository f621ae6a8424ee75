"""Block-sparse decode variants beside dense decode over the same cache, checked and timed in
one run (issue 41's block-sparse target: <= 1.05x dense decode x blocks read).

    bash -c '. tools/device_env.sh && python tools/ab_blocksparse_decode.py \
        --out $OUT/ab_blocksparse_decode.md' [--rows B32L32k,B64L16k] [--rounds 5]
        [--variants "today;waves;..."] [--patterns p1,p8,h8]

Rows (issue 19's decode rows, and B64 L16k): a batch of one-token queries, 32 q / 8 KV
heads, head 128, bf16, cache block 16 (shuffled blocks); patterns per head (vert_stride
1/2/4/8/16) and homo_head (4/8), sparse block 64, local 4. The v0 caches of the block-sparse
op and FLASH_ATTN's cache are views of one buffer, so both read the same bytes (as
benchmarks/bench_blocksparse.py does). A variant is `launch.SWITCHES`' block-sparse fields:
`blocksparse_decode_tiles` (BLOCK_N, warps, stages[, maxnreg]), `blocksparse_decode_splits`
(None: today's rule; "waves": the dense pass's wave-filling count) and
`blocksparse_decode_key_lines` (K gathered as whole 128-byte lines). Per row each variant's
output is first checked against the float64 oracle (tests/reference.py, the pattern's mask,
every head) on sampled sequences, outputs poisoned before; then the dense decode's and every
variant's CUDA graphs are replayed in turn, the order rotated each round, and a time is the
median over rounds. Columns: ms, the ratio to dense ms x blocks read (the target: <= 1.05),
GB/s of the bytes the pattern reads (the union of a KV head's query heads' blocks), and
the split count.
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
from pagedattn.ops.triton.attention_plan import varlen_attention  # noqa: E402

H, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
ROWS = {"B32L32k": (32, 32768), "B64L16k": (64, 16384)}
# (family, vert_stride, sparse block, local_blocks): issue 19's decode rows
PATTERNS = ([("per head", vs, 64, 4) for vs in (1, 2, 4, 8, 16)]
            + [("homo_head", vs, 64, 4) for vs in (4, 8)])
# name -> (SWITCHES.blocksparse_decode_tiles, SWITCHES.blocksparse_decode_splits,
#          SWITCHES.blocksparse_decode_key_lines)
VARIANTS = {
    "today": (None, None, False),  # 64 keys, 4 warps, 3 stages; auto_splits
    "waves": (None, "waves", False),
    "128 keys, 168 regs": ((128, 4, 2, 168), None, False),  # three programs an SM, as dense
    "128 keys, 168 regs, waves": ((128, 4, 2, 168), "waves", False),
    "128 keys": ((128, 4, 2), None, False),  # 204 registers: two programs an SM
    # K gathered as whole 128-byte lines (KERNEL_NOTES v28): 138-168 registers, three
    # programs an SM at 64 and at 128 keys (no cap needed)
    "key lines": (None, None, True),
    "key lines, waves": (None, "waves", True),
    "key lines, 128 keys": ((128, 4, 2), None, True),
    "key lines, 128 keys, waves": ((128, 4, 2), "waves", True),
}
# --patterns keys: p<vert_stride> per head, h<vert_stride> homo_head
PATTERN_KEYS = {f"{'p' if family == 'per head' else 'h'}{vs}": (family, vs, sbs, local)
                for family, vs, sbs, local in PATTERNS}
SAMPLED_SEQS = 2  # sequences per row checked against the oracle (every head)
TOLERANCE = 2e-2  # max abs error of a bf16 output (the GPU tests' bf16 bound)


def switched(name: str) -> None:
    (launch.SWITCHES.blocksparse_decode_tiles, launch.SWITCHES.blocksparse_decode_splits,
     launch.SWITCHES.blocksparse_decode_key_lines) = VARIANTS[name]


class Cache:
    """One batch's K/V bytes as the v0 caches and as FLASH_ATTN's paged cache."""

    def __init__(self, batch: int, ctx: int):
        blocks = -(-ctx // PAGE)
        self.kv = torch.randn(2, batch * blocks, PAGE * HKV * D, device="cuda", dtype=DT)
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
            k_descale=None, v_descale=None, softmax_lse=None)

    def sparse(self, pattern, workspace) -> None:
        family, vs, sbs, local = pattern
        kernels.paged_decode(
            self.q, self.kc, self.vc, self.out, block_tables=self.table, seq_lens=self.lens,
            scale=D ** -0.5, head_base=0, head_sliding_step=FAMILIES[family], block_size=sbs,
            local_blocks=local, vert_stride=vs, alibi_slopes=None, k_scale=None,
            v_scale=None, max_seq_len=self.ctx, workspace=workspace)

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
            k = self.kc[pages].permute(0, 3, 1, 2, 4).reshape(-1, HKV, D)[:self.ctx]
            v = self.vc[pages].permute(0, 3, 1, 2).reshape(-1, HKV, D)[:self.ctx]
            o, _ = reference.attend_one_sequence(self.q[s:s + 1], k, v, scale=D ** -0.5,
                                                 head_mask=mask)
            outs.append(o)
        return torch.cat(outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--variants", default=";".join(VARIANTS),
                    help="variant names separated by ';' (names hold commas)")
    ap.add_argument("--patterns", default=",".join(PATTERN_KEYS),
                    help="p<vert_stride> (per head) and h<vert_stride> (homo_head) keys, "
                         f"comma-separated, of {','.join(PATTERN_KEYS)}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=10, help="graph replays per timing")
    ap.add_argument("--out", default=None)
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
    emit = Emitter()
    emit.to_file(args.out)
    device = torch.device("cuda")
    emit(f"{torch.cuda.get_device_name()}; SMs {launch.sm_count(device)}; {args.rounds} "
         f"rounds of {args.replays} graph replays, medians")
    emit("| row | pattern (family, vert_stride, sparse block, local) | blocks read | variant "
         "| splits | max / mean abs error | ms | / (dense x read) | GB/s |")
    emit("|---|---|---:|---|---:|---|---:|---:|---:|")
    failed = False
    for row in args.rows.split(","):
        cache = Cache(*ROWS[row])
        seqs = sorted(torch.randperm(cache.batch)[:SAMPLED_SEQS].tolist())
        full = cache.batch * cache.ctx * HKV * D * 2 * 2
        replay_rounds({"dense": capture_graph(cache.dense)}, 1, args.replays)  # warm the clocks
        for pattern in patterns:
            family, vs, sbs, local = pattern
            nbytes = cache.batch * decode_bytes(cache.ctx, sbs, local, vs, FAMILIES[family])
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
                                                   FAMILIES[family], sbs, local, vs)
                workspace = scratch[name] = kernels.decode_workspace(device, cache.batch, H,
                                                                     HKV, D)
                cache.out.fill_(float("nan"))
                cache.sparse(pattern, workspace)
                torch.cuda.synchronize()
                got = cache.out[seqs].double().cpu()
                diff = (got - want).abs()
                errors[name] = (diff.max().item(), diff.mean().item())
                failed |= not errors[name][0] <= TOLERANCE
                graphs[name] = capture_graph(functools.partial(cache.sparse, pattern, workspace))
            switched("today")
            ms = replay_rounds(graphs, args.rounds, args.replays)
            dense = ms["dense"]
            frac = nbytes / full
            name_p = f"{family}, {vs}, {sbs}, {local}"
            emit(f"| {row} | {name_p} | {frac:.3f} | dense (all blocks) | "
                 f"{launch.decode_splits(launch.sm_count(device), cache.batch * HKV, cache.ctx)}"
                 f" | - | {dense:.4f} | - | {full / (dense * 1e-3) / 1e9:.0f} |")
            for name in names:
                emit(f"| {row} | {name_p} | {frac:.3f} | {name} | {splits[name]} | "
                     f"{errors[name][0]:.1e} / {errors[name][1]:.1e} | {ms[name]:.4f} | "
                     f"{ms[name] / (dense * frac):.3f} | "
                     f"{nbytes / (ms[name] * 1e-3) / 1e9:.0f} |")
            del graphs, scratch
        del cache
        torch.cuda.empty_cache()
    switched("today")
    if failed:
        sys.exit(f"a variant's error exceeds {TOLERANCE}")


if __name__ == "__main__":
    main()
