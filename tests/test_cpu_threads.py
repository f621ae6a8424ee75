"""The CPU thread policy: other processes' CPU time from /proc/stat less this process's own,
the thread count it leaves (at least one), chosen at most every `interval` seconds, applied
around a piece of work and restored after; OMP_NUM_THREADS is left alone."""

from __future__ import annotations

import os

import pytest
import torch

from pagedattn.cpu_threads import CpuLoad, ThreadPolicy, torch_threads, usable_cores


def test_usable_cores_are_the_affinity_mask():
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1


def _stat(path, ticks):
    """A /proc/stat with cpu0..cpu2 (user nice system idle iowait irq softirq steal ...)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for i, (user, system, idle, iowait, steal) in enumerate(ticks):
        lines.append(f"cpu{i} {user} 0 {system} {idle} {iowait} 0 0 {steal} 0 0")
    path.write_text("\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n")


def test_cpu_load_is_the_other_processes_share_of_this_process_cores(tmp_path):
    stat, tick = tmp_path / "stat", os.sysconf("SC_CLK_TCK")
    clock, own = iter([0.0, 2.0, 3.0]), iter([10.0, 11.0, 12.0])
    _stat(stat, [(100, 0, 500, 0, 0), (0, 0, 600, 0, 0), (0, 0, 0, 0, 0)])
    load = CpuLoad({0, 1}, str(stat), clock=lambda: next(clock), own_time=lambda: next(own))
    # 2 s later: cpu0 busy 2 s more (user 1.5 s + steal 0.5 s), cpu1 1 s more (system),
    # idle and iowait time is not busy, cpu2 is not ours. This process used 1 s of CPU.
    _stat(stat, [(100 + int(1.5 * tick), 0, 500, 7 * tick, int(0.5 * tick)),
                 (0, tick, 600 + tick, 0, 0), (99 * tick, 0, 0, 0, 0)])
    assert load.others_since_last() == pytest.approx((2 + 1 - 1) / 2)
    assert load.others_since_last() == 0.0  # since: only this process was busy


def test_cpu_load_without_proc_stat_is_unknown(tmp_path):
    assert CpuLoad(stat_path=str(tmp_path / "missing")).others_since_last() is None


class ScriptedLoad(CpuLoad):
    def __init__(self, readings):
        self.readings = iter(readings)

    def others_since_last(self):
        return next(self.readings)


@pytest.mark.parametrize("others, threads", [
    (0.0, 4), (0.2, 4), (0.3, 3), (1.0, 3), (1.2, 3), (2.6, 1), (3.9, 1), (7.0, 1)])
def test_threads_are_the_cores_other_processes_leave_free_at_least_one(others, threads,
                                                                        monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    policy = ThreadPolicy(interval=0.0, cores=4, load=lambda: ScriptedLoad([others]))
    assert policy.choose() == 1  # nothing measured yet: one thread
    assert policy.choose() == threads and policy.others == others
    assert f"{threads} thread" in policy.describe()


def test_the_choice_is_measured_again_only_after_the_interval():
    policy = ThreadPolicy(interval=3600.0, cores=2, load=lambda: ScriptedLoad([0.0, 1.0]))
    policy.choose()
    assert policy.choose() == 1  # within the interval: the first choice stands
    assert policy.measure(0.0) == 2  # asked for: measured now
    assert policy.choose(measure_now=True) == 1


def test_applied_sets_the_choice_for_the_block_then_restores_torchs(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    with torch_threads(before + 1) as n:
        assert n == torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    policy = ThreadPolicy(interval=0.0, cores=3, load=lambda: ScriptedLoad([0.0]))
    policy.choose()
    with policy.applied() as n:
        assert n == torch.get_num_threads() == 3
    assert torch.get_num_threads() == before


def test_omp_num_threads_is_the_users_choice(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    policy = ThreadPolicy(interval=0.0, cores=3, load=lambda: ScriptedLoad([0.0, 0.0]))
    with policy.applied() as n:
        assert n == torch.get_num_threads() == before
    assert "OMP_NUM_THREADS" in policy.describe()


def test_the_generator_runs_each_cpu_step_on_the_policys_threads(monkeypatch):
    pytest.importorskip("transformers", reason="the generator needs the hf extra")
    from pagedattn.integrations.hf_generator import PagedGenerator
    from pagedattn.integrations.hf_models import tiny_model

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    seen = []

    class Recording(ThreadPolicy):
        def choose(self, measure_now=False):
            seen.append(super().choose(measure_now))
            return seen[-1]

    policy = Recording(interval=0.0, cores=2, load=lambda: ScriptedLoad([1.5, 0.0, 0.0] * 9))
    gen = PagedGenerator(tiny_model("llama"), num_blocks=16, cpu_threads=policy)
    gen.generate([[5, 6, 7]], 3, eos_token_id=())
    assert [s.threads for s in gen.stats] == seen[:len(gen.stats)] and seen[:3] == [1, 1, 2]
    assert torch.get_num_threads() == before
    fixed = PagedGenerator(tiny_model("llama"), num_blocks=16, cpu_threads=1)
    fixed.generate([[5, 6, 7]], 2, eos_token_id=())
    assert [s.threads for s in fixed.stats] == [1, 1]
    with pytest.raises(ValueError, match="cpu_threads=0"):
        PagedGenerator(tiny_model("llama"), num_blocks=16, cpu_threads=0)
