"""fast_launch: a planned launch goes through Triton's launch once per key, then straight to
the compiled kernel's launcher. Checked on a CPU with a stand-in kernel (what Triton's
launch returns and what its launcher receives); the GPU tests run the real thing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedattn.ops.triton import fast_launch

CUDA0 = torch.device("cuda", 0)


class HookChain:
    """Triton's chain of launch hooks (knobs.runtime.launch_enter_hook), as far as used."""

    def __init__(self, calls=()):
        self.calls = list(calls)


class Kernel:
    """A compiled kernel: records what its launcher gets."""

    def __init__(self, fail=False):
        self.function, self.packed_metadata, self.launches, self.fail = "fn", "meta", [], fail

    def run(self, *launch):
        if self.fail:
            raise TypeError("another launcher")
        self.launches.append(launch)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream, args)


class JitFunction:
    """A @triton.jit function: `fn[grid](*args, **constexprs)` compiles and launches."""

    def __init__(self, arg_names, kernel=None):
        self.arg_names, self.compiles = arg_names, []
        self.kernel = kernel or Kernel()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            return self.kernel
        return launch


@pytest.fixture
def runtime(monkeypatch):
    """Direct launches on, a fresh kernel cache, Triton's runtime stood in for (stream of a
    device: 100 + its index; empty hook chains), device 0 current."""
    hooks = SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain())
    monkeypatch.setattr(fast_launch, "_fast", True)
    monkeypatch.setattr(fast_launch, "_compiled", {})
    monkeypatch.setattr(fast_launch, "_get_stream", lambda index: 100 + index)
    monkeypatch.setattr(fast_launch, "_hooks", hooks)
    monkeypatch.setattr(fast_launch, "_runtime", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return hooks


def launch_of(fn, device=CUDA0, **constexprs):
    return fast_launch.KernelLaunch(fn, (4, 2), constexprs or dict(BLOCK=16), 4, 1, ("plan",),
                                    device)


def test_the_first_call_compiles_later_ones_launch_directly(runtime):
    fn = JitFunction(["X", "n", "BLOCK"])
    launch = launch_of(fn)
    launch(("x", 7), ("key",))
    assert len(fn.compiles) == 1 and fn.kernel.launches == []
    launch(("x", 7), ("key",))
    launch(("y", 8), ("key",))
    assert len(fn.compiles) == 1
    # grid padded to 3-D, the device's stream, no metadata or hooks (the chains are empty),
    # then the runtime arguments and the constexprs in signature order
    assert fn.kernel.launches == [(4, 2, 1, 100, "fn", "meta", None, None, None, "x", 7, 16),
                                  (4, 2, 1, 100, "fn", "meta", None, None, None, "y", 8, 16)]


def test_another_call_key_or_none_goes_through_tritons_launch(runtime):
    fn = JitFunction(["X", "BLOCK"])
    launch = launch_of(fn)
    launch(("x",), ("a",))
    launch(("x",), ("b",))
    launch(("x",), None)
    launch(("x",), None)
    assert len(fn.compiles) == 4 and fn.kernel.launches == []


def test_a_new_plan_finds_the_kernel_an_equal_launch_compiled(runtime):
    fn = JitFunction(["X", "BLOCK"])
    launch_of(fn)(("x",), ("key",))
    launch_of(fn)(("x",), ("key",))
    assert len(fn.compiles) == 1 and len(fn.kernel.launches) == 1
    launch_of(fn, BLOCK=32)(("x",), ("key",))  # other constexprs: another kernel
    assert len(fn.compiles) == 2


def test_launches_go_to_the_plans_device(runtime, monkeypatch):
    fn = JitFunction(["X", "BLOCK"])
    launch = launch_of(fn, torch.device("cuda", 1))
    launch(("x",), ("key",))  # compiled while device 0 is current: not kept
    launch(("x",), ("key",))
    assert len(fn.compiles) == 2
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    launch(("x",), ("key",))
    launch(("x",), ("key",))
    assert len(fn.compiles) == 3 and fn.kernel.launches[0][3] == 101


def test_a_profilers_hooks_are_honoured(runtime):
    fn = JitFunction(["X", "BLOCK"])
    launch = launch_of(fn)
    launch(("x",), ("key",))
    enter = runtime.launch_enter_hook = HookChain([print])
    launch(("x",), ("key",))
    (*head, metadata, got_enter, got_exit, x, block), = fn.kernel.launches
    assert metadata == ("metadata", (4, 2, 1), 100, ("x", 16))
    assert got_enter is enter and got_exit is None and (x, block) == ("x", 16)
    runtime.launch_enter_hook = None  # an older Triton's unset hook
    exit_hook = runtime.launch_exit_hook = print  # and its plain callable
    launch(("x",), ("key",))
    assert fn.kernel.launches[-1][6:9] == (None, None, exit_hook)


def test_a_launcher_that_refuses_the_arguments_gives_the_fast_path_up(runtime):
    fn = JitFunction(["X", "BLOCK"], Kernel(fail=True))
    launch = launch_of(fn)
    launch(("x",), ("key",))
    launch(("x",), ("key",))  # the direct launch fails: Triton's launch instead
    assert len(fn.compiles) == 2 and not fast_launch.fast_path_enabled()


def test_constexprs_not_last_in_the_signature_keep_tritons_launch(runtime):
    fn = JitFunction(["BLOCK", "X"])
    launch = launch_of(fn)
    for _ in range(3):
        launch(("x",), ("key",))
    assert len(fn.compiles) == 3 and fn.kernel.launches == []


def test_under_the_interpreter_every_launch_is_tritons(runtime, monkeypatch):
    monkeypatch.setattr(fast_launch, "_fast", False)
    fn = JitFunction(["X", "BLOCK"])
    launch = launch_of(fn)
    for _ in range(3):
        launch(("x",), ("key",))
    assert len(fn.compiles) == 3


# Outside the interpreter (where the GPU runs them) Triton walks each kernel's source for what
# it references, to key its compile cache; a kernel calling a plain Python function of ours
# (directly or through a constexpr function) fails there on its first launch, which the
# interpreter never shows.
KEY_WALK = """
import importlib, pkgutil, triton
import pagedattn.ops.triton as pkg
walked, failed = 0, []
for m in pkgutil.iter_modules(pkg.__path__):
    if m.name.startswith("gluon") or m.name == "attention_gluon":
        continue  # Gluon kernels: Triton 3.6's dialect, walked on the GPU machine
    mod = importlib.import_module("pagedattn.ops.triton." + m.name)
    for name, obj in vars(mod).items():
        if isinstance(obj, triton.runtime.jit.JITFunction) and obj.__module__ == mod.__name__:
            walked += 1
            try:
                obj.cache_key
            except Exception as e:
                failed.append(f"{m.name}.{name}: {e}")
print(walked)
print(failed)
"""


def test_every_kernel_passes_tritons_dependency_walk():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", KEY_WALK], capture_output=True, text=True,
                       env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    walked, failed = r.stdout.strip().splitlines()[-2:]
    assert int(walked) > 30, r.stdout
    assert failed == "[]", failed


def test_the_constexprs_go_in_signature_order_with_each_launchs_own_values(runtime):
    # The order is the signature's, kept per function and names; the values are each launch's
    fn = JitFunction(["X", "n", "B", "A"])
    first = launch_of(fn, A=1, B=2)
    second = launch_of(fn, A=3, B=4)  # the same names: the kept order, its own values
    for launch in (first, second, first):
        launch(("x", 7), ("key",))
        launch(("x", 7), ("key",))
    assert [call[-2:] for call in fn.kernel.launches] == [(2, 1), (4, 3), (2, 1), (2, 1)]
    assert fast_launch.tail_names(fn, ("A", "B")) == ("B", "A")
    assert fast_launch.tail_names(fn, ("A", "n")) is None  # not the signature's last two
    other = JitFunction(["Y", "A", "B"])  # another function, the same names: its own order
    assert fast_launch.tail_names(other, ("A", "B")) == ("A", "B")
    launch_of(other, A=5, B=6)(("y",), ("key",))
    launch_of(other, A=5, B=6)(("y",), ("key",))
    assert other.kernel.launches[-1][-2:] == (5, 6)
