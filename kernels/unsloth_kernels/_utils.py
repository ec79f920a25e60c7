"""Small helpers shared by the kernel launchers: block sizes, warps, device checks."""

from __future__ import annotations

import functools
import os

import torch
import triton

# Triton's interpreter (TRITON_INTERPRET=1) runs kernels on the CPU: that is how CI tests them.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Largest row a single-block kernel handles; beyond this rows are looped over in blocks.
MAX_FUSED_SIZE = 65536


def block_size_for(n: int) -> int:
    """The power-of-two block that covers a row of n elements."""
    return triton.next_power_of_2(max(int(n), 1))


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
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cpu" and not INTERPRET:
            raise RuntimeError(
                "unsloth_kernels: tensors are on the CPU; Triton kernels need a GPU "
                "(or TRITON_INTERPRET=1 for the CPU interpreter, which is slow and meant for tests)"
            )
