"""y = x @ W^T (+ bias) for a few rows of x and a bitsandbytes 4-bit weight W, without materializing W.

For 2-16 rows (batch-8 decoding, GRPO rollouts) bitsandbytes dequantizes the whole weight to 16 bits
and then runs a matmul: it writes and reads ~4x the bytes of the packed weight on every step. Here
each program reads tiles of the packed bytes and their absmax once and dequantizes them in registers
(the layout is described in nf4.py), in one of two forms:
- the reduction (`_nf4_matmul_kernel`): level * absmax rounded to x's dtype, as bitsandbytes' dense
  weight is, multiplied into an fp32 accumulator per row of x;
- tl.dot (`_nf4_dot_kernel`): one absmax block at a time on the tensor cores, 16 rows of x against
  the block's levels in x's dtype, the product scaled by the block's absmax in fp32. On NVIDIA the
  NF4 levels are looked up in registers (`levels_asm`, `prmt`), not loaded per weight.

Where the N tiles alone are too few programs to fill the GPU, K is split across programs too: each
writes an fp32 partial sum and a second small pass adds the partials in a fixed order (no atomics,
so the result is deterministic), adds the bias and casts; with SUM_IN_GRAPH, a compiled graph does
that second pass's additions itself.

`nf4_matmul` is a `torch.library.triton_op`, so torch.compile traces into it (the decode step is
compiled and captured in CUDA graphs) instead of breaking the graph at an opaque call. Under
TRITON_INTERPRET=1 it is an opaque custom op with a fake instead (`_utils.traceable_op`).
"""

from __future__ import annotations

import functools
import os
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._utils import INTERPRET, cdiv, is_hip, num_sms, round_to_bf16, traceable_op
from .nf4 import NF4_CODE, Prepared4bit, offset_tensor

MAX_ROWS = 16  # rows of x one launch handles; tl.dot wants a 16-row tile anyway
MAX_SPLIT = 16  # at most this many programs share one tile's K
# Outputs per program of the pass that adds the K splits' partial sums: 1024 made 8 programs of a
# k / v projection's 8 x 1024 outputs on a GPU of 132 SMs
SUM_BLOCK = 256

# Launch configurations, (BLOCK_N, BLOCK_K, warps, programs per SM, form[, stages]), by the number of rows:
# "one" (batch-1 decoding) and "few" (2 to MAX_ROWS rows). The forms: "reduce", multiply-adds and a
# sum over K per row of x; "dot_w_a" and "dot_w_b", tl.dot over 16 rows of x with W's tile as the A
# operand (Hopper's warpgroup MMA takes it from registers) or the B operand (through shared memory).
# K is split across programs until about "programs per SM" programs run on each SM. "stages" (dot
# forms) pipelines the whole K loop, stages - 1 steps ahead. Without it Triton pipelines only the loads
# that reach a tl.dot (the packed bytes; x's too where they are contiguous, see X_HALVES), not the
# absmax chain (the block's byte, then its code2 entry), which then costs a round trip from memory every
# step (read from the sm_90 SASS, 2026-12-07). On an H100, with x still read strided, the stages did not
# pay; with x in halves every load of the loop is ahead of its use, and both together took the 8-row
# gate / up and down projections 4-8% under the strided, unpipelined kernel (docs/benchmarks.md,
# 2026-12-07; the small projections paid x's copy as a kernel of its own there, which the compiled
# step need not), so both kinds take 3 stages. Read at each launch, so bench/nf4_matmul.py --sweep can
# try others. The tiles are what an H200 sweep of 2026-12-06 chose for one row and for eight
# (docs/benchmarks.md, "Few-row NF4 matmul"): W as the B operand, 128 x 64 tiles (12.5 KiB of shared
# memory unpipelined, 14 KiB with 3 stages; 96-100 registers, no spills on sm_90). The interpreter gets
# small tiles (its cost grows with tile size).
FORMS = ("reduce", "dot_w_a", "dot_w_b")
NF4_MATMUL_TUNING: dict[str, tuple] = (
    {"one": (32, 64, 4, 2, "reduce"), "few": (32, 64, 4, 2, "reduce")}
    if INTERPRET else
    {"one": (128, 64, 4, 4, "dot_w_b", 3), "few": (128, 64, 4, 4, "dot_w_b", 3)}
)  # fmt: skip
# The dot forms read x with each absmax block's even columns first, then its odd ones (`_x_halves`, a copy
# of x per call), so that x's loads are contiguous and Triton pipelines them with the packed bytes'; read
# at each launch, so bench/nf4_matmul.py --ab can time the strided loads of x instead.
X_HALVES = True
# Inside a compiled graph (the decode step), leave the second pass's additions (the K splits, bias, LoRA) to
# the graph as elementwise ops (`_added_in_graph`) instead of a kernel of their own: up to 224 launches a
# token fewer on an 8B model, where Inductor folds them into its kernels (the step's wall time 10.2 -> 8.4 ms,
# docs/benchmarks.md). Read at each call; UNSLOTH_NF4_SUM_IN_GRAPH=0 at import turns it off (for an A/B).
SUM_IN_GRAPH = os.environ.get("UNSLOTH_NF4_SUM_IN_GRAPH", "1") != "0"
# Up to this LoRA rank the graph adds the rank's terms one by one: all elementwise, Inductor folds them into
# the kernel that reads the projection (RMSNorm, RoPE, SiLU x up), as measured at r=16 (804 tok/s above).
# Above it, one reduction over the rank: a kernel per projection more, but a graph that does not grow by
# three nodes per rank per projection (r=64: 1,344 a layer) and a compile time that does not grow with them.
# Read at each call; UNSLOTH_NF4_UNROLL_RANK at import sets it (0: always the reduction, for an A/B).
UNROLL_RANK = int(os.environ.get("UNSLOTH_NF4_UNROLL_RANK", "16"))
# The reduction's configuration where a dot form is set but does not apply (see _dot_applies)
REDUCE_FALLBACK = (32, 64, 4, 2, "reduce") if INTERPRET else (64, 256, 4, 4, "reduce")


@triton.jit
def _lora_delta(xa_ptr, lora_b_ptr, rows, cols, mask, RANK: tl.constexpr):
    """(xa @ B^T)[rows, cols] in fp32, elementwise over index tensors of the output's shape: a LoRA
    update added in the epilogue (xa = x @ A^T is [M, RANK], B is [N, RANK], both contiguous). Unrolled,
    so the loads of every rank are issued together, not one after another (the split-sum pass with a
    runtime loop here averaged 13 us a launch in an H100's 4-bit decode step, 2026-12-07)."""
    delta = tl.zeros(mask.shape, dtype=tl.float32)
    for j in tl.static_range(RANK):
        xa = tl.load(xa_ptr + rows * RANK + j, mask=mask, other=0.0).to(tl.float32)
        delta += xa * tl.load(lora_b_ptr + cols * RANK + j, mask=mask, other=0.0).to(tl.float32)
    return delta


@triton.jit
def _nf4_matmul_kernel(
    x_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr,
    bias_ptr, out_ptr, M, N, K, stride_xm, k_chunk, xa_ptr, lora_b_ptr, lora_scale,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RANK: tl.constexpr, PARTIAL: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
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
        if HAS_LORA:
            if BLOCK_M == 1:
                acc += lora_scale * _lora_delta(xa_ptr, lora_b_ptr, 0 * n, n, mask, RANK)
            else:
                acc += lora_scale * _lora_delta(xa_ptr, lora_b_ptr, rows[:, None], n[None, :], mask, RANK)
        if ROUND_BF16:
            acc = round_to_bf16(acc)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _bits16(value: float, dtype: torch.dtype) -> int:
    """The 16 bits of `value` rounded (to nearest, ties to even) to fp32, then bf16 or fp16. Plain Python: the
    compiled decode step traces the launch, and so this, under fake tensors, where a tensor's values
    cannot be read (that broke the graph at every projection)."""
    value = struct.unpack("<f", struct.pack("<f", value))[0]  # first to fp32, as the code table holds it
    if dtype == torch.float16:
        return struct.unpack("<H", struct.pack("<e", value))[0]
    if dtype != torch.bfloat16:
        raise ValueError(f"the levels are looked up as bf16 or fp16, not {dtype}")
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@functools.lru_cache(maxsize=None)
def levels_asm(levels: tuple[float, ...], dtype: torch.dtype) -> str:
    """PTX that looks up the 16 levels, rounded to `dtype` (bf16 or fp16), for four packed bytes
    ($4): the high nibbles' values to $0 and $1, the low nibbles' to $2 and $3, two to a register.

    After llama.cpp's lookup of a 16-entry table: `prmt` picks a byte by a selector's low three bits,
    so one call reads levels 0-7 and another 8-15 for four nibbles at once, and a third keeps one of
    the two by the nibble's top bit; done for the levels' low bytes and high bytes apart, then two
    more `prmt`s pair them into 16-bit values. No memory is read. Nibbles of $4, lowest first: byte
    0's low (element 1), byte 0's high (element 0), byte 1's low (3), ...
    """
    bits = [_bits16(level, dtype) for level in levels]
    low, high = [b & 0xFF for b in bits], [b >> 8 for b in bits]
    words = [sum(b[4 * w + i] << (8 * i) for i in range(4)) for b in (low, high) for w in range(4)]
    tables = " ".join(f"mov.b32 t{i}, {word};" for i, word in enumerate(words))  # t0-t3 low bytes, t4-t7 high
    half = """prmt.b32 a, t0, t1, sel; prmt.b32 b, t2, t3, sel; prmt.b32 l{0}, a, b, pick;
        prmt.b32 a, t4, t5, sel; prmt.b32 b, t6, t7, sel; prmt.b32 h{0}, a, b, pick;"""
    text = f"""{{
        .reg .b32 t<8>, sel, pick, a, b, l<2>, h<2>;
        {tables}
        and.b32 sel, $4, 0x77777777;
        and.b32 pick, $4, 0x88888888;
        shr.u32 pick, pick, 1;
        or.b32 pick, pick, 0x32103210;
        {half.format(0)}
        shr.u32 sel, sel, 16;
        shr.u32 pick, pick, 16;
        {half.format(1)}
        prmt.b32 $0, l0, h0, 0x7351;
        prmt.b32 $1, l1, h1, 0x7351;
        prmt.b32 $2, l0, h0, 0x6240;
        prmt.b32 $3, l1, h1, 0x6240;
        }}"""
    # one line: inductor pastes a kernel's constexpr values into a source it holds in a ''' string, where
    # a newline would end the value's own string literal
    return " ".join(text.split())


@triton.jit
def _nf4_dot_kernel(
    x_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr,
    bias_ptr, out_ptr, M, N, K, stride_xm, k_chunk, xa_ptr, lora_b_ptr, lora_scale,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RANK: tl.constexpr, PARTIAL: tl.constexpr,
    ROUND_BF16: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP_BLOCKS: tl.constexpr, LEVELS_ASM: tl.constexpr,
    W_AS_B: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr, X_HALVES: tl.constexpr,
):  # fmt: skip
    # out^T [BLOCK_N, BLOCK_M] += levels [BLOCK_N, BLOCKSIZE] @ x^T [BLOCKSIZE, BLOCK_M] * absmax, one
    # absmax block at a time. W's tile is the tensor cores' A operand (from registers on Hopper), or
    # with W_AS_B the B operand (through shared memory). The levels are 16-bit (bitsandbytes rounds
    # level * absmax instead: both round once, as finely) and each block's product is scaled in fp32,
    # so no weight is multiplied on its own. Byte j of a block holds element 2j in its high nibble and
    # 2j + 1 in its low one: the high nibbles meet x's even columns, the low ones its odd columns.
    # LEVELS_ASM (levels_asm) looks the levels up in registers; without it (FP4's code, fp32 inputs,
    # AMD, the interpreter) they are loaded from code.
    HALF: tl.constexpr = BLOCKSIZE // 2
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_live = n < N
    pairs = tl.arange(0, HALF)
    rows = tl.arange(0, BLOCK_M)
    blocks_per_row = K // BLOCKSIZE
    # rows past N read row N - 1 (never stored): no mask, so the packed bytes load 16 at a time
    first_block = tl.minimum(n, N - 1).to(tl.int64) * blocks_per_row  # int64: weights can pass 2**31 elements
    row_bytes = packed_ptr + first_block[:, None] * HALF + pairs[None, :]  # [BLOCK_N, HALF], block 0
    # [HALF, BLOCK_M]: x^T's even rows of block 0. X_HALVES: x comes with each block's even columns first,
    # then its odd ones (`_x_halves`), so both halves are contiguous loads.
    X_PAIR: tl.constexpr = 1 if X_HALVES else 2
    X_ODD: tl.constexpr = HALF if X_HALVES else 1
    x_cols = x_ptr + X_PAIR * pairs[:, None] + rows[None, :] * stride_xm
    x_live = rows[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    b_begin = split * (k_chunk // BLOCKSIZE)
    b_end = tl.minimum(b_begin + k_chunk // BLOCKSIZE, blocks_per_row)
    for b0 in tl.range(b_begin, b_end, STEP_BLOCKS, num_stages=STAGES):
        for i in tl.static_range(STEP_BLOCKS):
            b = tl.minimum(b0 + i, b_end - 1)  # a step past the split's end rereads its last block, scaled by 0
            block = first_block + b
            if NESTED:
                scale_q = tl.load(absmax_ptr + block).to(tl.int32)
                scale = tl.load(code2_ptr + scale_q) * tl.load(absmax2_ptr + block // BLOCKSIZE2)
                scale = scale + tl.load(offset_ptr)
            else:
                scale = tl.load(absmax_ptr + block)
            scale = tl.where(b0 + i < b_end, scale, 0.0)
            packed = tl.load(row_bytes + b * HALF)
            x_even = tl.load(x_cols + b * BLOCKSIZE, mask=x_live, other=0.0)
            x_odd = tl.load(x_cols + b * BLOCKSIZE + X_ODD, mask=x_live, other=0.0)
            if LEVELS_ASM is not None:
                high, low = tl.inline_asm_elementwise(LEVELS_ASM, "=r,=r,=r,=r,r", [packed],
                                                      dtype=(x_even.dtype, x_even.dtype), is_pure=True, pack=4)
            else:
                high = tl.load(code_ptr + (packed >> 4).to(tl.int32))
                low = tl.load(code_ptr + (packed & 0xF).to(tl.int32))
                if ROUND_BF16:  # the interpreter truncates fp32 -> bf16; GPUs round to nearest
                    high = round_to_bf16(high)
                    low = round_to_bf16(low)
                high = high.to(x_even.dtype)
                low = low.to(x_even.dtype)
            if FP32:  # no TF32 for fp32 inputs; the interpreter's dot takes fp32 only (exact for 16-bit values)
                high, low = high.to(tl.float32), low.to(tl.float32)
                x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            if W_AS_B:  # x is the A operand, W's tile (through shared memory) the B operand
                part = tl.dot(tl.trans(x_even), tl.trans(high), input_precision=PRECISION)
                part = tl.trans(tl.dot(tl.trans(x_odd), tl.trans(low), part, input_precision=PRECISION))
            else:
                part = tl.dot(high, x_even, input_precision=PRECISION)
                part = tl.dot(low, x_odd, part, input_precision=PRECISION)
            acc += part * scale[:, None]
    offsets = rows[None, :] * N + n[:, None]
    mask = (rows[None, :] < M) & n_live[:, None]
    if PARTIAL:
        tl.store(out_ptr + split * M * N + offsets, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_live, other=0.0).to(tl.float32)[:, None]
        if HAS_LORA:
            acc += lora_scale * _lora_delta(xa_ptr, lora_b_ptr, rows[None, :], n[:, None], mask, RANK)
        if ROUND_BF16:
            acc = round_to_bf16(acc)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(partials_ptr, bias_ptr, out_ptr, MN, N, xa_ptr, lora_b_ptr, lora_scale,
                       SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RANK: tl.constexpr,
                       ROUND_BF16: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: deterministic
        acc += tl.load(partials_ptr + s * MN + i, mask=live, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=live, other=0.0).to(tl.float32)
    if HAS_LORA:
        acc += lora_scale * _lora_delta(xa_ptr, lora_b_ptr, i // N, i % N, live, RANK)
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


def _dot_applies(k: int, blocksize: int) -> bool:
    """The tl.dot form steps one absmax block at a time: whole blocks per row, of 32 or more weights."""
    return blocksize >= 32 and blocksize & (blocksize - 1) == 0 and k % blocksize == 0


class _Plan(NamedTuple):
    """How one call is launched: the tuning's tiles and form, and K split into `split` chunks of `k_chunk`."""

    block_n: int
    block_k: int
    warps: int
    stages: int | None
    dot: bool
    form: str
    step: int
    split: int
    k_chunk: int


def _plan(m: int, n: int, k: int, blocksize: int, device: torch.device) -> _Plan:
    """The launch of an [m, k] x [n, k]^T product, as NF4_MATMUL_TUNING has it now (the op and its fake agree)."""
    block_n, block_k, warps, programs_per_sm, form, *stages = NF4_MATMUL_TUNING["one" if m == 1 else "few"]
    if form not in FORMS:
        raise ValueError(f"nf4_matmul: unknown form {form!r} (one of {FORMS})")
    dot = form != "reduce" and _dot_applies(k, blocksize)
    if form != "reduce" and not dot:
        block_n, block_k, warps, programs_per_sm, _ = REDUCE_FALLBACK
    step = max(block_k // blocksize, 1) * blocksize if dot else block_k
    split = _split(n, k, block_n, step, programs_per_sm, device)
    k_chunk = cdiv(cdiv(k, split), step) * step  # whole steps per split: only the last one ends mid-step
    return _Plan(block_n, block_k, warps, stages[0] if stages else None, dot, form, step, cdiv(k, k_chunk), k_chunk)


def _rounds_bf16(dtype: torch.dtype) -> bool:
    """Whether the kernels round to bf16 themselves: the interpreter truncates fp32 -> bf16, GPUs round to nearest."""
    return INTERPRET and dtype == torch.bfloat16


def _launch_main(plan: _Plan, x, data, scales, code, absmax2, code2, offset, bias, target, n, blocksize, blocksize2,
                 nested, nf4, lora, rank: int, partial: bool) -> None:  # fmt: skip
    """The matmul kernel of `plan` into `target`: the output, or (partial) each K split's fp32 sums, the bias
    and the LoRA term (`lora` = (xa, B, scale), of `rank`; 0: none) left to whatever adds the splits."""
    m, k = x.shape
    common = dict(BLOCKSIZE=blocksize, BLOCKSIZE2=blocksize2, NESTED=nested, HAS_BIAS=bias is not None and not partial,
                  HAS_LORA=rank > 0 and not partial, RANK=0 if partial else rank, PARTIAL=partial,
                  ROUND_BF16=_rounds_bf16(x.dtype), BLOCK_N=plan.block_n, num_warps=plan.warps)  # fmt: skip
    halves = plan.dot and X_HALVES
    if halves:
        x = _x_halves(x, blocksize)
    bias_arg = bias if bias is not None else target  # unread when HAS_BIAS is off
    args = (x, data, scales, code, absmax2, code2, offset, bias_arg, target, m, n, k, x.stride(0), plan.k_chunk, *lora)
    if plan.dot:
        fp32 = INTERPRET or x.dtype == torch.float32
        table = nf4 and not fp32 and not is_hip()  # prmt is NVIDIA's
        wrap_triton(_nf4_dot_kernel)[(cdiv(n, plan.block_n), plan.split)](
            *args, FP32=fp32, BLOCK_M=MAX_ROWS, STEP_BLOCKS=plan.step // blocksize,
            LEVELS_ASM=levels_asm(NF4_CODE, x.dtype) if table else None, W_AS_B=plan.form == "dot_w_b",
            PRECISION="ieee" if fp32 else None, STAGES=plan.stages, X_HALVES=halves, **common,
        )  # fmt: skip
    else:
        wrap_triton(_nf4_matmul_kernel)[(cdiv(n, plan.block_n), plan.split)](
            *args, BLOCK_K=plan.block_k, BLOCK_M=1 if m == 1 else triton.next_power_of_2(m),
            GROUP=_group(k, blocksize, plan.block_k), **common,
        )  # fmt: skip


def _nf4_matmul_launch(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, code: torch.Tensor, absmax2: torch.Tensor,
    code2: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None, n: int, blocksize: int, blocksize2: int,
    nested: bool, nf4: bool, xa: torch.Tensor | None, lora_b: torch.Tensor | None, lora_scale: float,
) -> torch.Tensor:  # fmt: skip
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        y = torch.zeros((m, n), dtype=torch.float32, device=x.device) if bias is None else bias.float().expand(m, n)
        return out.copy_(y if xa is None else y + lora_scale * (xa.float() @ lora_b.float().T))
    plan = _plan(m, n, k, blocksize, x.device)
    partial = plan.split > 1
    target = torch.empty((plan.split, m, n), dtype=torch.float32, device=x.device) if partial else out
    lora = (xa, lora_b, lora_scale) if xa is not None else (out, out, 0.0)  # unread without
    rank = 0 if xa is None else xa.shape[1]
    _launch_main(plan, x, data, scales, code, absmax2, code2, offset, bias, target, n, blocksize, blocksize2, nested,
                 nf4, lora, rank, partial)  # fmt: skip
    if partial:
        wrap_triton(_sum_splits_kernel)[(cdiv(m * n, SUM_BLOCK),)](
            target, bias if bias is not None else out, out, m * n, n, *lora, SPLIT=plan.split,
            HAS_BIAS=bias is not None, HAS_LORA=xa is not None, RANK=rank,
            ROUND_BF16=_rounds_bf16(x.dtype), BLOCK=SUM_BLOCK, num_warps=4,
        )  # fmt: skip
    return out


def _x_halves(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """x [M, K] with the columns of each `blocksize`-long block reordered: its even columns, then its odd
    ones, as the dot kernel multiplies them by the high and the low nibbles of the block's bytes."""
    m, k = x.shape
    return x.reshape(m, k // blocksize, blocksize // 2, 2).transpose(2, 3).reshape(m, k)


def _nf4_matmul_fake(x, data, scales, code, absmax2, code2, offset, bias, n, blocksize, blocksize2, nested, nf4, xa,
                     lora_b, lora_scale):  # fmt: skip
    return x.new_empty((x.shape[0], n))


_nf4_matmul_op = traceable_op("unsloth::nf4_matmul", _nf4_matmul_launch, _nf4_matmul_fake)


def _nf4_partials_launch(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, code: torch.Tensor, absmax2: torch.Tensor,
    code2: torch.Tensor, offset: torch.Tensor, n: int, blocksize: int, blocksize2: int, nested: bool, nf4: bool,
) -> torch.Tensor:  # fmt: skip
    """The first pass alone: [split, M, N] fp32 sums of x @ W^T over each K split (x, N and K not empty)."""
    m, k = x.shape
    plan = _plan(m, n, k, blocksize, x.device)
    target = torch.empty((plan.split, m, n), dtype=torch.float32, device=x.device)
    _launch_main(plan, x, data, scales, code, absmax2, code2, offset, None, target, n, blocksize, blocksize2, nested,
                 nf4, (target, target, 0.0), 0, partial=True)  # fmt: skip
    return target


def _nf4_partials_fake(x, data, scales, code, absmax2, code2, offset, n, blocksize, blocksize2, nested, nf4):
    m, k = x.shape
    return x.new_empty((_plan(m, n, k, blocksize, x.device).split, m, n), dtype=torch.float32)


_nf4_partials_op = traceable_op("unsloth::nf4_matmul_partials", _nf4_partials_launch, _nf4_partials_fake)


def _added_in_graph(partials: torch.Tensor, bias: torch.Tensor | None, xa: torch.Tensor | None,
                    lora_b: torch.Tensor | None, lora_scale: float, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """What the second pass adds (the splits in order, the bias, the LoRA term xa @ B^T, one rounding), as
    elementwise additions (and, above UNROLL_RANK, one small reduction over the rank): a compiled graph folds
    them into the kernels that read the output (RoPE, SiLU x up, a residual add) instead of launching a pass
    of their own."""
    y = partials[0]
    for split in range(1, partials.shape[0]):
        y = y + partials[split]
    if bias is not None:
        y = y + bias.float()
    if xa is not None:
        xa, lora_b = xa.float(), lora_b.float()
        if xa.shape[1] > UNROLL_RANK:
            delta = (xa[:, :, None] * lora_b.t()[None]).sum(1)
        else:
            delta = xa[:, :1] * lora_b[:, 0]
            for r in range(1, xa.shape[1]):
                delta = delta + xa[:, r : r + 1] * lora_b[:, r]
        y = y + lora_scale * delta
    return y.to(dtype)


def nf4_matmul(x: torch.Tensor, prepared: Prepared4bit, bias: torch.Tensor | None = None,
               lora: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:  # fmt: skip
    """x @ W^T (+ bias) for x of shape [..., K] with at most MAX_ROWS rows in all, and a prepared
    4-bit weight W of logical shape [N, K] (out x in, as nn.Linear). Output in x's dtype.

    `lora` = (xa, B, scale) adds scale * xa @ B^T before the output is rounded, xa = x @ A^T of shape
    [..., rank] and B the adapter's [N, rank] weight: a LoRA layer's update in the same pass, where
    decoding would otherwise launch a matmul and an addition for it."""
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
    xa, lora_b, lora_scale = lora if lora is not None else (None, None, 0.0)
    if lora is not None:
        xa = xa.reshape(rows.shape[0], -1).contiguous()
        if lora_b.shape != (n, xa.shape[1]):
            raise ValueError(f"the LoRA B weight must be [{n}, {xa.shape[1]}] (out x rank), got {tuple(lora_b.shape)}")
        lora_b = lora_b.contiguous()
    weight = (prepared.data, prepared.scales, prepared.code, prepared.absmax2, prepared.code2, offset)
    if SUM_IN_GRAPH and torch.compiler.is_compiling() and rows.shape[0] and n and k:
        partials = _nf4_partials_op(rows, *weight, n, prepared.blocksize, prepared.blocksize2, prepared.nested,
                                    prepared.nf4)  # fmt: skip
        y = _added_in_graph(partials, bias, xa, lora_b, float(lora_scale), rows.dtype)
    else:
        y = _nf4_matmul_op(rows, *weight, bias, n, prepared.blocksize, prepared.blocksize2, prepared.nested,
                           prepared.nf4, xa, lora_b, float(lora_scale))  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
