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

A direct launch is a few attribute reads and the launcher call: the plan's device index is
fixed when the plan is made (its tensors live there; the launch goes to that device's
current stream, as a PyTorch op on them would), the compiled kernel's launcher, function and
metadata are read once, and Triton's launch hooks are passed only when one is set (a
profiler's), as Triton's own launch does.

Version-specific: `CompiledKernel.run(grid_x, grid_y, grid_z, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *all_args)` (Triton 3.3 to 3.9).
Anything unexpected (the interpreter, another signature) falls back to the normal launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from pagedattn import envs

# (static key id, call key, device index) -> a direct launch (`_direct_launch`): what a new
# plan's first call finds when an earlier plan compiled the same kernel.
_compiled: dict[Any, tuple] = {}
_static_ids: dict[Any, int] = {}  # a launch's static key -> a small int (hashed once)
_tails: dict[tuple, tuple] = {}  # (id(fn), constexpr names) -> (fn, `tail_names`)
_fast: Optional[bool] = None  # None: undecided; False: use Triton's normal launch
# Triton's stream getter and runtime knobs (launch hooks), looked up at the first compile.
_get_stream: Optional[Callable[[int], int]] = None
_hooks: Any = None


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
    global _fast
    if _fast is None:
        _fast = not envs.TRITON_INTERPRET and _triton_internals_ok()
    return _fast


def _give_up_fast_path() -> None:
    global _fast
    _fast = False


def _triton_internals_ok() -> bool:
    try:
        from triton import knobs  # noqa: F401
        from triton.runtime import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _runtime() -> tuple[Any, Any]:
    """Triton's stream getter and its runtime knobs (launch hooks), looked up once."""
    global _get_stream, _hooks
    if _get_stream is None:
        from triton import knobs
        from triton.runtime import driver

        _get_stream, _hooks = driver.active.get_current_stream, knobs.runtime
    return _get_stream, _hooks


def _hook_active(hook: Any) -> bool:
    """A launch hook that would do something: set, and not an empty HookChain."""
    return bool(getattr(hook, "calls", hook))


def stream_key(device: torch.device) -> Optional[tuple[int, int]]:
    """(device index, current stream) of a CUDA device, as a launch there would use them;
    None off CUDA (the interpreter runs in the caller's order)."""
    if device.type != "cuda":
        return None
    index = _device_index(device)
    return index, _runtime()[0](index)


def _device_index(device: Optional[torch.device]) -> int:
    """The CUDA device a plan's tensors live on (its launches go to that device's current
    stream); -1 off CUDA, where nothing launches directly."""
    if device is None or device.type != "cuda":
        return -1
    return torch.cuda.current_device() if device.index is None else device.index


class KernelLaunch:
    """One launch of `fn` on a fixed grid with fixed constexprs and launch options (warps,
    stages and any other compile `options`, e.g. enable_fp_fusion), on the plan's `device`.

    `__call__(args, call_key)`: `args` are the kernel's runtime arguments in order (the
    constexprs are fixed here and must come after them in the kernel's signature); `call_key`
    describes what the caller's per-call tensors bring (dtypes, strides, alignment), or None
    to force Triton's normal launch (e.g. an unaligned tensor the caller did not key).
    """

    def __init__(self, fn: Callable, grid: tuple[int, ...], constexprs: dict[str, Any],
                 num_warps: int, num_stages: int, plan_key: tuple,
                 device: Optional[torch.device] = None, options: Optional[dict] = None):
        self.fn, self.grid = fn, tuple(grid) + (1,) * (3 - len(grid))
        options = options or {}
        self.kwargs = dict(constexprs, num_warps=num_warps, num_stages=num_stages, **options)
        self.constexprs = constexprs
        self.device_index = _device_index(device)
        static = (id(fn), tuple(constexprs.items()), num_warps, num_stages, plan_key,
                  tuple(sorted(options.items())))
        self.key = _static_ids.setdefault(static, len(_static_ids))
        self._const_tail = _const_tail(fn, constexprs)
        self._kernels: dict[Any, tuple] = {}  # call key -> direct launch, this launch's own
        fast_path_enabled()  # decided once, here: a call reads the answer

    def __call__(self, args: tuple, call_key: Optional[tuple]) -> None:
        if call_key is None or not _fast:  # the interpreter, or a call Triton must specialise
            self.fn[self.grid](*args, **self.kwargs)
            return
        direct = self._kernels.get(call_key)
        if direct is None:
            direct = _compiled.get((self.key, call_key, self.device_index))
            if direct is not None:
                self._kernels[call_key] = direct
        if direct is not None:
            run, function, packed_metadata, kernel = direct
            hooks = _hooks
            enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
            # _hook_active inline: a set hook, or a HookChain with calls (a profiler's)
            if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
                if self._launch_hooked(kernel, args, enter, leave):
                    return
            else:
                grid = self.grid
                try:
                    run(grid[0], grid[1], grid[2], _get_stream(self.device_index),
                        function, packed_metadata, None, None, None, *args,
                        *self._const_tail)
                    return
                except (TypeError, AttributeError):  # another Triton's launcher
                    _give_up_fast_path()
        self._compile(args, call_key)

    def _compile(self, args: tuple, call_key: Optional[tuple]) -> None:
        """Triton's normal launch (compiles or finds the kernel); its kernel is kept for
        direct launches when the call is keyed and the plan's device is the current one
        (the kernel is loaded there)."""
        kernel = self.fn[self.grid](*args, **self.kwargs)
        if call_key is None or kernel is None or self._const_tail is None or \
                not fast_path_enabled() or torch.cuda.current_device() != self.device_index:
            return
        _runtime()
        direct = (kernel.run, kernel.function, kernel.packed_metadata, kernel)
        _compiled[(self.key, call_key, self.device_index)] = direct
        self._kernels[call_key] = direct

    def _launch_hooked(self, kernel: Any, args: tuple, enter: Any, leave: Any) -> bool:
        """A direct launch with Triton's launch hooks (a profiler's): the enter hook gets the
        launch's metadata, as in Triton's own launch."""
        stream = _get_stream(self.device_index)
        full = args + self._const_tail
        enter = enter if _hook_active(enter) else None
        leave = leave if _hook_active(leave) else None
        metadata = kernel.launch_metadata(self.grid, stream, *full) if enter is not None \
            else None
        try:
            kernel.run(self.grid[0], self.grid[1], self.grid[2], stream, kernel.function,
                       kernel.packed_metadata, metadata, enter, leave, *full)
        except (TypeError, AttributeError):  # another Triton's launcher: give the fast path up
            _give_up_fast_path()
            return False
        return True


def _const_tail(fn: Any, constexprs: dict[str, Any]) -> Optional[tuple]:
    """The constexprs' values in the order the kernel's signature ends with them (a compiled
    kernel's launcher takes every argument); None if they are not its last parameters (such
    a launch always goes through Triton's normal path)."""
    names = tail_names(fn, tuple(constexprs))
    return None if names is None else tuple(map(constexprs.__getitem__, names))


def tail_names(fn: Any, names: tuple[str, ...]) -> Optional[tuple[str, ...]]:
    """The parameters `names` (a launch's constexprs) in the order `fn`'s signature ends with
    them, or None where they are not its last parameters. Of the signature alone, so kept: a
    plan's launch asks it every time it is made (sorting the Gluon kernel's 79 parameters was
    ~1.3 of its launch's ~6 us to make on a CPU). Kept by the function's id (a jitted
    function's own hash reads its cache key), beside the function, so a reused id is not
    mistaken for it."""
    kept = _tails.get((id(fn), names))
    if kept is not None and kept[0] is fn:
        return kept[1]
    params = list(getattr(fn, "arg_names", ()))
    tail = params[len(params) - len(names):] if names else []
    order = tuple(tail) if set(tail) == set(names) else None
    _tails[(id(fn), names)] = (fn, order)
    return order
