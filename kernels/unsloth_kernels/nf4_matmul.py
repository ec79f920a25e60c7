"""y = x @ W^T (+ bias) for a few rows of x and a bitsandbytes 4-bit weight W, without materializing W.

For 2-16 rows (batch-8 decoding, GRPO rollouts) bitsandbytes dequantizes the whole weight to 16 bits
and then runs a matmul: it writes and reads ~4x the bytes of the packed weight on every step. Here
each program reads a [BLOCK_N, BLOCK_K] tile of the packed bytes and their absmax once, dequantizes
it in registers (the layout is described in nf4.py), rounds it to x's dtype (as bitsandbytes'
dense weight would be) and multiplies it into an fp32 accumulator.

Where the N tiles alone are too few programs to fill the GPU, K is split across programs too: each
writes an fp32 partial sum and a second small pass adds the partials in a fixed order (no atomics,
so the result is deterministic), adds the bias and casts.

`nf4_matmul` is a `torch.library.triton_op`, so torch.compile traces into it (the decode step is
compiled and captured in CUDA graphs) instead of breaking the graph at an opaque call. Under
TRITON_INTERPRET=1 it is an opaque custom op with a fake instead (`_utils.traceable_op`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._utils import INTERPRET, cdiv, num_sms, round_to_bf16, traceable_op
from .nf4 import Prepared4bit, offset_tensor

MAX_ROWS = 16  # rows of x one launch handles; tl.dot wants a 16-row tile anyway
MAX_SPLIT = 16  # at most this many programs share one tile's K

# Launch configurations, (BLOCK_N, BLOCK_K, warps, programs per SM, dot), by the number of rows:
# "one" (batch-1 decoding: a multiply-add reduction) and "few" (2 to MAX_ROWS rows: a 16-row tl.dot
# per step where dot is on, else a reduction per row). K is split across programs until about
# "programs per SM" programs run on each SM. Read at each launch, so bench/nf4_matmul.py --sweep can
# try others. The GPU's are that sweep's best on the H200 (docs/benchmarks.md, "Few-row NF4
# matmul"): the reduction beat tl.dot at 8 rows. The interpreter gets small tiles (its cost grows
# with tile size).
NF4_MATMUL_TUNING: dict[str, tuple[int, int, int, int, bool]] = (
    {"one": (32, 64, 4, 2, False), "few": (32, 64, 4, 2, False)}
    if INTERPRET else
    {"one": (16, 512, 4, 2, False), "few": (64, 256, 4, 4, False)}
)  # fmt: skip


@triton.jit
def _nf4_matmul_kernel(
    x_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr,
    bias_ptr, out_ptr, M, N, K, stride_xm, k_chunk,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, ROUND_BF16: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    # A step covers [BLOCK_N, BLOCK_K] weights, BLOCK_K // 2 bytes a row. Byte j holds element 2j in
    # its high nibble and 2j + 1 in its low one, so the step is two [BLOCK_N, BLOCK_K // 2] halves,
    # "high" (even columns) and "low" (odd), each multiplied by x's even or odd columns: no
    # interleaving of the nibbles in registers. The bytes are read as BLOCK_K // GROUP groups of
    # GROUP elements sharing one absmax (GROUP divides the blocksize and K is a multiple of it), so
    # a scale is loaded once per group; where K is not, GROUP is 2: a scale per byte.
    N_GROUPS: tl.constexpr = BLOCK_K // GROUP
    GROUP_BYTES: tl.constexpr = GROUP // 2
    HALF: tl.constexpr = BLOCK_K // 2
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_live = n < N
    groups = tl.arange(0, N_GROUPS)
    group_bytes = tl.arange(0, GROUP_BYTES)
    pairs = tl.arange(0, HALF)
    rows = tl.arange(0, BLOCK_M)
    # element index of (n, 0) in the flattened weight; int64, weights can pass 2**31 elements
    row_start = n.to(tl.int64) * K
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = split * k_chunk
    k_end = tl.minimum(k_begin + k_chunk, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # K is even, so a byte never straddles two weight rows, and its two elements share a block.
        first = row_start[:, None] + k0 + groups[None, :] * GROUP  # [BLOCK_N, N_GROUPS]: each group's first element
        live = n_live[:, None] & (k0 + groups[None, :] * GROUP < k_end)  # groups are whole or out of range
        block = first // BLOCKSIZE
        if NESTED:
            scale_q = tl.load(absmax_ptr + block, mask=live, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + scale_q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=live, other=0.0)
            scale = scale + tl.load(offset_ptr)  # always a tensor here: nf4_matmul puts a float offset on the device
        else:
            scale = tl.load(absmax_ptr + block, mask=live, other=0.0)
        byte = first[:, :, None] // 2 + group_bytes[None, None, :]
        packed = tl.load(packed_ptr + byte, mask=live[:, :, None], other=0).to(tl.int32)
        high = tl.reshape(tl.load(code_ptr + (packed >> 4)) * scale[:, :, None], (BLOCK_N, HALF))
        low = tl.reshape(tl.load(code_ptr + (packed & 0xF)) * scale[:, :, None], (BLOCK_N, HALF))
        if ROUND_BF16:  # the interpreter truncates fp32 -> bf16; GPUs round to nearest
            high = round_to_bf16(high)
            low = round_to_bf16(low)
        even = k0 + 2 * pairs
        if BLOCK_M == 1:
            x_even = tl.load(x_ptr + even, mask=even < k_end, other=0.0)
            x_odd = tl.load(x_ptr + even + 1, mask=even < k_end, other=0.0)
            acc += tl.sum(high.to(x_even.dtype).to(tl.float32) * x_even.to(tl.float32)[None, :]
                          + low.to(x_even.dtype).to(tl.float32) * x_odd.to(tl.float32)[None, :], axis=1)
        elif DOT:  # a 16-row tile on the tensor cores
            x_rows = x_ptr + rows[:, None] * stride_xm + even[None, :]
            x_live = (rows[:, None] < M) & (even[None, :] < k_end)
            x_even = tl.load(x_rows, mask=x_live, other=0.0)
            x_odd = tl.load(x_rows + 1, mask=x_live, other=0.0)
            high = high.to(x_even.dtype)
            low = low.to(x_even.dtype)
            if FP32:  # no TF32 for fp32 inputs; the interpreter's dot takes fp32 only (exact for 16-bit values)
                acc += tl.dot(x_even.to(tl.float32), tl.trans(high.to(tl.float32)), input_precision="ieee")
                acc += tl.dot(x_odd.to(tl.float32), tl.trans(low.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x_even, tl.trans(high))
                acc += tl.dot(x_odd, tl.trans(low))
        else:  # a multiply-add reduction per row, each row's sums put in its row of the accumulator
            high = high.to(x_ptr.dtype.element_ty).to(tl.float32)
            low = low.to(x_ptr.dtype.element_ty).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x_row = x_ptr + tl.minimum(m, M - 1) * stride_xm  # rows past M: a real row, never stored
                x_even = tl.load(x_row + even, mask=even < k_end, other=0.0).to(tl.float32)
                x_odd = tl.load(x_row + even + 1, mask=even < k_end, other=0.0).to(tl.float32)
                sums = tl.sum(high * x_even[None, :] + low * x_odd[None, :], axis=1)
                acc += tl.where(rows[:, None] == m, sums[None, :], 0.0)
    if BLOCK_M == 1:
        offsets = n
        mask = n_live
    else:
        offsets = rows[:, None] * N + n[None, :]
        mask = (rows[:, None] < M) & n_live[None, :]
    if PARTIAL:
        tl.store(out_ptr + split * M * N + offsets, acc, mask=mask)
    else:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + n, mask=n_live, other=0.0).to(tl.float32)
            if BLOCK_M == 1:
                acc += bias
            else:
                acc += bias[None, :]
        if ROUND_BF16:
            acc = round_to_bf16(acc)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(partials_ptr, bias_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: deterministic
        acc += tl.load(partials_ptr + s * MN + i, mask=live, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=live, other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=live)


def _split(n: int, k: int, block_n: int, block_k: int, programs_per_sm: int, device: torch.device) -> int:
    """How many programs share K: enough that about `programs_per_sm` programs run per SM."""
    tiles = cdiv(n, block_n)
    index = device.index if device.type == "cuda" and device.index is not None else 0
    wanted = cdiv(programs_per_sm * num_sms(index), tiles)
    return max(1, min(wanted, MAX_SPLIT, cdiv(k, block_k)))


def _group(k: int, blocksize: int, block_k: int) -> int:
    """Elements per scale group (see the kernel): the block, or the step where the block is longer,
    when K is a multiple of a power-of-two blocksize; else 2 (a scale per byte)."""
    if blocksize & (blocksize - 1) == 0 and k % blocksize == 0:
        return min(blocksize, block_k)
    return 2


def _nf4_matmul_launch(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, code: torch.Tensor, absmax2: torch.Tensor,
    code2: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None, n: int, blocksize: int, blocksize2: int,
    nested: bool,
) -> torch.Tensor:  # fmt: skip
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    block_n, block_k, warps, programs_per_sm, dot = NF4_MATMUL_TUNING["one" if m == 1 else "few"]
    split = _split(n, k, block_n, block_k, programs_per_sm, x.device)
    k_chunk = cdiv(cdiv(k, split), block_k) * block_k  # whole steps per split: only the last one ends mid-step
    split = cdiv(k, k_chunk)
    partial = split > 1
    round_bf16 = INTERPRET and x.dtype == torch.bfloat16
    target = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if partial else out
    bias_arg = bias if bias is not None else out  # unread when HAS_BIAS is off
    wrap_triton(_nf4_matmul_kernel)[(cdiv(n, block_n), split)](
        x, data, scales, code, absmax2, code2, offset, bias_arg, target, m, n, k, x.stride(0), k_chunk,
        BLOCKSIZE=blocksize, BLOCKSIZE2=blocksize2, NESTED=nested,
        HAS_BIAS=bias is not None, PARTIAL=partial, ROUND_BF16=round_bf16,
        FP32=INTERPRET or x.dtype == torch.float32, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_M=1 if m == 1 else MAX_ROWS if dot else triton.next_power_of_2(m), DOT=dot,
        GROUP=_group(k, blocksize, block_k), num_warps=warps,
    )  # fmt: skip
    if partial:
        block = 1024
        wrap_triton(_sum_splits_kernel)[(cdiv(m * n, block),)](
            target, bias_arg, out, m * n, n, SPLIT=split, HAS_BIAS=bias is not None, ROUND_BF16=round_bf16,
            BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def _nf4_matmul_fake(x, data, scales, code, absmax2, code2, offset, bias, n, blocksize, blocksize2, nested):
    return x.new_empty((x.shape[0], n))


_nf4_matmul_op = traceable_op("unsloth::nf4_matmul", _nf4_matmul_launch, _nf4_matmul_fake)


def nf4_matmul(x: torch.Tensor, prepared: Prepared4bit, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) for x of shape [..., K] with at most MAX_ROWS rows in all, and a prepared
    4-bit weight W of logical shape [N, K] (out x in, as nn.Linear). Output in x's dtype."""
    if len(prepared.shape) != 2:
        raise ValueError(f"expected a 2-D weight, got shape {prepared.shape}")
    n, k = prepared.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features; the weight takes {k}")
    if k % 2:
        raise ValueError(f"K must be even (two weights per byte in one row), got {k}")
    rows = x.reshape(-1, k)
    if rows.shape[0] > MAX_ROWS:
        raise ValueError(f"nf4_matmul handles at most {MAX_ROWS} rows, got {rows.shape[0]}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    offset = offset_tensor(prepared)
    if bias is not None:
        bias = bias.contiguous()
    y = _nf4_matmul_op(rows, prepared.data, prepared.scales, prepared.code, prepared.absmax2, prepared.code2, offset,
                       bias, n, prepared.blocksize, prepared.blocksize2, prepared.nested)  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
