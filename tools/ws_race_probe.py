"""Does `gl.warp_specialize` itself trip compute-sanitizer's racecheck? (docs/dev/RELIABILITY.md)

racecheck reports one hazard per Gluon prefill variant, at the kernel's entry and its
`warp_specialize` lines, and none on the kernel's own rings or barriers. This program runs
Gluon kernels that use no shared memory of their own, so any hazard racecheck reports here
comes from Triton's partition dispatch, not from a kernel's code:

- `plain`: no warp specialisation (the control: racecheck must be clean);
- `one_worker`: a default partition of 4 warps and one worker of 1 warp, each writing its
  own half of a global output;
- `two_workers`: a default partition and workers of 4 and 1 warps;
- `prefill_shape`: the prefill kernel's partitions (a default of 4 warps, workers of 4, 1
  and 2 warps, 232 / 40 / 40 registers) over mbarriers the default partition initialises
  before the split: the one-warp worker arrives, the others wait for it and write;
- `three_workers`: the same partitions without the mbarrier (each writes its part);
- `one_worker_mbarrier`: a default partition of 4 warps and a one-warp worker that
  arrives on an mbarrier the default partition waits for;
- `mbarrier_unused`: `one_worker`'s partitions, with an mbarrier initialised before the
  split that no partition touches;
- `mbarrier_in_worker`: an mbarrier the one-warp worker arrives on and then waits for
  itself (the default partition never touches it);
- `two_warp_worker`: a default partition and one worker of 2 warps.

Each kernel's output is checked (every element written, by the partition that owns it).

    compute-sanitizer --tool racecheck python3 tools/ws_race_probe.py
"""

from __future__ import annotations

import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

N = gl.constexpr(128)  # elements each partition writes


@gluon.jit
def _fill(out, base, value, WARPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    offs = gl.arange(0, N, layout=layout)
    gl.store(out + base + offs, gl.full([N], value, gl.float32, layout))


@gluon.jit
def plain_kernel(out):
    _fill(out, 0, 1.0, 4)
    _fill(out, N, 2.0, 4)
    _fill(out, 2 * N, 3.0, 4)


@gluon.jit
def _default(out):
    _fill(out, 0, 1.0, 4)


@gluon.jit
def _worker1(out):
    _fill(out, N, 2.0, 1)


@gluon.jit
def _worker4(out):
    _fill(out, 2 * N, 3.0, 4)


@gluon.jit
def one_worker_kernel(out):
    gl.warp_specialize([(_default, (out,)), (_worker1, (out,))], [1], [24])
    _fill(out, 2 * N, 3.0, 4)  # after the join: the default partition's warps again


@gluon.jit
def two_workers_kernel(out):
    gl.warp_specialize([(_default, (out,)), (_worker4, (out,)), (_worker1, (out,))],
                       [4, 1], [232, 40])


@gluon.jit
def _one_mbarrier():
    """One mbarrier in shared memory, for one arrival, initialised before the split."""
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    fence_async_shared()
    return bar


@gluon.jit
def _wait_then_fill(bar, out, base, value, WARPS: gl.constexpr):
    mbarrier.wait(bar.index(0), 0)
    _fill(out, base, value, WARPS)


@gluon.jit
def _arrive(bar, out):
    mbarrier.arrive(bar.index(0))


@gluon.jit
def prefill_shape_kernel(out):
    bar = _one_mbarrier()
    gl.warp_specialize([(_wait_then_fill, (bar, out, 0, 1.0, 4)),
                        (_wait_then_fill, (bar, out, N, 2.0, 4)), (_arrive, (bar, out)),
                        (_wait_then_fill, (bar, out, 2 * N, 3.0, 2))],
                       [4, 1, 2], [232, 40, 40])


@gluon.jit
def _worker2(out):
    _fill(out, 2 * N, 3.0, 2)


@gluon.jit
def _nothing(out):
    pass


@gluon.jit
def three_workers_kernel(out):
    gl.warp_specialize([(_default, (out,)), (_worker4, (out,)), (_nothing, (out,)),
                        (_worker2, (out,))], [4, 1, 2], [232, 40, 40])
    _fill(out, N, 2.0, 4)  # after the join (the 4-warp worker wrote 3.0 there)


@gluon.jit
def two_warp_worker_kernel(out):
    gl.warp_specialize([(_default, (out,)), (_worker2, (out,))], [2], [40])
    _fill(out, N, 2.0, 4)


@gluon.jit
def one_worker_mbarrier_kernel(out):
    bar = _one_mbarrier()
    gl.warp_specialize([(_wait_then_fill, (bar, out, 0, 1.0, 4)), (_arrive, (bar, out))],
                       [1], [24])
    _fill(out, N, 2.0, 4)
    _fill(out, 2 * N, 3.0, 4)


@gluon.jit
def mbarrier_unused_kernel(out):
    _one_mbarrier()  # initialised, then touched by no partition
    gl.warp_specialize([(_default, (out,)), (_worker1, (out,))], [1], [24])
    _fill(out, 2 * N, 3.0, 4)


@gluon.jit
def _arrive_then_fill(bar, out):
    mbarrier.arrive(bar.index(0))
    mbarrier.wait(bar.index(0), 0)
    _fill(out, N, 2.0, 1)


@gluon.jit
def mbarrier_in_worker_kernel(out):
    bar = _one_mbarrier()
    gl.warp_specialize([(_default, (out,)), (_arrive_then_fill, (bar, out))], [1], [24])
    _fill(out, 2 * N, 3.0, 4)


def main() -> int:
    import torch  # here: the kernels also compile without torch (gluon_compile_sm90.py)

    expected = torch.cat([torch.full((N.value,), float(v)) for v in (1, 2, 3)]).cuda()
    failed = 0
    for name, kernel in (("plain", plain_kernel), ("one_worker", one_worker_kernel),
                         ("two_workers", two_workers_kernel),
                         ("prefill_shape", prefill_shape_kernel),
                         ("three_workers", three_workers_kernel),
                         ("two_warp_worker", two_warp_worker_kernel),
                         ("one_worker_mbarrier", one_worker_mbarrier_kernel),
                         ("mbarrier_unused", mbarrier_unused_kernel),
                         ("mbarrier_in_worker", mbarrier_in_worker_kernel)):
        out = torch.full((3 * N.value,), float("nan"), device="cuda")
        kernel[(2,)](out, num_warps=4)
        torch.cuda.synchronize()
        ok = torch.equal(out, expected)
        failed += not ok
        print(f"{'ok' if ok else 'FAILED'} {name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
