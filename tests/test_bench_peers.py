"""The peer benchmarks' parts that run without a GPU (issues 40 and 41): alternated timings,
the FA3 loader, dense copies of a paged cache, the error against the oracle on sampled
rows, the prefill and decode rows' calls (the Triton interpreter runs ours), the ncu
summary's readers, and tools/gpu_peers.sh's steps with stand-ins for `python3` and `ncu`."""

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import reference as ref

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


def _paged(cache_dtype, seq_lens, heads=2, d=16, page=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(s / page) for s in seq_lens]
    cache = torch.randn(sum(blocks), page, heads, d, generator=g).to(cache_dtype)
    perm = torch.randperm(sum(blocks), generator=g).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = perm[start:start + n]
        start += n
    return cache, table


def _cell(text: str) -> tuple[float, float]:
    """An error cell "max / mean" as numbers."""
    a, b = text.split(" / ")
    return float(a), float(b)


# --- timing.alternate ------------------------------------------------------------------------
def test_alternate_rotates_the_order_and_takes_medians():
    from timing import alternate

    order, times = [], {"a": [3.0, 1.0, 2.0], "b": [5.0, 5.0, 4.0]}

    def timer(name):
        def run(fn):
            order.append(name)
            fn()
            return times[name].pop(0)
        return run

    def failing(fn):
        order.append("c")
        raise RuntimeError("no kernel")

    got = alternate([("a", timer("a"), lambda: None), ("b", timer("b"), lambda: None),
                     ("c", failing, lambda: None)], rounds=3)
    # rounds start at a, b, c in turn; c failed once and is not run again
    assert order == ["a", "b", "c", "b", "a", "a", "b"]
    assert got["a"] == (2.0, None)
    assert got["b"] == (5.0, None)
    assert math.isnan(got["c"][0]) and got["c"][1] == "RuntimeError: no kernel"


# --- peers: FA3's loader, dense rows ------------------------------------------------------
def test_fa3_loader_bridges_its_config_module_and_calls_the_varlen_forward(tmp_path,
                                                                          monkeypatch):
    import peers

    names = ("fa3_fwd_config", "fa3_fwd_interface", "flash_attn_config")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the bridge's folder goes on it
    peers.fa3.cache_clear()
    try:
        module, why = peers.fa3()
        assert module is None and why.startswith("not installed")
        (tmp_path / "fa3_fwd_config.py").write_text("CONFIG = {'build_flags': {}}\n")
        (tmp_path / "fa3_fwd_interface.py").write_text(
            "from flash_attn_config import CONFIG\n"  # the wheel reads it under this name
            "CALLS = []\n"
            "def _flash_attn_forward(q, k, v, **kw):\n"
            "    CALLS.append((q, k, v, kw))\n"
            "    return q + 1, None, None, None\n")
        sys.path.insert(0, str(tmp_path))
        peers.fa3.cache_clear()
        module, why = peers.fa3()
        assert why == "" and module.CONFIG is sys.modules["fa3_fwd_config"].CONFIG
        q, k = torch.zeros(3, 4, 8), torch.ones(5, 2, 8)
        cu_q, cu_k = torch.tensor([0, 3]), torch.tensor([0, 5])
        descale = torch.ones(()).expand(1, 2)
        out = peers.fa3_varlen(module, q, k, k, cu_q, cu_k, 3, 5, 0.5, descale=descale)()
        assert torch.equal(out, q + 1)
        (_, _, _, kw), = module.CALLS
        assert kw["cu_seqlens_q"] is cu_q and kw["cu_seqlens_k"] is cu_k
        assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"]) == (3, 5, 0.5)
        assert kw["causal"] is True and kw["num_splits"] == 0
        assert all(kw[f"{x}_descale"] is descale for x in "qkv")
    finally:
        for name in names:
            sys.modules.pop(name, None)
        peers.fa3.cache_clear()


def test_vllm_loader_says_not_installed():
    import peers

    fn, why = peers.vllm_unified()
    if fn is None:
        assert why == "not installed" or why.startswith("failed to import")


@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3])
def test_paged_rows_copy_the_cache_bits(dtype):
    import peers

    cache, table = _paged(dtype, [9, 6, 1])
    got = peers.paged_rows(cache, table, [(0, 0, 9), (1, 2, 5), (2, 0, 1)])
    want = torch.cat([ref.gather_paged(cache.view(torch.uint8) if dtype == E4M3 else cache,
                                       table[r], hi)[lo:hi]
                      for r, lo, hi in [(0, 0, 9), (1, 2, 5), (2, 0, 1)]])
    assert got.dtype == dtype and got.shape == (13, 2, 16)
    if dtype == E4M3:
        got = got.view(torch.uint8)
    assert torch.equal(got, want)


# --- sampled_error --------------------------------------------------------------------------
def test_sample_rows_are_distinct_sorted_and_spread():
    from sampled_error import sample_rows

    rows = sample_rows([512] * 32, 128)
    assert len(rows) == 128 and rows == sorted(set(rows))
    assert 0 <= rows[0] and rows[-1] < 512 * 32
    assert len({r // 512 for r in rows}) >= 24  # most requests get a row
    assert sample_rows([3, 2], 128) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("window", [-1, 3])
def test_oracle_rows_equal_the_oracle_on_the_whole_batch(window):
    from sampled_error import oracle_rows, row_errors

    query_lens, seq_lens = [4, 1, 3], [9, 6, 3]
    k_cache, table = _paged(torch.float32, seq_lens, seed=1)
    v_cache, _ = _paged(torch.float32, seq_lens, seed=2)  # other values, k_cache's table
    q = torch.randn(sum(query_lens), 4, 16)
    want, _ = ref.paged_attention(q, k_cache, v_cache, query_lens, seq_lens, table, scale=0.25,
                                  window=(window, -1))
    k_rows = torch.cat([ref.gather_paged(k_cache, table[r], s) for r, s in enumerate(seq_lens)])
    v_rows = torch.cat([ref.gather_paged(v_cache, table[r], s) for r, s in enumerate(seq_lens)])
    rows = [0, 3, 4, 5, 7]
    got = oracle_rows(q, k_rows, v_rows, query_lens, seq_lens, rows, 0.25, window)
    torch.testing.assert_close(got, want[rows], rtol=0, atol=1e-12)
    out = want.float().clone()
    assert row_errors(out, rows, got)[0] < 1e-6
    out[5, 1, 2] += 0.25
    assert row_errors(out, rows, got)[0] == pytest.approx(0.25, abs=1e-6)
    out[7] = float("nan")  # a row the kernel never wrote
    assert math.isnan(row_errors(out, rows, got)[0])


# --- the prefill rows (bench_prefill.Prefill on the CPU; ours under the interpreter) --------
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3])
def test_prefill_rows_check_every_path_against_the_oracle(cache_dtype, monkeypatch):
    import bench_prefill as bp

    monkeypatch.setattr(bp, "DEV", "cpu")
    torch.manual_seed(0)
    p = bp.Prefill([5, 3], [9, 3], heads=4, kv_heads=2, d=16, cache_dtype=cache_dtype,
                   q_dtype=cache_dtype)
    # the new tokens' keys are the cache's (a path reading them as rows agrees with the pages)
    k_rows, v_rows, cu_k = p.dense_kv
    assert cu_k.tolist() == [0, 9, 12]
    assert torch.equal(p.k_new, torch.cat([k_rows[4:9], k_rows[9:12]]).to(torch.bfloat16))
    assert torch.equal(p.v_new, torch.cat([v_rows[4:9], v_rows[9:12]]).to(torch.bfloat16))
    run, _ = p.engine()
    want = p.oracle(list(range(8)))

    def exact():
        return want.to(torch.bfloat16)

    def broken():
        raise RuntimeError("bad launch")

    monkeypatch.setattr(bp, "SAMPLED_ROWS", 8)
    cells = bp.row_errors_of(p, {"engine": run, "op": p.op(), "fa3": None, "exact": exact,
                                 "broken": broken})
    bound = 0.05 if cache_dtype == E4M3 else 0.02
    for name in ("engine", "op"):
        worst, mean = _cell(cells[name])
        assert worst < bound and mean < worst
    assert _cell(cells["exact"])[0] < 0.01
    assert cells["fa3"] == "-" and cells["broken"].startswith("failed (RuntimeError")
    call, why = p.fa3()
    assert call is None and why.startswith("not installed")  # the columns say so


def test_prefill_tables_print_every_row_and_survive_a_failing_one(monkeypatch):
    import bench_prefill as bp

    monkeypatch.setattr(bp, "DEV", "cpu")
    monkeypatch.setattr(bp, "FLEX_LABELS", [])
    monkeypatch.setattr(bp, "SAMPLED_ROWS", 8)
    calls = []

    def timer(fn):  # one call a timing: the interpreter is slow, and its times mean nothing
        calls.append(fn)
        fn()
        return 1e-6

    monkeypatch.setattr(bp, "bench", timer)
    torch.manual_seed(0)
    lines: list[str] = []
    bp.emit_table([("tiny", [5, 3], [9, 3], 4, 2, 16), ("broken", [], [], 4, 2, 16)],
                  lines.append, rounds=1)
    bp.emit_fp8_table([("tiny fp8", [6], [6], 4, 2, 16)], lines.append, rounds=1)
    header = next(i for i, line in enumerate(lines) if line.startswith("| prompts |"))
    assert lines[0].startswith("FlashAttention-3 (fa3-fwd): not installed")
    cells = lines[header + 2].split(" | ")
    assert cells[0].startswith("| tiny [") and len(cells) == 15
    assert all(float(c) > 0 for c in cells[1:4])  # TFLOP/s of our three columns
    assert cells[4:7] == ["-", "-", "-"]  # FA3 and its ratios, not installed here
    assert _cell(cells[12])[0] < 0.02 and _cell(cells[13])[0] < 0.02 and cells[14] == "- |"
    assert lines[header + 3].startswith("| broken | failed: ValueError")
    cells = next(line for line in lines if line.startswith("| tiny fp8 [")).split(" | ")
    assert len(cells) == 11 and _cell(cells[8])[0] < 0.05 and cells[3] == "-"
    assert len(calls) == 3 + 2  # one round: engine, other, op; then engine, op


def test_prefill_rows_and_flags_are_the_issues():
    import bench_kernels
    import bench_prefill as bp

    assert [r[0] for r in bp.MAIN_ROWS] == [
        "1 x 8192", "1 x 16384", "8 x 2048", "32 x 512", "1 x 8192, head 64",
        "8 x 2048, head 64", "1 x 8192, head 256", "8 x 2048, head 256",
        "2048 after 30720 cached"]
    assert [(r[0], r[5]) for r in bp.FP8_ROWS] == [
        ("1 x 8192", 128), ("8 x 2048", 128), ("2048 after 30720 cached", 128),
        ("32 x 512", 128), ("1 x 8192, head 64", 64), ("1 x 8192, head 256", 256)]
    assert all(r[3] == 16 for r in bp.MAIN_ROWS + bp.FP8_ROWS if r[5] == 256)
    args = bp.parse_args(["--rows", "main,fp8", "--flex", "", "--rounds", "2", "--out", "x.md"])
    assert (args.rows, args.flex, args.rounds, args.out) == ("main,fp8", "", 2, "x.md")
    assert bp.parse_args([]).rounds == 3
    args = bench_kernels.parse_args(["--sections", "decode", "--rounds", "5"])
    assert (args.sections, args.rounds) == ("decode", 5)


# --- the decode rows ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3])
def test_decode_batch_runs_the_engine_path_over_the_paged_cache(dtype):
    from decode_peers import DecodeBatch

    torch.manual_seed(0)
    b = DecodeBatch(2, 40, dtype, device="cpu")
    assert b.kv_bytes == 2 * 2 * 40 * 8 * 128 * dtype.itemsize
    b.out.fill_(float("nan"))
    b.engine()()
    want, _ = ref.paged_attention(b.q.float(), b.k.float(), b.v.float(), [1, 1], [40, 40],
                                  b.block_table, scale=128 ** -0.5)
    torch.testing.assert_close(b.out.double(), want, atol=2e-2, rtol=2e-2)
    (decode,) = b.passes()
    assert decode["name"] == "decode" and decode["kernel"] == "attention_kernel"
    assert decode["grid"] == [2, 8, 1] and b.splits() == 1
    k_rows, v_rows = b.dense
    assert torch.equal(k_rows[40:].float(), ref.gather_paged(b.k.float(), b.block_table[1], 40))
    assert torch.equal(v_rows[:40].float(), ref.gather_paged(b.v.float(), b.block_table[0], 40))


@pytest.mark.parametrize("launch, splits", [
    (SimpleNamespace(grid=(4, 8, 3), num_splits=3), 3),  # the grid form: its third axis
    (SimpleNamespace(grid=(264,), num_splits=2), 2)])    # persistent: the programs alone
def test_decode_splits_come_from_the_gluon_launchs_count(launch, splits):
    from decode_peers import DecodeBatch

    b = DecodeBatch(2, 40, torch.bfloat16, device="cpu")
    b.plan = SimpleNamespace(gluon_decode=launch, launches=())
    assert b.splits() == splits


def test_decode_tables_give_rates_ratios_and_failures():
    import decode_peers

    nan = float("nan")
    timed = {"ours bf16|graph": (1.0, None), "FA3 bf16|graph": (1.25, None),
             "SDPA cuDNN|graph": (2.0, None), "ours fp8|graph": (0.5, None),
             "FA3 fp8|graph": (nan, "RuntimeError: no fp8"), "ours bf16|eager": (1.1, None)}
    result = dict(label="B8 L128k", timed=timed, splits=(5, 4),
                  bytes={"bf16": 4_000_000_000, "fp8": 2_000_000_000})
    lines = decode_peers.tables([result])
    assert decode_peers.DECODE_ROWS[-1] == ("B8 L128k", 8, 131072)
    assert ("| B8 L128k [5 / 4] | 4000 | 3200 | 1.25 | 2000 | 2.00 | - | - | 4000 | - | - | "
            "2.00 |") in lines
    assert "| B8 L128k | 1.0000 | 1.2500 | 2.0000 | - | 0.5000 | - |" in lines
    assert "| B8 L128k [5 / 4] | 3636 | - | - | - | - | - | - | - | - | - | - |" in lines
    assert lines[-1] == "failed: B8 L128k, FA3 fp8 graph: RuntimeError: no fp8"


def test_decode_rows_survive_a_row_that_fails(monkeypatch):
    import decode_peers

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(decode_peers, "DecodeBatch", no_memory)
    results = decode_peers.measure_rows([("B8 L128k", 8, 131072)], progress=lambda *a, **k: 0)
    lines = decode_peers.tables(results)
    assert "| B8 L128k [- / -] | - | - | - | - | - | - | - | - | - | - | - |" in lines
    assert lines[-1] == "failed: B8 L128k, row: OutOfMemoryError: CUDA out of memory"


# --- ncu_decode's summary -------------------------------------------------------------------
RAW_HEADER = ["ID", "Kernel Name", "Grid Size", "gpu__time_duration.sum", "dram__bytes_read.sum",
              "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
              "launch__occupancy_limit_registers", "launch__occupancy_limit_shared_mem",
              "launch__occupancy_limit_warps", "launch__occupancy_limit_blocks",
              "launch__registers_per_thread", "launch__shared_mem_per_block_dynamic",
              "launch__shared_mem_per_block_static", "sm__maximum_warps_per_active_cycle_pct",
              "sm__warps_active.avg.pct_of_peak_sustained_active",
              "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
              "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
              "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts_cache_bypass.sum",
              "l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts_cache_bypass.sum",
              "smsp__sass_inst_executed_op_memory_128b.sum"]
RAW_UNITS = ["", "", "", "usecond", "Mbyte", "%", "block", "block", "block", "block",
             "register/thread", "byte", "byte", "%", "%", "sector", "request", "sector",
             "request", "inst"]
SASS_HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
               "Thread Instructions Executed", "Predicated-On Thread Instructions Executed",
               "stall_long_sb", "Instructions Executed"]


def _manifest():
    def case(name, label, batch, ctx, passes):
        return dict(name=name, label=label, batch=batch, ctx=ctx, runs=2, splits=passes[0][1][2],
                    kv_bytes=2 * batch * ctx * 8 * 128 * 2,
                    passes=[dict(name=n, kernel=k, grid=list(g), num_warps=4, num_stages=2,
                                 block_m=16, block_n=128) for n, g, k in
                            [(p[0], p[1], p[2]) for p in passes]])
    return dict(sm_count=132, cases=[
        case("b64_l16k_bf16", "B64 L16k bf16", 64, 16384,
             [("decode", (64, 8, 1), "attention_kernel")]),
        case("b8_l128k_bf16", "B8 L128k bf16", 8, 131072,
             [("decode", (8, 8, 5), "attention_kernel"),
              ("reduce", (8, 32, 1), "reduce_splits_kernel")])])


def _raw_rows():
    def row(i, name, us, dram_mb):
        return [str(i), name, "(64, 8, 1)", us, dram_mb, "92.5", "2", "1", "16", "32", "128",
                "131,072", "0", "25", "22.5", "1,000", "250", "16,000", "1,000", "1,000,000"]
    return [row(0, "attention_kernel", "1,100", "4,300"), row(1, "attention_kernel", "1,000",
                                                               "4,300"),
            row(2, "attention_kernel", "950", "4,300"), row(3, "reduce_splits_kernel", "95", "1"),
            row(4, "attention_kernel", "900", "4,300"), row(5, "reduce_splits_kernel", "100",
                                                            "1")]


def _write_exports(folder: Path) -> None:
    with open(folder / "raw.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerows([RAW_HEADER, RAW_UNITS, *_raw_rows()])
    for case in ("b64_l16k_bf16", "b8_l128k_bf16"):
        with open(folder / f"sass_{case}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["Kernel Name", "attention_kernel"])
            w.writerow(SASS_HEADER)
            w.writerows([
                ["0x10", "LDGSTS.E.BYPASS.LTC128B.128 [R1], desc[UR4][R2.64]", "5", "8,388,608",
                 "268,435,456", "268,435,456", "5", "8,388,608"],
                ["0x20", "@P0 LDG.E R5, desc[UR4][R6.64]", "3", "262,144", "8,388,608",
                 "8,388,608", "3", "262,144"],
                ["0x30", "LDGDEPBAR", "1", "1,000", "32,000", "32,000", "0", "1,000"],
                ["0x40", "LDG.E.64 R8, desc[UR4][R6.64]", "0", "1,000", "1,000", "1,000", "0",
                 "1,000"]])


def test_ncu_durations_in_short_units_read_as_seconds():
    import ncu_decode

    # ncu 2025 exports durations as "ns" even with --print-units base (an H200 run)
    assert ncu_decode.to_base(969568.0, "ns") == pytest.approx(969568e-9)
    assert ncu_decode.to_base(2.5, "us") == pytest.approx(2.5e-6)
    assert ncu_decode.to_base(4.0, "Gbyte") == pytest.approx(4e9)


def test_ncu_summary_reads_the_exports(tmp_path):
    import ncu_decode

    _write_exports(tmp_path)
    launches = ncu_decode.read_raw(str(tmp_path / "raw.csv"))
    assert [r["ID"] for r in launches] == [0, 1, 2, 3, 4, 5]
    assert launches[1]["gpu__time_duration.sum"] == pytest.approx(1e-3)  # "1,000" usecond
    assert launches[1]["dram__bytes_read.sum"] == pytest.approx(4.3e9)
    loads = ncu_decode.read_sass(str(tmp_path / "sass_b64_l16k_bf16.csv"))
    assert loads == {("LDGSTS", 16): 268435456, ("LDG", 4): 8388608, ("LDG", 8): 1000}
    lines = ncu_decode.summary(_manifest(), launches, str(tmp_path))
    assert not any(line.startswith("warning") for line in lines)
    text = "\n".join(lines)
    # the last run of each case: 1 ms alone; 0.9 + 0.1 ms with the reduce
    assert ("| B64 L16k bf16 | decode (64, 8, 1) x4 s2 n128 | 1 | 1000.0 | - | - | 4295 | 4300 "
            "| 92.5 |") in text
    assert "| B8 L128k bf16 | decode (8, 8, 5) x4 s2 n128; reduce (8, 32, 1) x4 s2 n128 | 5 | " \
           "900.0 | 100.0 | 10.0% | 4295 | 4778 | 92.5 |" in text
    # one CTA an SM (shared memory): 512 programs are 3.88 waves, 116 in the last
    assert "| B64 L16k bf16 | 128 | 131.1 | 1 (shared_mem) | 25.0% | 22.5% | 3.88 | 116 / 132 |" \
        in text
    assert "| B8 L128k bf16 | 128 | 131.1 | 1 (shared_mem) | 25.0% | 22.5% | 2.42 | 56 / 132 |" \
        in text
    # 16 lookups per page and KV head: one per key row
    assert "| B64 L16k bf16 | 4.0, 16.0 | 1.00M / - / - / - / - | LDGSTS 16 B 99.2%, LDG 4 B " \
           "0.8%, LDG 8 B 0.0% | 16.00 (2.00 per KiB) |" in text
    # B8 L128k: the same loads over as many pages (8 x 8 x 8192) and bytes
    assert text.count("| 16.00 (2.00 per KiB) |") == 2
    short = ncu_decode.summary(_manifest(), launches[:5], str(tmp_path))
    assert short[0].startswith("warning: 5 profiled launches, 6 expected")


def test_ncu_summary_reads_caches_stalls_and_barriers(tmp_path):
    # The columns tools/ncu_blocksparse.sh adds: --metrics, WarpStateStats, BAR in the SASS.
    import ncu_decode

    extra = {"lts__t_sector_hit_rate.pct": ("%", "12.5"),
             "lts__t_sectors_srcunit_tex_op_read.sum": ("sector", "4,000"),
             "lts__t_requests_srcunit_tex_op_read.sum": ("request", "1,000"),
             "smsp__inst_executed.sum": ("inst", "8,388,608"),
             "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": ("", "0"),
             "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio":
                 ("ratio", "3.5"),
             "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": ("ratio", "1.25"),
             "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": ("ratio", "0.5")}
    with open(tmp_path / "raw.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerows([RAW_HEADER + list(extra), RAW_UNITS + [u for u, _ in extra.values()],
                     *[r + [v for _, v in extra.values()] for r in _raw_rows()]])
    with open(tmp_path / "sass_b64_l16k_bf16.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerows([SASS_HEADER, ["0x10", "BAR.SYNC.DEFER_BLOCKING 0x0", "0", "4,096", "131,072",
                                   "131,072", "0", "4,096"]])
    manifest = _manifest()
    manifest["cases"][0]["lookups"] = 1024  # pages read: 128 tiles of 8 (a sparse case's)
    text = "\n".join(ncu_decode.summary(manifest, ncu_decode.read_raw(str(tmp_path / "raw.csv")),
                                        str(tmp_path)))
    # 4096 BAR executions over 4 warps and 128 tiles; 8M instructions over 4 GiB of K/V
    assert ("| B64 L16k bf16 | 12.5% | 4.00 | 0.00 | 2.0 | 8.0 | long_scoreboard 3.50, "
            "barrier 1.25, wait 0.50 |") in text


def test_sparse_decode_batch_counts_the_blocks_its_pattern_reads():
    # ncu_decode's block-sparse cases: the dense limit (vert_stride 1) reads every page of
    # every KV head, vert_stride 8 fewer; the switches hold only while the batch runs.
    from blocksparse_batch import SparseDecodeBatch

    from pagedattn.ops.triton import launch
    dense = SparseDecodeBatch(2, 1024, "per head", 1, device="cpu")
    assert dense.lookups == 2 * 8 * 1024 // 16 and dense.kv_bytes == 2 * 2 * 1024 * 8 * 128 * 2
    lines = SparseDecodeBatch(2, 1024, "homo_head", 8, {"blocksparse_decode_key_lines": True},
                              device="cpu")
    assert 0 < lines.lookups < dense.lookups
    assert lines.kv_bytes == lines.lookups * 2 * 16 * 128 * 2
    assert launch.SWITCHES.blocksparse_decode_key_lines is None
    (attn,) = lines.passes()
    assert attn["kernel"] == "_decode_kernel" and attn["grid"] == [2, 8, lines.splits()]


def test_ncu_launch_refuses_an_unknown_case(monkeypatch, capsys):
    import ncu_decode

    monkeypatch.setattr(sys, "argv", ["ncu_decode.py", "launch", "--cases", "b1_l1k_bf16"])
    with pytest.raises(SystemExit):
        ncu_decode.main()
    assert "b1_l1k_bf16" in capsys.readouterr().err


# --- stand-ins for python3 and ncu in the shell scripts' tests ------------------------------
OUT_ARG = r"""out=$(echo "$*" | sed 's/.*--out \([^ ]*\).*/\1/')"""  # a stub's --out file


def python_stub(arms: str) -> str:
    """A stand-in for `python3`: logs its call, answers `arms` (bash case arms) first, then
    ncu_decode.py's launch (writing the stub manifest where asked) and runs the rest."""
    return r"""#!/usr/bin/env bash
echo "python3 $*" >>"$STUB_LOG"
case "$*" in
""" + arms + r"""    *"ncu_decode.py launch"*"--manifest"*)
        cp "$STUB_MANIFEST" "$(echo "$*" | sed 's/.*--manifest \([^ ]*\).*/\1/')";;
    *"ncu_decode.py launch"*) ;;
    *) exec "$REAL_PYTHON" "$@";;
esac
"""


def ncu_stub(arms: str = "") -> str:
    """A stand-in for `ncu`: logs its call, answers --version, then `arms`, then prints the
    stub exports for --page raw / source and runs the profiled command itself."""
    return """#!/usr/bin/env bash
echo "ncu $*" >>"$STUB_LOG"
case "$*" in
    --version) echo "stub ncu";;
""" + arms + """    *"--page raw"*) cat "$STUB_EXPORTS/raw.csv";;
    *"--page source"*) cat "$STUB_EXPORTS/sass_b64_l16k_bf16.csv";;
    *) while [ "$1" != python3 ]; do shift; done; exec "$@";;
esac
"""


def stub_repo(tmp_path: Path, stub_python: str, stub_ncu: str,
              benchmarks: tuple[str, ...]) -> tuple[Path, dict[str, str]]:
    """A copy of tools/ and of `benchmarks` (those that exist) under tmp_path/repo, and the
    environment that runs a script there with stand-ins for `python3` and `ncu` first on
    PATH (ncu's exports and the launch manifest from the readers' tests above)."""
    repo, stubs, exports = tmp_path / "repo", tmp_path / "bin", tmp_path / "exports"
    shutil.copytree(ROOT / "tools", repo / "tools")
    (repo / "benchmarks").mkdir()
    for name in benchmarks:
        if (BENCH / name).exists():
            shutil.copy(BENCH / name, repo / "benchmarks" / name)
    for folder in (stubs, exports):
        folder.mkdir()
    _write_exports(exports)
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest()))
    for name, text in (("python3", stub_python), ("ncu", stub_ncu)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "NCU_REPORTS": str(tmp_path / "reports"), "STUB_LOG": str(tmp_path / "calls.log"),
           "STUB_MANIFEST": str(tmp_path / "manifest.json"), "STUB_EXPORTS": str(exports),
           "REAL_PYTHON": sys.executable, "PYTHONPATH": ""}
    env.pop("NCU", None)
    return repo, env


def run_stubbed(repo: Path, env: dict[str, str], script: str
                ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`bash script` in the stub repo: the finished process (asserted to exit 0) and the
    stand-ins' calls, one a line, of this run alone."""
    log = Path(env["STUB_LOG"])
    log.write_text("")
    done = subprocess.run(["bash", script], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done, log.read_text().splitlines()


# --- tools/gpu_peers.sh ---------------------------------------------------------------------
STUB_PYTHON = python_stub(f"""\
    *bench_prefill.py*|*bench_kernels.py*)
        {OUT_ARG}; echo "| table of $1 |" >"$out";;
""")
STUB_NCU = ncu_stub()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and timeout")
def test_gpu_peers_runs_each_step_and_prints_the_tables(tmp_path):
    repo, env = stub_repo(tmp_path, STUB_PYTHON, STUB_NCU, ("ncu_decode.py", "ncu_stalls.py"))
    done, calls = run_stubbed(repo, env, "tools/gpu_peers.sh")
    steps = [c.split(" --")[0] for c in calls]
    # decode, then ncu, then prefill (which compiles the most) with the time left
    assert steps[0] == "python3 benchmarks/bench_kernels.py" and "--sections decode" in calls[0]
    assert steps[-1] == "python3 benchmarks/bench_prefill.py"
    assert "--rows main,fp8 --flex" in calls[-1]
    profiled = [c for c in calls if c.startswith("ncu --clock-control none")]
    assert len(profiled) == 5 and "--section SourceCounters" in profiled[-1]
    assert calls[-2].startswith("python3 benchmarks/ncu_decode.py summary")
    out = tmp_path / "out"
    assert (out / "ncu" / "sass_b8_l128k_fp8.csv").exists()
    if (BENCH / "ncu_stalls.py").exists():
        assert "samples" in (out / "ncu" / "stalls_b64_l16k_bf16.md").read_text()
    tail = done.stdout[done.stdout.index("=================== prefill"):]
    assert "| table of benchmarks/bench_prefill.py |" in tail
    assert "| table of benchmarks/bench_kernels.py |" in tail
    assert "Decode under ncu: time and bytes" in tail and "| 10.0% |" in tail
    # one step alone
    done, calls = run_stubbed(repo, {**env, "STEPS": "ncu"}, "tools/gpu_peers.sh")
    assert not any("bench_" in c for c in calls)
    assert "=================== ncu" in done.stdout and "== prefill" not in done.stdout


# --- tools/ncu_blocksparse.sh ---------------------------------------------------------------
BS_STUB_PYTHON = python_stub(f"""\
    *"ab_blocksparse_decode.py"*"--rows B64L16k"*) echo "illegal address" >&2; exit 1;;
    *"ab_blocksparse_decode.py"*)
        {OUT_ARG}; echo "| ab table |" >"$out";;
""")
BS_STUB_NCU = ncu_stub("""\
    *"--metrics"*) echo "==ERROR== Failed to find metric" >&2; exit 1;;
""")


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and timeout")
def test_ncu_blocksparse_survives_failing_steps_and_prints_the_tables(tmp_path):
    # An ncu without one of the extra metrics reruns on the sections alone; the ab row that
    # crashes leaves the other's table; every case gets its SASS run.
    repo, env = stub_repo(tmp_path, BS_STUB_PYTHON, BS_STUB_NCU, ("ncu_decode.py",))
    done, calls = run_stubbed(repo, env, "tools/ncu_blocksparse.sh")
    profiled = [c for c in calls if c.startswith("ncu --clock-control none")]
    assert "--metrics lts__t_sector_hit_rate.pct" in profiled[0]
    assert "--metrics" not in profiled[1] and "_decode_kernel" in profiled[1]
    assert "--cases b32_l32k_bf16,bs_b32_l32k_per8,bs_b32_l32k_per8_lines," in profiled[1]
    assert len(profiled) == 2 + 8 and all("SourceCounters" in c for c in profiled[2:])
    ab = [c for c in calls if "ab_blocksparse_decode.py" in c]
    assert len(ab) == 2 and all("--rounds 3" in c and "--patterns p1,p8,h8" in c for c in ab)
    assert "--variants today;key lines;key lines, waves;" in ab[0]
    assert "ab B64L16k: exit 1" in done.stdout and "illegal address" in done.stdout
    out = tmp_path / "out"
    assert (out / "ncu_blocksparse" / "sass_bs_b32_l32k_homo8_lines.csv").exists()
    assert "caches, instructions and stalls" in (out / "ncu_blocksparse.md").read_text()
    assert "| ab table |" in done.stdout and "Decode under ncu: loads" in done.stdout
