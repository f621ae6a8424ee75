"""Launch a planned Triton kernel without Triton's per-call re-specialisation.

`kernel[grid](*args, **constexprs)` binds and specialises every argument on every call
(pointer dtype and 16-byte alignment, integers equal to 1 or divisible by 16), hashes the
result and looks the compiled kernel up: tens of microseconds for a kernel of ~50 arguments.
A plan knows its launch ahead of time, so `KernelLaunch` does that once: the first call with
a given key goes through Triton's normal path, which compiles (or finds) the kernel and
returns it; later calls with the same key hand the arguments straight to its launcher.

The key must be at least as fine as Triton's specialisation, or a call would run a kernel
compiled for other argument properties. Plans build it from what they fix (constexprs, the
specialisation of their own integers and tensors: `int_key`, `tensor_key`) and each call adds
the dtypes, strides and alignment of the tensors it brings.

A None argument is a constexpr to Triton: keys say which arguments are None.

Version-specific: `CompiledKernel.run(grid_x, grid_y, grid_z, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *all_args)` (Triton 3.3 to 3.9).
Anything unexpected (the interpreter, another signature) falls back to the normal launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from pagedattn import envs

_compiled: dict[Any, Any] = {}  # (static key id, call key, device) -> Triton CompiledKernel
_static_ids: dict[Any, int] = {}  # a launch's static key -> a small int (hashed once)
_state: dict[str, Any] = {"fast": None}  # None: undecided; False: use Triton's normal launch


def int_key(values: Sequence[int]) -> tuple:
    """What Triton specialises an integer argument on: == 1, divisible by 16, 32-bit range."""
    return tuple((v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31)) for v in values)


def tensor_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """What Triton specialises a pointer argument on: its dtype and 16-byte alignment."""
    return tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)


def spec_key(values: Sequence[Any]) -> tuple:
    """`int_key` / `tensor_key` of a mix of tensors, ints, floats and None (a None argument
    is a constexpr to Triton, so whether it is None is part of the key)."""
    key = []
    for v in values:
        if isinstance(v, torch.Tensor):
            key.append((v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, int):
            key.append(int_key([v])[0])
        else:
            key.append(None if v is None else type(v))
    return tuple(key)


def aligned(*tensors: Optional[torch.Tensor]) -> bool:
    """Every tensor given (None skipped) starts on 16 bytes."""
    ptr = 0
    for t in tensors:
        if t is not None:
            ptr |= t.data_ptr()
    return ptr % 16 == 0


def fast_path_enabled() -> bool:
    """Whether launches go straight to compiled kernels (False under the interpreter, on a
    Triton whose launcher differs, or once a direct launch failed)."""
    if _state["fast"] is None:
        _state["fast"] = not envs.TRITON_INTERPRET and _triton_internals_ok()
    return bool(_state["fast"])


def _triton_internals_ok() -> bool:
    try:
        from triton import knobs  # noqa: F401
        from triton.runtime import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _runtime() -> tuple[Any, Any]:
    """Triton's stream getter and its runtime knobs (launch hooks), looked up once."""
    if "runtime" not in _state:
        from triton import knobs
        from triton.runtime import driver

        _state["runtime"] = (driver.active.get_current_stream, knobs.runtime)
    return _state["runtime"]


def _hook_active(hook: Any) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


class KernelLaunch:
    """One launch of `fn` on a fixed grid with fixed constexprs and launch options.

    `__call__(args, call_key)`: `args` are the kernel's runtime arguments in order (the
    constexprs are fixed here and must come after them in the kernel's signature); `call_key`
    describes what the caller's per-call tensors bring (dtypes, strides, alignment), or None
    to force Triton's normal launch (e.g. an unaligned tensor the caller did not key).
    """

    def __init__(self, fn: Callable, grid: tuple[int, ...], constexprs: dict[str, Any],
                 num_warps: int, num_stages: int, plan_key: tuple):
        self.fn, self.grid = fn, tuple(grid) + (1,) * (3 - len(grid))
        self.kwargs = dict(constexprs, num_warps=num_warps, num_stages=num_stages)
        self.constexprs = constexprs
        static = (id(fn), tuple(constexprs.items()), num_warps, num_stages, plan_key)
        self.key = _static_ids.setdefault(static, len(_static_ids))
        self._const_tail: Optional[tuple] = None

    def __call__(self, args: tuple, call_key: Optional[tuple]) -> None:
        if call_key is None or not fast_path_enabled():
            self.fn[self.grid](*args, **self.kwargs)
            return
        device = torch.cuda.current_device()
        key = (self.key, call_key, device)
        kernel = _compiled.get(key)
        if kernel is not None:
            if self._launch(kernel, args, device):
                return
        kernel = self.fn[self.grid](*args, **self.kwargs)
        if kernel is not None and fast_path_enabled():
            _compiled[key] = kernel

    def _launch(self, kernel: Any, args: tuple, device: int) -> bool:
        if self._const_tail is None:
            names = list(self.fn.arg_names)[len(args):]
            if set(names) != set(self.constexprs):
                _state["fast"] = False  # constexprs not at the end: keep the normal path
                return False
            self._const_tail = tuple(self.constexprs[n] for n in names)
        get_stream, knobs = _runtime()
        stream = get_stream(device)
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        full = args + self._const_tail
        metadata = kernel.launch_metadata(self.grid, stream, *full) if _hook_active(enter) \
            else None
        try:
            kernel.run(self.grid[0], self.grid[1], self.grid[2], stream, kernel.function,
                       kernel.packed_metadata, metadata, enter, leave, *full)
        except (TypeError, AttributeError):  # another Triton's launcher: give the fast path up
            _state["fast"] = False
            return False
        return True
