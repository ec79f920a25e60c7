"""Row gather for an embedding table that may live in pinned host memory.

A frozen input embedding (LoRA training) is read a few thousand rows per step, yet on the GPU it
holds vocab x hidden weights: 1 GiB for Llama 3's 128256 x 4096 in bf16. Pinned host memory is
mapped into the GPU's address space (unified addressing, on CUDA and ROCm alike), so a kernel can
read just the rows a batch needs straight over PCIe: no host-side gather, no synchronisation with
the host, and the table costs no device memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import direct_launch
from ._utils import block_size_for, cdiv

_MAX_BLOCK = 4096  # columns per program: 8 KiB of bf16, a long contiguous read over PCIe


@direct_launch
@triton.jit
def _gather_rows_kernel(TABLE, IDS, OUT, n_cols, stride_table, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    index = tl.load(IDS + row).to(tl.int64)
    tl.store(OUT + row * n_cols + cols, tl.load(TABLE + index * stride_table + cols, mask=mask), mask=mask)


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] computed on ids' device: (*ids.shape, table.shape[1]).

    `table` (rows, cols) may be on that device or in pinned host memory. Ids must be in range
    (as for `F.embedding`; they are not checked on the device).
    """
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"gather_rows: table must be 2-D with unit column stride; got {tuple(table.shape)}")
    if table.device.type == "cpu" and ids.device.type != "cpu" and not table.is_pinned():
        raise ValueError("gather_rows: a host table must be in pinned memory for the GPU to read it")
    n_cols = table.shape[1]
    flat = ids.reshape(-1)
    out = torch.empty((flat.numel(), n_cols), dtype=table.dtype, device=ids.device)
    if flat.numel():
        block = min(_MAX_BLOCK, block_size_for(n_cols))
        _gather_rows_kernel[(flat.numel(), cdiv(n_cols, block))](table, flat, out, n_cols, table.stride(0), BLOCK=block)
    return out.view(*ids.shape, n_cols)
