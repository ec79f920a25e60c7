"""Small helpers shared by the kernel launchers: block sizes, warps, device checks."""

from __future__ import annotations

import functools
import os

import torch

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

# Launch parameters of the row-wise kernels, measured on an H200 at 16384 x 4096 (bf16) with
# bench/tune_kernels.py, which sweeps them (they are module state for that reason):
#   tile            elements per tile: BLOCK_M stacks rows of BLOCK_N until a tile holds this many
#   warps           None = the size heuristic (num_warps_for)
#   programs_per_sm backward only: programs each walking a contiguous chunk of rows (see split_rows)
# Forward: two rows per 16-warp program, 0.071 ms (the copy floor is 0.060). Backward: two rows per
# step, 16 warps, 2 programs per SM, 0.13 ms for RMSNorm (floor 0.09). 16 warps is also the most a
# program may have on ROCm (64-wide warps, 1024 threads).
NORM_TUNING = {
    "forward": {"tile": 8192, "warps": 16},
    "backward": {"tile": 8192, "warps": 16, "programs_per_sm": 2},
}


def row_tile(n_cols: int, direction: str) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps): BLOCK_N covers the row; BLOCK_M stacks rows up to the tile size."""
    tuning = NORM_TUNING[direction]
    block_n = block_size_for(n_cols)
    block_m = max(1, min(64, tuning["tile"] // block_n))
    return block_m, block_n, tuning["warps"] or num_warps_for(block_m * block_n)


def split_rows(n_rows: int, block_m: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows each) for a backward that reduces over rows.

    Several programs per SM keep enough loads in flight to saturate memory (one program per SM
    walking rows one at a time is latency-bound); each walks a contiguous chunk of rows, a
    multiple of block_m, and leaves one fp32 partial row of the weight gradient.
    """
    per_sm = NORM_TUNING["backward"]["programs_per_sm"]
    n_programs = max(1, min(cdiv(n_rows, block_m), per_sm * num_sms(device.index or 0)))
    rows_per_program = max(1, cdiv(cdiv(n_rows, n_programs), block_m)) * block_m
    return cdiv(n_rows, rows_per_program), rows_per_program


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """A 2-D (rows, n_cols) view with unit column stride (copies only if it must)."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(-1) == 1 else t.contiguous()
