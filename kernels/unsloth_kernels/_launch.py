"""Launching a compiled Triton kernel with less host time than `kernel[grid](...)`.

On the small memory-bound ops (norms, RoPE, the activations) the host's time to issue a launch is
as long as the GPU's time to run it. Triton's entry point (JITFunction.run) spends much of it on
work that gives the same answer on every call of a launcher: binding arguments to parameters,
parsing options, reading environment variables, building launch metadata for hooks nobody set.
`bench/tune_kernels.py --only host` times both paths (docs/benchmarks.md, "Tuned constants").

`direct_launch` keeps Triton's path for the first launch of each kind of arguments (it compiles,
specialises and launches as usual) and remembers the compiled kernel it chose. Later launches
with arguments of the same kind call that compiled kernel directly. "Kind" is everything Triton
specialises a kernel on, taken as finely as Triton does or more, so a remembered kernel is always
the one Triton would pick:
- a tensor: its dtype, whether its address is 16-byte aligned, and whether it is on the GPU
  (Triton's path rejects memory the GPU cannot reach; the direct path passes the address alone);
- an int from 2 to 2**31 - 1 (sizes, strides): whether it is a multiple of 16. Other ints (1 is a
  constant to Triton; 0, negatives and 64-bit values are rare) are keyed by value;
- a float: nothing (always fp32);
- anything else (bool, None, constexpr values, options such as num_warps): its type and value.

Triton's own path is used throughout where this shortcut is not known to hold: under the CPU
interpreter (its kernels are not JITFunctions), on ROCm (whose Triton also specialises on a
tensor's size, for buffer loads), on Triton releases without `triton.knobs` (before 3.4: their
launchers took other arguments), and while a launch hook is installed (profilers such as Proton
must see every launch).
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.jit import JITFunction


def _kinds(args) -> tuple[list, list]:
    """(kinds, values): what Triton specialises a kernel on, per argument (see the module
    docstring), and the arguments as the compiled launcher takes them, a tensor as its address.
    Given a tensor, that launcher would call its data_ptr() again and ask the driver about the
    pointer, on every launch: Triton's own path has checked it on this kind's first launch, and
    a tensor not on the GPU is a kind of its own. One loop, no call per argument: this runs on
    every launch."""
    kinds, values = [], []
    for arg in args:
        kind = type(arg)
        if kind is int:
            kinds.append(("D" if arg % 16 == 0 else "i") if 1 < arg < 0x80000000 else arg)
        elif kind is float:
            kinds.append(float)
        elif isinstance(arg, torch.Tensor):
            address = arg.data_ptr()
            kinds.append((arg.dtype, address % 16 == 0, arg.is_cuda))
            arg = address
        else:
            kinds.append((kind, arg))  # by type too: True == 1, but Triton types a bool apart
        values.append(arg)
    return kinds, values


def _hooks_installed() -> bool:
    runtime = triton.knobs.runtime
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook  # HookChains in Triton 3.6, else None or a callable
    return bool(getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


class DirectLaunch:
    """A @triton.jit kernel, launched as before with `kernel[grid](*args, **kwargs)`."""

    def __init__(self, kernel):
        self.kernel = kernel
        # (device, kinds of the positional args, keyword args) -> (compiled kernel, the keyword
        # args' values in parameter order), or None where Triton's path must be kept.
        self._compiled: dict = {}
        self._driver = None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        driver = self._driver or self._bind_driver()
        device = driver.get_current_device()
        kinds, values = _kinds(args)
        key = (device, *kinds, *kwargs.items())
        hit = self._compiled.get(key)
        if hit is None or _hooks_installed():
            return self._launch_through_triton(key, grid, args, kwargs)
        compiled, tail = hit
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        compiled.run(grid_x, grid_y, grid_z, driver.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *values, *tail)
        return compiled

    def _bind_driver(self):
        from triton.runtime.driver import driver

        self._driver = driver.active
        return self._driver

    def _launch_through_triton(self, key, grid, args, kwargs):
        compiled = self.kernel[grid](*args, **kwargs)
        if key not in self._compiled and compiled is not None:
            # Parameters after the positional ones must all be given by keyword (no defaults
            # filled in by Triton); otherwise keep Triton's path for this kind of call.
            names = self.kernel.arg_names[len(args):]
            self._compiled[key] = (compiled, tuple(kwargs[n] for n in names)) if set(names) <= kwargs.keys() else None
        return compiled

    def __getattr__(self, name):  # the JITFunction's attributes (fn, arg_names, cache...) stay reachable
        if name == "kernel":  # not set yet (copy, unpickling): no recursion through this method
            raise AttributeError(name)
        return getattr(self.kernel, name)


def direct_launch(kernel):
    """Wrap a @triton.jit kernel so its launches skip Triton's per-call bookkeeping (see above)."""
    on_rocm = getattr(torch.version, "hip", None) is not None
    if not isinstance(kernel, JITFunction) or on_rocm or not hasattr(triton, "knobs"):
        return kernel
    return DirectLaunch(kernel)
