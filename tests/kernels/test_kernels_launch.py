"""The direct launch path (_launch.DirectLaunch): which compiled kernel it reuses, and with what.

Its GPU side (a real compiled kernel's launcher) runs in every kernel test on a GPU. Here, without
one: the argument kinds it keys on are checked against Triton's own specialisation function, and
the launch logic against a stand-in kernel that records what it is asked to do.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import triton
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl

from unsloth_kernels import _launch
from unsloth_kernels._launch import DirectLaunch, _kinds

INTS = [0, 1, 2, 15, 16, 17, 32, 4096, 4097, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32,
        2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16, -1, -16, -17, -(2**31), -(2**31) - 1]


def _tensors():
    base = torch.zeros(64, dtype=torch.float32)
    views = [base, base[1:], base[4:], base[8:]]  # offsets of 0, 4, 16 and 32 bytes
    return views + [base.to(torch.bfloat16), base.to(torch.bfloat16)[1:], base.to(torch.bfloat16)[8:],
                    base.to(torch.float16)[8:], torch.nn.Parameter(base.to(torch.bfloat16))]


ARGS = INTS + _tensors() + [0.0, 1.0, 1e-6, True, False, None]


def _triton_specialisation(arg):
    """What Triton's launcher keys its compiled kernels on, for a specialised, aligned argument."""
    kind, attributes = native_specialize_impl(BaseBackend, arg, False, True, True)
    return kind, attributes


def test_arguments_of_one_kind_get_one_specialisation_from_triton():
    # The property the direct path rests on: two arguments it treats alike, Triton treats alike.
    # (It may split finer than Triton, e.g. ints by value outside 2..2**31-1: that only costs a
    # second cache entry.)
    for (a, kind_a), (b, kind_b) in itertools.combinations(zip(ARGS, _kinds(ARGS)[0]), 2):
        if kind_a == kind_b:
            assert _triton_specialisation(a) == _triton_specialisation(b), (a, b)


def test_sizes_and_strides_fall_into_two_kinds_as_in_triton():
    # The ints a launcher passes on every call (rows, columns, strides): a new batch length must
    # not mean a new kind, or the direct path would miss on every step of a varying-length run.
    sizes = [2, 15, 16, 17, 48, 4096, 4097, 16384, 2**31 - 16, 2**31 - 1]
    assert len(set(_kinds(sizes)[0])) == len({_triton_specialisation(n) for n in sizes}) == 2


class _OnGpu(torch.Tensor):
    """A host tensor that says it is on the GPU: the one tensor property no CPU can give."""

    is_cuda = True


class _Compiled:
    """A compiled kernel's surface as DirectLaunch uses it: run() and two handles."""

    function, packed_metadata = "function handle", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.launches.append(((grid_x, grid_y, grid_z), stream, function, metadata, args))


class _Kernel:
    """A @triton.jit kernel's surface: `kernel[grid](...)` compiles a kernel per kind and launches it."""

    arg_names = ["X", "Y", "n", "eps", "BLOCK", "FLAG"]

    def __init__(self):
        self.compiled = {}
        self.through_triton = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.through_triton += 1
            key = (tuple(_triton_specialisation(a) for a in args), tuple(sorted(kwargs.items())))
            compiled = self.compiled.setdefault(key, _Compiled())
            compiled.launches.append((grid, "triton", args, kwargs))
            return compiled
        return launch


class _Driver:
    def __init__(self):
        self.device, self.stream = 0, 1234

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return self.stream + device


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: False)
    launcher = DirectLaunch(_Kernel())
    launcher._driver = _Driver()
    return launcher


def _args(n=4096, x=None):
    x = torch.zeros(64) if x is None else x
    return (x, torch.zeros(64, dtype=torch.bfloat16), n, 1e-6)


def test_first_launch_of_a_kind_goes_through_triton_and_later_ones_do_not(launcher):
    first = launcher[(8,)](*_args(), BLOCK=128, FLAG=True, num_warps=4)
    args = _args()
    second = launcher[(3, 2)](*args, BLOCK=128, FLAG=True, num_warps=4)
    assert first is second and launcher.kernel.through_triton == 1
    grid, stream, function, metadata, passed = first.launches[-1]
    assert grid == (3, 2, 1) and stream == 1234 and (function, metadata) == ("function handle", "metadata")
    # Every parameter, in the kernel's order: positional ones (a tensor as its address), then the
    # keyword constexprs (not num_warps).
    assert passed == (*(t.data_ptr() for t in args[:2]), 4096, 1e-6, 128, True)


def test_a_new_kind_of_argument_goes_through_triton_again(launcher):
    launcher[(1,)](*_args(4096), BLOCK=128, FLAG=True)
    launcher[(1,)](*_args(4100), BLOCK=128, FLAG=True)  # not a multiple of 16: Triton specialises anew
    launcher[(1,)](*_args(1), BLOCK=128, FLAG=True)  # 1 is a constant to Triton
    launcher[(1,)](*_args(x=torch.zeros(64)[1:]), BLOCK=128, FLAG=True)  # a misaligned tensor
    launcher[(1,)](*_args(x=torch.zeros(64, dtype=torch.float16)), BLOCK=128, FLAG=True)  # another dtype
    launcher[(1,)](*_args(x=torch.zeros(64).as_subclass(_OnGpu)), BLOCK=128, FLAG=True)  # GPU memory, not host
    launcher[(1,)](*_args(), BLOCK=256, FLAG=True)  # another constexpr
    launcher[(1,)](*_args(), BLOCK=128, FLAG=True, num_warps=8)  # another option
    assert launcher.kernel.through_triton == 8
    launcher._driver.device = 1  # the same kind on another GPU: compiled for that device
    launcher[(1,)](*_args(), BLOCK=128, FLAG=True)
    assert launcher.kernel.through_triton == 9
    for n in (4112, 16 * 999):  # kinds seen before: no Triton
        launcher[(1,)](*_args(n), BLOCK=128, FLAG=True)
    assert launcher.kernel.through_triton == 9


def test_parameters_left_to_their_defaults_keep_tritons_path(launcher):
    # FLAG not given: Triton fills in its default, which the direct path does not know.
    launcher[(1,)](*_args(), BLOCK=128)
    launcher[(1,)](*_args(), BLOCK=128)
    assert launcher.kernel.through_triton == 2


def test_installed_launch_hooks_see_every_launch(launcher, monkeypatch):
    launcher[(1,)](*_args(), BLOCK=128, FLAG=True)
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: True)
    launcher[(1,)](*_args(), BLOCK=128, FLAG=True)
    assert launcher.kernel.through_triton == 2


def test_hooks_are_read_from_triton():
    hooks = triton.knobs.runtime.launch_enter_hook
    assert not _launch._hooks_installed()
    hook = lambda *args: None  # noqa: E731
    hooks.add(hook)
    try:
        assert _launch._hooks_installed()
    finally:
        hooks.remove(hook)


def test_interpreter_kernels_are_left_alone():
    kernel = _Kernel()  # not a JITFunction, as the interpreter's kernels are not
    assert _launch.direct_launch(kernel) is kernel


def test_the_kernels_attributes_stay_reachable_and_a_copy_launches_alike(launcher):
    assert launcher.arg_names == _Kernel.arg_names
    launcher[(1,)](*_args(), BLOCK=128, FLAG=True)
    twin = copy.copy(launcher)
    twin[(1,)](*_args(), BLOCK=128, FLAG=True)
    assert twin.kernel is launcher.kernel and launcher.kernel.through_triton == 1
