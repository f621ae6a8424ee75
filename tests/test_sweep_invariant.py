"""tools/sweep_invariant.py on the CPU (interpreter): its table names every config with the
verdict of the invariance check, and that check fails a batch-dependent function."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.syspath_prepend(str(ROOT / "tools"))  # its guarantee check, a module beside it
    spec = importlib.util.spec_from_file_location("sweep_invariant",
                                                  ROOT / "tools/sweep_invariant.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sweep_invariant", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    import bench_kernels
    import bench_prefill

    for name in ("DEV", "H", "HKV", "D"):  # use_cpu() sets them; put them back after
        monkeypatch.setattr(bench_kernels, name, getattr(bench_kernels, name))
    monkeypatch.setattr(bench_prefill, "DEV", bench_prefill.DEV)
    module.use_cpu()
    return module


def test_smoke_sweep_tables_every_config_checked_and_timed(sweep):
    lines = []
    checks, times = sweep.sweep(sweep.SMOKE_CONFIGS, sweep.SMOKE_ROWS, 1, True, lines.append)
    assert checks == [None] * len(sweep.SMOKE_CONFIGS)  # every fixed config keeps the bits
    header = next(i for i, line in enumerate(lines) if line.startswith("| config |"))
    assert lines[header] == ("| config | guarantee | "
                             + " | ".join(r.label for r in sweep.SMOKE_ROWS) + " |")
    body = lines[header + 3:header + 3 + len(sweep.SMOKE_CONFIGS)]
    for config, line in zip(sweep.SMOKE_CONFIGS, body):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:2] == [config.label, "ok"]
        for cell in cells[2:]:  # "ms (ratio x)", both numbers, the ratio ms / default's
            ms, ratio = cell.split(" (")
            assert float(ms) > 0 and float(ratio.rstrip("x)")) > 0
    for i in range(len(sweep.SMOKE_ROWS)):
        assert all(ms > 0 and error is None for ms, error in times[i])
    best = [line for line in lines if line.startswith("| decode |")
            or line.startswith("| prefill, head 32 |")]
    assert len(best) == 2 and all(line.split(" | ")[1] in
                                  {c.label for c in sweep.SMOKE_CONFIGS} for line in best)


def _world(sweep, lengths):
    return sweep.World(lengths, 2, 1, 32, "cpu", seed=1)


def test_the_check_fails_rows_that_change_with_the_batch(sweep):
    lengths = [47, 11, 49, 40, 1]
    world = _world(sweep, lengths)
    assert sweep.check_invariance(world.run, lengths, seed=0) is None

    def batch_dependent(parts, num_splits=0):  # one ulp-sized change beside other requests
        rows = world.run(parts, num_splits)
        return [r * (1 + 2 ** -20) if len(parts) > 1 else r for r in rows]

    broke = sweep.check_invariance(batch_dependent, lengths, seed=0)
    assert broke is not None and broke.startswith("in a batch")


def test_the_check_fails_rows_that_change_with_the_chunking(sweep):
    lengths = [47, 11, 49, 40, 1]
    world = _world(sweep, lengths)

    def chunk_dependent(parts, num_splits=0):  # a part that starts past token 0 rounds apart
        rows = world.run(parts, num_splits)
        return [r.to(torch.bfloat16).float() if a > 0 else r
                for r, (_, a, _) in zip(rows, parts)]

    broke = sweep.check_invariance(chunk_dependent, lengths, seed=0)
    assert broke is not None and broke.startswith("chunked and as decodes")


def test_a_config_that_cannot_run_is_reported_not_raised(sweep):
    """(Not broken: its rows read n/a, which keeps it from being picked.)"""
    config = sweep.Config("split 24", {"invariant_split_keys": 24})  # not a multiple of 16
    broke, cannot = sweep.check_config(config, [32], smoke=True)
    assert broke is None and len(cannot) == 1 and "invariant_split_keys=24" in cannot[0]


def test_rows_and_configs_are_picked_by_words(sweep):
    """--rows matches a row's kind and label, so the prompt rows come without the decode rows
    of the same sizes; --configs keeps today's first."""
    rows = sweep.gpu_rows(quick=True)
    assert [(r.kind, r.label, r.head_size) for r in
            sweep.pick_rows(rows, "prefill 1 x 8192,prefill 32 x 512")] == \
        [("prefill", "1 x 8192", 128), ("prefill", "32 x 512", 128)]
    assert [r.label for r in sweep.pick_rows(rows, "decode 1 x 8192")] == ["decode 1 x 8192"]
    assert {r.kind for r in sweep.pick_rows(rows, "1 x 8192")} == {"decode", "prefill"}
    picked = sweep.pick_configs(sweep.gpu_configs(quick=True, cross=False),
                                "128-key tiles switch")
    assert [(c.label, c.values) for c in picked] == [
        ("today", {}),
        ("128-key tiles switch, fold in memory", {"invariant_tiles_128": True}),
        ("128-key tiles switch, lazy rescale",
         {"invariant_tiles_128": True, "invariant_lazy_rescale": True,
          "invariant_max_slack": 0}),
        ("128-key tiles switch, max slack 8",
         {"invariant_tiles_128": True, "invariant_max_slack": 8})]
