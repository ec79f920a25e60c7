"""Small helpers shared by the kernel launchers: block sizes, warps, device checks."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ._launch import direct_launch

# Triton's interpreter (TRITON_INTERPRET=1) runs kernels on the CPU: that is how CI tests them.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Largest row a single-block kernel handles; beyond this rows are looped over in blocks.
MAX_FUSED_SIZE = 65536


# Launchers run on every step, and on small ops their host time is the step time: plain integer
# arithmetic here, not triton.cdiv / triton.next_power_of_2 (which go through Triton's
# constexpr-function machinery, tens of microseconds per call).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_size_for(n: int) -> int:
    """The power-of-two block that covers a row of n elements."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def num_warps_for(block: int) -> int:
    """Warps for a row-wise kernel of this block size (the heuristic the field converged on)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def is_hip() -> bool:
    """True on ROCm builds of torch: warps are 64 wide there, so some tunings differ."""
    return getattr(torch.version, "hip", None) is not None


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int = 0) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def traceable_op(name: str, launch, fake):
    """`launch` (which calls its kernels through `wrap_triton`) as a torch.library op torch.compile traces
    into. Under the interpreter a kernel is not a JITFunction and torch cannot trace into it (wrap_triton
    hands it back as is), so the op is opaque there, with `fake` for compile: the CPU tests' form."""
    if INTERPRET:
        op = torch.library.custom_op(name, mutates_args=())(launch)
        op.register_fake(fake)
        return op
    return torch.library.triton_op(name, mutates_args=())(launch)


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels need tensors on a GPU, or on the CPU under the Triton interpreter."""
    if INTERPRET:
        return
    for t in tensors:
        if t is not None and t.is_cpu:
            raise RuntimeError(
                "unsloth_kernels: tensors are on the CPU; Triton kernels need a GPU "
                "(or TRITON_INTERPRET=1 for the CPU interpreter, which is slow and meant for tests)"
            )


# --- row-wise kernels (norms): tiling and work split, shared by rms_norm and layer_norm ---

# Launch parameters of the row-wise kernels, chosen with bench/tune_kernels.py, which sweeps them
# (they are module state for that reason; its measurements: docs/benchmarks.md, "Tuned constants"):
#   tile            elements per tile: BLOCK_M stacks rows of BLOCK_N until a tile holds this many
#   warps           None = the size heuristic (num_warps_for)
#   programs_per_sm backward only: programs each walking a contiguous chunk of rows (see split_rows)
# Forward: two rows per 16-warp program. Backward: two rows per step, 16 warps, 2 programs per SM.
# 16 warps is also the most a program may have on ROCm (64-wide warps, 1024 threads).
NORM_TUNING = {
    "forward": {"tile": 8192, "warps": 16},
    "backward": {"tile": 8192, "warps": 16, "programs_per_sm": 2},
}


# row_tile and split_rows run on every norm call: memoised on their inputs and the tuning values
# (read per call, so a sweep that edits NORM_TUNING still takes effect).
def row_tile(n_cols: int, direction: str) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps): BLOCK_N covers the row; BLOCK_M stacks rows up to the tile size."""
    tuning = NORM_TUNING[direction]
    return _row_tile(n_cols, tuning["tile"], tuning["warps"])


@functools.lru_cache(maxsize=256)
def _row_tile(n_cols: int, tile: int, warps: int | None) -> tuple[int, int, int]:
    block_n = block_size_for(n_cols)
    block_m = max(1, min(64, tile // block_n))
    return block_m, block_n, warps or num_warps_for(block_m * block_n)


def split_rows(n_rows: int, block_m: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows each) for a backward that reduces over rows.

    Several programs per SM keep enough loads in flight to saturate memory (one program per SM
    walking rows one at a time is latency-bound); each walks a contiguous chunk of rows, a
    multiple of block_m, and leaves one fp32 partial row of the weight gradient.
    """
    return _split_rows(n_rows, block_m, NORM_TUNING["backward"]["programs_per_sm"], device.index or 0)


@functools.lru_cache(maxsize=1024)  # one entry per batch length seen
def _split_rows(n_rows: int, block_m: int, per_sm: int, device_index: int) -> tuple[int, int]:
    n_programs = max(1, min(cdiv(n_rows, block_m), per_sm * num_sms(device_index)))
    rows_per_program = max(1, cdiv(cdiv(n_rows, n_programs), block_m)) * block_m
    return cdiv(n_rows, rows_per_program), rows_per_program


def rows_of(t: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, int]:
    """t as rows of n_cols for a row-wise kernel, which takes a pointer and a row stride:
    (tensor, row stride). A contiguous t goes as it is, whatever its shape: a reshaped view costs
    a microsecond or more of host time, on every step of ops whose step time is host time.
    Otherwise a 2-D view with unit column stride, copied only if it must be."""
    if t.is_contiguous():
        return t, n_cols
    t = t.reshape(-1, n_cols)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0)


# --- the last step of a row-reducing backward: partial sums -> weight gradients ---

# Partial rows per step and columns per program of sum_partials. The backward leaves
# programs_per_sm * SMs partial rows (264 with 132 SMs): (128, 32) fp32 tiles take them in 3 steps of
# eight 16-byte loads per thread at 4 warps, and 4096 columns give 128 programs per group.
SUM_BLOCK_P = 128
SUM_BLOCK_N = 32


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16 to nearest-even, as torch's `.to()` and GPU casts do.

    Triton's CPU interpreter truncates fp32 -> bf16, so there the rounding is spelled out in
    integer ops (finite inputs only).
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _store_sum(OUT, cols, total, mask, ROUND_BF16: tl.constexpr):
    if ROUND_BF16:
        if OUT.dtype.element_ty == tl.bfloat16:
            total = round_to_bf16(total)
    tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=mask)


@direct_launch
@triton.jit
def _sum_partials(
    PARTIALS, OUT0, OUT1, n_partials, n_cols,
    ROUND_BF16: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """OUT<g>[c] = sum over p of PARTIALS[g, p, c]: summed in fp32, stored in OUT<g>'s dtype."""
    group = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    PARTIALS += group.to(tl.int64) * n_partials * n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for first in range(0, n_partials, BLOCK_P):
        rows = first + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < n_partials) & col_mask[None, :]
        acc += tl.load(PARTIALS + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if group == 0:
        _store_sum(OUT0, cols, total, col_mask, ROUND_BF16)
    else:
        _store_sum(OUT1, cols, total, col_mask, ROUND_BF16)


def sum_partials(partials: torch.Tensor, out0: torch.Tensor, out1: torch.Tensor | None = None) -> None:
    """out0 = partials[0].sum(0) (and out1 = partials[1].sum(0)), cast to their dtypes, in ONE launch.

    `partials` is a contiguous fp32 (groups, P, N) buffer of per-program partial sums; this
    replaces `partials.sum(1)` plus a cast per output (three launches or more, on every step).
    """
    n_groups, n_partials, n_cols = partials.shape
    _sum_partials[(cdiv(n_cols, SUM_BLOCK_N), n_groups)](
        partials, out0, out0 if out1 is None else out1, n_partials, n_cols,
        ROUND_BF16=INTERPRET, BLOCK_P=SUM_BLOCK_P, BLOCK_N=SUM_BLOCK_N, num_warps=4,
    )
