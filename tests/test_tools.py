"""The GPU-machine scripts' logic that runs without a GPU: tools/sanitize.sh's recognition of
the Gluon pass's known racecheck report, tools/pack_tcache.sh's choice of cache entries,
tools/device_env.sh's search for ncu and compute-sanitizer, the readers of ncu's and
nvidia-smi's output in tools/ (ncu_stalls.py, bench_power.py), and op_host_cost.py's
helpers."""

import csv
import functools
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "src/pagedattn/ops/triton/gluon_prefill.py"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _kernel_lines() -> tuple[int, int]:
    text = KERNEL.read_text().splitlines()
    def_line = next(i for i, t in enumerate(text, 1) if t.startswith("def gluon_prefill_kernel("))
    ws_line = next(i for i, t in enumerate(text, 1) if "gl.warp_specialize(" in t)
    return def_line, ws_line


def _dispatch_only(log: Path) -> bool:
    script = (ROOT / "tools/sanitize.sh").read_text()
    function = re.search(r"^dispatch_only\(\) \{.*?^\}", script, re.M | re.S).group(0)
    done = subprocess.run(["bash", "-c", f'{function}\ndispatch_only "$1"', "_", str(log)],
                          cwd=ROOT)
    return done.returncode == 0


def _race(read_line: int, write_line: int) -> str:
    return (f"========= Error: Race reported between Read access at gluon_prefill_kernel+0x170 "
            f"in gluon_prefill.py:{read_line}\n"
            f"=========     and Write access at gluon_prefill_kernel+0xe5e0 in "
            f"gluon_prefill.py:{write_line} [53 hazards]\n")


def test_sanitize_accepts_only_the_dispatch_report(tmp_path):
    def_line, ws_line = _kernel_lines()
    log = tmp_path / "gluon_racecheck.log"
    log.write_text(_race(def_line, def_line) + _race(def_line, ws_line)
                   + "RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n")
    assert _dispatch_only(log)
    log.write_text(_race(def_line, ws_line) + _race(def_line, ws_line + 7))  # a ring's race
    assert not _dispatch_only(log)
    log.write_text(_race(def_line, int(f"{ws_line}0")))  # a line that only starts the same
    assert not _dispatch_only(log)
    log.write_text("========= ERROR SUMMARY: 3 errors\n")  # errors, but no race named
    assert not _dispatch_only(log)


def test_sanitize_accepts_the_dispatch_at_the_if_that_picks_a_warp_specialize(tmp_path):
    """With two dispatch sites (two and three consumers) racecheck puts the partition-state
    stores on the `if` choosing between them; the lines inside a call's arguments, or any
    other, stay races."""
    text = KERNEL.read_text().splitlines()
    def_line, _ = _kernel_lines()
    sites = [i for i, t in enumerate(text, 1) if "gl.warp_specialize(" in t]
    choice = sites[0] - 1
    assert text[choice - 1].strip().startswith("if ")
    other = next(i for i in range(sites[0], sites[-1]) if text[i - 1].strip() == "else:")
    log = tmp_path / "gluon_racecheck.log"
    log.write_text(_race(def_line, choice) + _race(def_line, other) + _race(def_line, sites[-1]))
    assert _dispatch_only(log)
    log.write_text(_race(def_line, choice) + _race(def_line, sites[0] + 1))  # an argument line
    assert not _dispatch_only(log)


def test_sanitize_accepts_the_gluon_decode_dispatch_of_both_forms(tmp_path):
    """The Gluon decode case runs the grid and the persistent kernels: the dispatch lines of
    either module pass, another line of either fails, and the prefill module's lines are not
    theirs."""
    script = (ROOT / "tools/sanitize.sh").read_text()
    function = re.search(r"^dispatch_only\(\) \{.*?^\}", script, re.M | re.S).group(0)

    def accepted(log: Path) -> bool:
        done = subprocess.run(["bash", "-c", f'{function}\ndispatch_only "$@"', "_", str(log),
                               "gluon_decode", "gluon_decode_persistent"], cwd=ROOT)
        return done.returncode == 0

    def race(module: str, read: int, write: int) -> str:
        return (f"========= Error: Race reported between Read access at {module}_kernel+0x110 "
                f"in {module}.py:{read}\n=========     and Write access at {module}_kernel+0x5930"
                f" in {module}.py:{write} [11 hazards]\n")

    lines = {}
    for module in ("gluon_decode", "gluon_decode_persistent"):
        text = (ROOT / f"src/pagedattn/ops/triton/{module}.py").read_text().splitlines()
        lines[module] = (next(i for i, t in enumerate(text, 1)
                              if t.startswith(f"def {module}_kernel(")),
                         next(i for i, t in enumerate(text, 1) if "gl.warp_specialize(" in t))
    (d, w), (pd, pw) = lines["gluon_decode"], lines["gluon_decode_persistent"]
    log = tmp_path / "gluon_decode_racecheck.log"
    log.write_text(race("gluon_decode", d, w) + race("gluon_decode_persistent", pd, pd)
                   + race("gluon_decode_persistent", pd, pw))
    assert accepted(log)
    log.write_text(race("gluon_decode_persistent", pd, pw + 3))  # a line of its rings
    assert not accepted(log)
    log.write_text(race("gluon_prefill", pd, pw))  # another module's lines
    assert not accepted(log)


def _cache_entries(out: Path) -> set:
    """The entry folders in the tcache parts under `out` (xz or gzip, as the script packed)."""
    parts = sorted(out.glob("tcache.t?z.*"))
    assert parts, list(out.iterdir())
    assert all(p.name.endswith(f"of{len(parts):02d}") for p in parts), parts
    data = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {Path(n).parts[1] for n in tar.getnames() if len(Path(n).parts) > 1}


def _tcache_repo(tmp_path: Path, *names: str) -> Path:
    """A repository copy whose .tcache holds `names`' entries as a carried gzip part."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tools", repo / "tools")
    cache = repo / ".tcache"
    for name in names:
        (cache / "triton" / name).mkdir(parents=True)
        (cache / "triton" / name / "kernel.json").write_text(name)
    with tarfile.open(cache / "tcache.tgz.00of01", "w:gz") as tar:
        tar.add(cache / "triton", arcname="triton")
    shutil.rmtree(cache / "triton")
    return repo


def test_pack_tcache_returns_what_the_run_used(tmp_path):
    repo = _tcache_repo(tmp_path, "read", "stale")
    out = tmp_path / "out"
    out.mkdir()
    run = ("source tools/device_env.sh && cat .tcache/triton/read/kernel.json >/dev/null && "
           "mkdir .tcache/triton/compiled && echo new > .tcache/triton/compiled/kernel.json && "
           f"bash tools/pack_tcache.sh {out}")
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run(["bash", "-c", run], cwd=repo, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert "tcache: 2 entries unpacked" in done.stdout
    entries = _cache_entries(out)
    # Where the file system records reads, only the entries read or compiled come back;
    # under noatime every entry does (the script says which it did).
    if "tcache: 2 of 3 entries" in done.stdout:
        assert entries == {"read", "compiled"}
    else:
        assert "tcache: all 3 entries" in done.stdout
        assert entries == {"read", "stale", "compiled"}
    # --all: every entry, for a run of part of the suite; an earlier run's parts replaced
    (out / "tcache.txz.05of09").write_text("an older run's part")
    done = subprocess.run(["bash", "tools/pack_tcache.sh", str(out), "--all"], cwd=repo,
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tcache: all 3 entries")
    assert _cache_entries(out) == {"read", "stale", "compiled"}


def test_a_tcache_carried_short_is_refused_by_name(tmp_path):
    """Two of three parts carried: nothing unpacked, and the message says what to carry."""
    repo = _tcache_repo(tmp_path, "kept")
    cache = repo / ".tcache"
    (cache / "tcache.tgz.00of01").rename(cache / "tcache.tgz.00of03")
    (cache / "tcache.tgz.01of03").write_bytes(b"")
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run(["bash", "-c", "source tools/device_env.sh"], cwd=repo, env=env,
                          capture_output=True, text=True)
    assert "INCOMPLETE: 2 of 3 tgz parts carried" in done.stderr
    assert "carry every .tcache/tcache.tgz.* part" in done.stderr
    assert not (cache / "triton" / "kept").exists()


def _find_cuda_tool(*args: str, path: str) -> subprocess.CompletedProcess:
    script = (ROOT / "tools/device_env.sh").read_text()
    function = re.search(r"^find_cuda_tool\(\) \{.*?^\}", script, re.M | re.S).group(0)
    return subprocess.run(["bash", "-c", f'{function}\nfind_cuda_tool "$@"', "_", *args],
                          env={**os.environ, "PATH": path}, capture_output=True, text=True)


def test_find_cuda_tool_takes_path_first_then_the_first_executable_given(tmp_path):
    name = "pagedattn-stub-tool"  # in no CUDA folder of this machine
    on_path, plain, first, second = (tmp_path / d for d in ("bin", "plain", "first", "second"))
    for folder in (on_path, plain, first, second):
        folder.mkdir()
        (folder / name).write_text("#!/bin/sh\n")
        if folder is not plain:
            (folder / name).chmod(0o755)
    given = [str(plain / name), str(first / name), str(second / name)]
    system = os.environ["PATH"]
    done = _find_cuda_tool(name, *given, path=f"{on_path}:{system}")
    assert (done.returncode, done.stdout) == (0, f"{on_path / name}\n")
    done = _find_cuda_tool(name, *given, path=system)  # the non-executable one is passed over
    assert (done.returncode, done.stdout) == (0, f"{first / name}\n")
    done = _find_cuda_tool(name, str(plain / name), str(tmp_path / "none" / name), path=system)
    assert (done.returncode, done.stdout) == (0, "")  # the caller says how to set it


def test_ncu_stalls_attributes_samples_to_regions_and_barriers(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import ncu_stalls

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_short_sb",
              "stall_long_sb"]
    rows = [  # (address, source, samples, short_sb, long_sb)
        ("0x10", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", 1, 0, 0),
        ("0x20", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR5+0x381d8], R25", 4, 0, 4),
        ("0x30", "@!P1 BRA 0x7f00", 10, 0, 10),
        ("0x40", "FMNMX R210, R204, R203, !PT", 7, 6, 0),
        # ptxas puts other instructions between a try-wait and its branch on the main path
        ("0x41", "SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR5+0x381d8], R2", 0, 0, 0),
        ("0x42", "USHF.L.U32 UR15, UR15, 0x1f, URZ", 1, 0, 0),
        ("0x43", "@!P3  BRA 0x7f10", 5, 0, 5),
        ("0x44", "ISETP.GE.AND P1, PT, R1, R2, PT", 0, 0, 0),  # P1 no longer the try-wait's
        ("0x45", "@!P1 BRA 0x7f20", 2, 0, 0),
        ("0x50", "USETMAXREG.DEALLOC.CTAPOOL 0x28", 0, 0, 0),
        ("0x60", "NOP", 20, 0, 0),
    ]
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(header)
        w.writerows(rows)
    monkeypatch.setattr(sys, "argv", ["ncu_stalls.py", str(path), "--names", "0x381d8=turn"])
    ncu_stalls.main()
    text = capsys.readouterr().out
    assert "50 samples" in text
    assert "| 0x10 | 232 | 30 | 60.0% |" in text  # the consumer region: 1 + 4 + 10 + 7 + 8
    assert "| 0x50 | 40 | 20 | 40.0% |" in text
    assert "| wait turn | 19 | 38.0% |" in text  # the try-waits and the branches spinning on them
    assert "| softmax math | 7 | 14.0% |" in text
    assert "| other | 4 | 8.0% |" in text  # USETMAXREG, USHF and the branch on ISETP
    assert "short_sb 6" in text


def test_bench_power_reads_nvidia_smi_samples_and_prices_a_row(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # bench_prefill, timing
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    pytest.importorskip("torch")
    import bench_power

    path = tmp_path / "smi.csv"
    path.write_text("2026/11/29 09:38:23.169, 1650, 690.0, 0x0000000000000004\n"
                    "2026/11/29 09:38:23.219, 1700, 700.0, 0x0000000000000004\n"
                    "2026/11/29 09:38:23.2\n")  # a line cut off when the sampler stopped
    got = bench_power.samples(path)
    assert [(s[1], s[2], s[3]) for s in got] == [(1650.0, 690.0, "0x0000000000000004"),
                                                 (1700.0, 700.0, "0x0000000000000004")]
    assert got[1][0] - got[0][0] == pytest.approx(0.05, abs=1e-5)
    # 1.2 TFLOP in 2 ms at the median 695 W: 600 TFLOP/s, 1390 mJ, 863 GFLOP/J
    line = bench_power.row_line("row", 1.2e12, 2.0, got)
    assert line == "| row | 2.000 | 600 | 1675 | 695 | 1390 | 863 | 0x0000000000000004 |"
    assert bench_power.row_line("row", 1.2e12, 2.0, []).endswith("| n/a | n/a | n/a | n/a | |")


def _sass(lines: list[str]) -> str:
    """A cuobjdump-like listing of `lines`, one instruction every 0x10 bytes from 0x100."""
    return "".join(f"        /*{0x100 + 0x10 * i:04x}*/                   {t} ;\n"
                   for i, t in enumerate(lines))


def test_loop_mix_counts_the_converters_tile_loop_by_path(tmp_path, monkeypatch):
    """--converter: the innermost loop storing to shared memory without a wgmma or TMA load
    (not the consumer's, nor the unit loop around the converter's), each path through it."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import gluon_loop_mix

    sass = _sass([
        "HGMMA.64x64x16.F32 R24, gdesc[UR4], R24",  # 0x100: the consumer's loop
        "@P0 BRA 0x100",
        "LDS.64 R2, [R3]",  # 0x120: the unit loop's head, then the tile loop at 0x130
        "LDS.64 R4, [R5]",
        "F2FP.F16.E4M3.UNPACK_B R6, R4",
        "@P1 BRA 0x170",  # the tail path: one more instruction
        "SEL R6, R6, RZ, P2",
        "STS.128 [R7], R6",  # 0x170
        "@P3 BRA 0x130",
        "@P4 BRA 0x120",
        "EXIT"])
    dump = tmp_path / "e4m3_variant"
    dump.mkdir()
    (dump / "gluon_decode_kernel.sass").write_text(sass)
    ins = gluon_loop_mix.parse(str(dump / "gluon_decode_kernel.sass"))
    first, last = gluon_loop_mix.converter_loop(ins)
    assert (ins[first][0], ins[last][0]) == (0x130, 0x180)
    rows = gluon_loop_mix.rows(str(tmp_path), None, converter=True)
    # F2FP PRMT LDS LDSM STS STSM other spills: 5 instructions unmasked, 6 with the SEL
    assert rows == ["| e4m3_variant | 5 | 1 | 0 | 1 | 0 | 1 | 0 | 2 | 0 |",
                    "| e4m3_variant | 6 | 1 | 0 | 1 | 0 | 1 | 0 | 3 | 0 |"]


def test_ab_gluon_decode_columns_carry_the_kernel_forms(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    ab = pytest.importorskip("ab_gluon_decode")
    cols = ab.variants([], [4], "pers2,pers2pv8,pers2lazy,pers2pv8lazy")
    assert [c[0] for c in cols] == ["`tl`", "Persistent 2/SM", "Persistent 2/SM, fp8 P V",
                                    "Persistent 2/SM, lazy", "Persistent 2/SM, fp8 P V, lazy",
                                    "Persistent 2/SM s4", "Persistent 2/SM, fp8 P V s4",
                                    "Persistent 2/SM, lazy s4",
                                    "Persistent 2/SM, fp8 P V, lazy s4"]
    # (fp8 P V, max slack) of each: the switches' values a plan is made with
    assert [c[5:] for c in cols[:5]] == [(False, -1), (False, -1), (True, -1), (False, 0),
                                         (True, 0)]
    assert cols[5][3] == 4 and cols[5][4] is True  # forced splits, persistent
    with pytest.raises(ValueError, match="pers3"):
        ab.variants([], [], "pers3")


def test_the_gpu_watchdog_ends_a_test_stuck_holding_the_gil(tmp_path):
    """A `cuda` test stuck in C code that never releases the GIL (a regular expression's
    backtracking here; a launch blocked behind a kernel that never ends on a GPU) is ended by
    conftest's faulthandler watchdog, its id and stack in the watchdog folder."""
    (tmp_path / "test_stuck.py").write_text(
        "import re\nimport pytest\n\n\n@pytest.mark.cuda\ndef test_stuck():\n"
        "    re.match(r'(a+)+$', 'a' * 60 + 'b')\n")
    (tmp_path / "watchdog").mkdir()
    env = {**os.environ, "PAGEDATTN_TEST_WATCHDOG_S": "1",
           "PAGEDATTN_TEST_WATCHDOG_DIR": str(tmp_path / "watchdog"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull,
                           str(tmp_path / "test_stuck.py")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    log = (tmp_path / "watchdog" / "watchdog-main.log").read_text()
    assert log.startswith("test_stuck.py::test_stuck: stuck past 1 s")
    assert 'test_stuck.py", line 7 in test_stuck' in log


def test_the_watchdogs_seconds_are_checked(monkeypatch):
    from conftest import watchdog_seconds

    monkeypatch.setenv("PAGEDATTN_TEST_WATCHDOG_S", "0")
    assert watchdog_seconds() == 0
    for bad, why in (("soon", "is not a number"), ("-5", "must be >= 0")):
        monkeypatch.setenv("PAGEDATTN_TEST_WATCHDOG_S", bad)
        with pytest.raises(ValueError, match=f"PAGEDATTN_TEST_WATCHDOG_S='{bad}' {why}"):
            watchdog_seconds()


def _inner() -> int:
    return 1


def _outer() -> int:
    return _inner() + _inner()


def test_op_host_cost_rows_stages_and_the_ops_planning_keywords(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    oc = pytest.importorskip("op_host_cost")
    assert [r[0] for r in oc.parse_rows("32 x 512, 1 x 8192")] == ["32 x 512", "1 x 8192"]
    assert oc.parse_rows("8 x 2048")[0][1:] == ([2048] * 8, [2048] * 8, 32, 8, 128)
    with pytest.raises(ValueError, match="'2 x 7'"):
        oc.parse_rows("2 x 7")
    with pytest.raises(ValueError, match="'fp4'"):
        oc.parse_dtypes("bf16,fp4")
    stages = [("outer", "test_tools.py", "_outer"), ("inner", "test_tools.py", "_inner"),
              ("other file", "elsewhere.py", "_inner"), ("not run", "test_tools.py", "nope")]
    rows = oc.stage_us(oc.profile(_outer, 50), 50, stages)
    assert [(label, n) for label, _, n in rows] == [("outer", 1.0), ("inner", 2.0)]
    assert rows[0][1] >= rows[1][1] > 0  # cumulative: the outer call holds the inner ones
    assert oc.stage_lines(rows)[2].startswith("| `outer` | ")
    # the keywords the op plans with, spied from one call; the op left as it was
    from conftest import make_paged_batch
    from pagedattn.ops.triton import attention_plan, op_plans

    b = make_paged_batch([3, 1], [20, 9], num_heads=4, num_kv_heads=2, head_size=32)
    op = functools.partial(
        op_plans.varlen_attention, b.q, b.k_cache, b.v_cache, torch.empty_like(b.q),
        cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k, cu_seqlens_k=None,
        block_table=b.block_table, max_seqlen_q=3, max_seqlen_k=20, softmax_scale=32 ** -0.5,
        causal=True, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
        sinks=None, q_descale=None, k_descale=None, v_descale=None, softmax_lse=None)
    real = attention_plan.plan_attention
    kw = oc.op_kwargs(op)
    assert kw == b.plan_args() | dict(num_splits=0, config=None, batch_invariant=False)
    assert attention_plan.plan_attention is real and op_plans.OP_PLANS == 4
    assert op_plans.kept() == 0  # planned afresh, not kept
