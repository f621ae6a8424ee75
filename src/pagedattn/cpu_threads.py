"""How many intra-op threads CPU work gets: the cores this process may use that other
processes leave free, measured while the work runs.

PyTorch starts one OpenMP thread per core and every parallel op ends at a barrier. When
another process keeps one of the cores busy, the thread on that core waits for the
scheduler's next time slice (milliseconds) and so does every op: a decode step of a small
model, hundreds of short ops, ran several times slower on two threads than on one. With the
cores free, two threads serve a prompt chunk's matmuls faster. So the choice is measured
where it is made: the other processes' CPU time on this process's cores since the last
choice (/proc/stat, less this process's own time), at most every `interval` seconds.

Nothing here runs at import or touches a setting by itself: the `pagedattn` commands and
`PagedGenerator` apply a choice around their own work (`ThreadPolicy.applied`), and torch's
thread count is restored after. An `OMP_NUM_THREADS` in the environment is the user's
choice and is left alone.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Optional

import torch

from pagedattn import envs

# A core counts as busy once other processes use more than this share of it (the idle
# machine's daemons use a few percent).
BUSY_SHARE = 0.25


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; a container or `taskset` may
    allow fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class CpuLoad:
    """Cores' worth of CPU time that other processes used on this process's cores between
    two readings: /proc/stat's busy time of those cores less this process's CPU time.
    (`cores`, `stat_path`, `clock` and `own_time` are there for tests.)"""

    def __init__(self, cores: Optional[set[int]] = None, stat_path: str = "/proc/stat",
                 clock: Callable[[], float] = time.monotonic,
                 own_time: Callable[[], float] = time.process_time) -> None:
        if cores is None:
            try:
                cores = os.sched_getaffinity(0)
            except (AttributeError, OSError):  # not Linux: every core
                cores = None
        self._cores, self._stat_path, self._clock, self._own_time = (cores, stat_path, clock,
                                                                     own_time)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._reading()

    def _reading(self) -> tuple[float, Optional[float], float]:
        """(wall seconds, busy seconds of our cores or None, this process's CPU seconds)."""
        return self._clock(), self._busy_seconds(), self._own_time()

    def _busy_seconds(self) -> Optional[float]:
        try:
            with open(self._stat_path) as f:
                lines = f.readlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            if self._cores is not None and int(name[3:]) not in self._cores:
                continue
            # user nice system idle iowait irq softirq steal: all but idle and iowait are
            # time the core was not ours to take (steal: the hypervisor gave it away)
            values = [int(v) for v in fields[:8]]
            busy += sum(values) - values[3] - values[4]
        return busy / self._tick

    def others_since_last(self) -> Optional[float]:
        """Cores' worth of other processes' work since the previous call (or construction);
        None where /proc/stat cannot be read."""
        now = self._reading()
        (wall0, busy0, own0), (wall1, busy1, own1) = self._last, now
        self._last = now
        if busy0 is None or busy1 is None or wall1 <= wall0:
            return None
        return max(0.0, (busy1 - busy0 - (own1 - own0)) / (wall1 - wall0))


class ThreadPolicy:
    """Chooses torch's intra-op thread count for CPU work: every usable core that other
    processes leave free (at least one), measured over the last `interval` seconds or more.
    The first choice, before anything was measured, is one thread: never much slower, and
    never the collapse that threads waiting on a busy core cause."""

    def __init__(self, interval: float = 0.5, cores: Optional[int] = None,
                 load: Optional[Callable[[], CpuLoad]] = None) -> None:
        self.cores = cores or usable_cores()
        self.interval = interval
        self.threads = 1
        self.others: Optional[float] = None  # the last measurement, for reports
        self._new_load = load or CpuLoad
        self._load: Optional[CpuLoad] = None
        self._since = 0.0

    def choose(self, measure_now: bool = False) -> int:
        """The thread count for the next piece of work (measured again once `interval`
        seconds have passed since the last measurement, or now if asked)."""
        now = time.monotonic()
        if self._load is None:
            self._load, self._since = self._new_load(), now
            return self.threads
        if now - self._since < self.interval and not measure_now:
            return self.threads
        others = self._load.others_since_last()
        self._since = now
        if others is None:  # no /proc/stat: the 1-minute load average, less our threads
            try:
                others = max(0.0, os.getloadavg()[0] - self.threads)
            except (AttributeError, OSError):
                others = 0.0
        self.others = others
        busy = max(0, math.ceil(others - BUSY_SHARE))
        self.threads = max(1, self.cores - busy)
        return self.threads

    def measure(self, seconds: float = 0.25) -> int:
        """Choose from a measurement of the next `seconds` (for work that wants one choice
        before it starts)."""
        if self._load is None:
            self.choose()
        time.sleep(seconds)
        return self.choose(measure_now=True)

    def describe(self) -> str:
        """The choice in words, for reports."""
        if envs.OMP_NUM_THREADS:
            n = torch.get_num_threads()
            return f"{n} thread{'' if n == 1 else 's'} (OMP_NUM_THREADS)"
        threads = f"{self.threads} thread{'' if self.threads == 1 else 's'}"
        if self.others is None:
            return f"{threads} (not measured yet)"
        return (f"{threads}: other processes used {self.others:.1f} of the "
                f"{self.cores} cores this process may use")

    @contextlib.contextmanager
    def applied(self) -> Iterator[int]:
        """Run the block with the chosen thread count (unless OMP_NUM_THREADS is set),
        restoring torch's after."""
        if envs.OMP_NUM_THREADS:
            yield torch.get_num_threads()
            return
        with torch_threads(self.choose()) as n:
            yield n


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """torch.set_num_threads(n) for the block, then the previous count again."""
    previous = torch.get_num_threads()
    if n != previous:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        if n != previous:
            torch.set_num_threads(previous)
