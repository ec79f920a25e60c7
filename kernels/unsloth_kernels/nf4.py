"""NF4 dequantization of bitsandbytes' 4-bit format, both levels in one Triton kernel.

bitsandbytes stores a 4-bit weight of n elements as ceil(n / 2) bytes, two code indices per byte
(high nibble first, i.e. element 2j is `byte >> 4` and element 2j + 1 is `byte & 0xF`), flattened
row-major from the original shape. Each block of `blocksize` elements has an fp32 scale (absmax):

    w[i] = code[index[i]] * absmax[i // blocksize]

With double quantization ("nested", `compress_statistics=True`), absmax itself is stored as uint8
indices into a 256-entry code, with one fp32 scale per `blocksize2` (256) absmax values, plus a
scalar offset (the mean that was subtracted before quantizing):

    absmax[b] = code2[absmax_q[b]] * absmax2[b // blocksize2] + offset

The kernel computes exactly that, in fp32 and in the same order as bitsandbytes, then casts to the
output dtype, so the result is bit-identical to `bitsandbytes.functional.dequantize_4bit`.
bitsandbytes itself is never imported here: `dequantize_bnb_4bit` reads its QuantState by attribute.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import prod

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._launch import direct_launch
from ._utils import INTERPRET, cdiv, check_device, round_to_bf16, traceable_op

# The 16 NF4 levels (quantiles of N(0, 1) scaled to [-1, 1]) as bitsandbytes defines them.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip

# Packed bytes per program and its warps: two 16-byte rows (64 weights) per thread on CUDA; the
# fastest of the configurations bench/tune_kernels.py sweeps (docs/benchmarks.md, "Tuned constants").
_BYTES_PER_PROGRAM = 4096
_WARPS = 4
_ROW_BYTES = 16  # packed bytes sharing one scale per kernel row (a 16-byte load per thread)


@dataclass(frozen=True)
class NestedAbsmax:
    """The second quantization level of absmax (bitsandbytes' `quant_state.state2` + `offset`)."""

    absmax: torch.Tensor  # fp32, one scale per `blocksize` quantized absmax values
    code: torch.Tensor  # fp32, 256 entries
    blocksize: int
    offset: torch.Tensor | float  # scalar added back after dequantizing


@direct_launch
@triton.jit
def _dequantize_4bit_kernel(
    packed_ptr,
    absmax_ptr,
    code_ptr,
    out_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    offset,
    n_elements,
    n_bytes,
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    OFFSET_IN_MEMORY: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BYTES: tl.constexpr,
    ROW: tl.constexpr,
):
    # BYTES packed bytes as rows of ROW bytes. A row lies inside one quantization block (ROW divides
    # BLOCKSIZE / 2), so its scale is read and dequantized once, not once per byte.
    pid = tl.program_id(0).to(tl.int64)
    row = pid * (BYTES // ROW) + tl.arange(0, BYTES // ROW)
    byte = row[:, None] * ROW + tl.arange(0, ROW)[None, :]
    packed = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)

    block = row * (2 * ROW) // BLOCKSIZE
    row_live = row * ROW < n_bytes
    if NESTED:
        scale_q = tl.load(absmax_ptr + block, mask=row_live, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + scale_q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=row_live, other=0.0)
        # Rounded before the offset is added, as bitsandbytes does: the select (a no-op but for NaN)
        # keeps the compiler from fusing the two into one multiply-add, also where the launch cannot
        # turn fp fusion off (inside torch.compile).
        scale = tl.where(scale == scale, scale, 0.0)
        # bitsandbytes keeps the offset as a device tensor: read it there rather than sync the host
        scale = scale + (tl.load(offset_ptr) if OFFSET_IN_MEMORY else offset)
    else:
        scale = tl.load(absmax_ptr + block, mask=row_live, other=0.0)

    high = tl.load(code_ptr + (packed >> 4)) * scale[:, None]
    low = tl.load(code_ptr + (packed & 0xF)) * scale[:, None]
    values = tl.interleave(high, low)  # element order: high, low, high, low, ...
    if OUT_BF16:
        values = round_to_bf16(values)  # on every backend: the interpreter truncates
    element = row[:, None] * (2 * ROW) + tl.arange(0, 2 * ROW)[None, :]
    tl.store(out_ptr + element, values.to(out_ptr.dtype.element_ty), mask=element < n_elements)


def _row_bytes(blocksize: int) -> int:
    """Bytes per kernel row: the largest power of two dividing a block's bytes, up to _ROW_BYTES."""
    half = blocksize // 2
    return min(half & -half, _ROW_BYTES)


@functools.lru_cache(maxsize=None)
def _nf4_code(device: torch.device) -> torch.Tensor:
    # Cached: building it each call is a host-to-device copy, which waits for the GPU.
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def _code_on(device: torch.device, code: torch.Tensor | None) -> torch.Tensor:
    if code is None:
        return _nf4_code(device)
    if code.numel() != 16:
        raise ValueError(f"a 4-bit code has 16 entries, got {code.numel()}")
    return code.to(device=device, dtype=torch.float32).contiguous()


@dataclass(frozen=True)
class Prepared4bit:
    """A 4-bit weight's dequantization arguments, checked and on its device.

    Preparing costs host time (checks, small copies) that a frozen weight needs only once:
    `dequantize_prepared` then launches the kernel alone.
    """

    data: torch.Tensor  # the packed bytes, flat uint8
    scales: torch.Tensor  # absmax: fp32, or uint8 indices when nested
    code: torch.Tensor
    absmax2: torch.Tensor
    code2: torch.Tensor
    offset: torch.Tensor | float  # a device tensor is read by the kernel (no host sync)
    shape: tuple[int, ...]
    blocksize: int
    blocksize2: int
    nested: bool
    nf4: bool  # the code is bitsandbytes' NF4 table (NF4_CODE), known without reading the device


def prepare_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    *,
    blocksize: int = 64,
    code: torch.Tensor | None = None,
    nested: NestedAbsmax | None = None,
    nf4: bool = False,
) -> Prepared4bit:
    """Check a 4-bit weight's parts against each other and put them in the kernel's form. `nf4` says
    that `code` is the NF4 table (always so without a code)."""
    shape = tuple(shape)
    n = prod(shape)
    if blocksize <= 0 or blocksize % 2:
        raise ValueError(f"blocksize must be a positive even number, got {blocksize}")
    data = packed.contiguous().view(torch.uint8).reshape(-1)
    if data.numel() != (n + 1) // 2:
        raise ValueError(f"packed weight has {data.numel()} bytes; shape {shape} needs {(n + 1) // 2}")
    n_blocks = cdiv(n, blocksize)
    if absmax.numel() < n_blocks:
        raise ValueError(f"absmax has {absmax.numel()} scales; {n} elements in blocks of {blocksize} need {n_blocks}")
    check_device(data, absmax)
    device = data.device
    if nested is not None:
        if absmax.dtype != torch.uint8:
            raise ValueError(f"nested absmax must be uint8 indices, got {absmax.dtype}")
        blocksize2 = int(nested.blocksize)
        if nested.absmax.numel() < cdiv(n_blocks, blocksize2):
            raise ValueError(f"nested absmax has {nested.absmax.numel()} scales; {n_blocks} absmax values in "
                             f"blocks of {blocksize2} need {cdiv(n_blocks, blocksize2)}")
        absmax2 = nested.absmax.to(device=device, dtype=torch.float32).contiguous()
        code2 = nested.code.to(device=device, dtype=torch.float32).contiguous()
        offset = nested.offset
        if isinstance(offset, torch.Tensor):
            offset = offset.to(device=device, dtype=torch.float32).reshape(1)
        else:
            offset = float(offset)
        scales = absmax.contiguous()
    else:
        scales = absmax.to(torch.float32).contiguous()
        absmax2 = code2 = scales  # unused by the kernel
        offset, blocksize2 = 0.0, 1
    return Prepared4bit(data, scales, _code_on(device, code), absmax2, code2, offset, shape, int(blocksize),
                        blocksize2, nested is not None, code is None or nf4)  # fmt: skip


# Keep `scale * code2 + offset` as two roundings (no FMA) so the result is bit-identical to bnb.
_NO_FMA = {} if INTERPRET else {"enable_fp_fusion": False}


def dequantize_prepared(p: Prepared4bit, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None):
    """The dense weight of a prepared 4-bit weight: one kernel launch."""
    n = prod(p.shape)
    if out is None:
        out = torch.empty(p.shape, dtype=dtype, device=p.data.device)
    elif out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {n} elements")
    if n == 0:
        return out
    in_memory = isinstance(p.offset, torch.Tensor)
    grid = (cdiv(p.data.numel(), _BYTES_PER_PROGRAM),)
    _dequantize_4bit_kernel[grid](
        p.data, p.scales, p.code, out, p.absmax2, p.code2,
        p.offset if in_memory else p.scales, 0.0 if in_memory else p.offset, n, p.data.numel(),
        BLOCKSIZE=p.blocksize, BLOCKSIZE2=p.blocksize2, NESTED=p.nested, OFFSET_IN_MEMORY=in_memory,
        OUT_BF16=out.dtype == torch.bfloat16, BYTES=_BYTES_PER_PROGRAM, ROW=_row_bytes(p.blocksize),
        num_warps=_WARPS, **_NO_FMA,
    )  # fmt: skip
    return out


def _dequantize_launch(
    data: torch.Tensor, scales: torch.Tensor, code: torch.Tensor, absmax2: torch.Tensor, code2: torch.Tensor,
    offset: torch.Tensor, rows: int, cols: int, blocksize: int, blocksize2: int, nested: bool, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    out = torch.empty((rows, cols), dtype=dtype, device=data.device)
    n = rows * cols
    if n == 0:
        return out
    kernel = getattr(_dequantize_4bit_kernel, "kernel", _dequantize_4bit_kernel)  # the JITFunction itself
    wrap_triton(kernel)[(cdiv(data.numel(), _BYTES_PER_PROGRAM),)](
        data, scales, code, out, absmax2, code2, offset, 0.0, n, data.numel(),
        BLOCKSIZE=blocksize, BLOCKSIZE2=blocksize2, NESTED=nested, OFFSET_IN_MEMORY=True,
        OUT_BF16=dtype == torch.bfloat16, BYTES=_BYTES_PER_PROGRAM, ROW=_row_bytes(blocksize),
        num_warps=_WARPS, **_NO_FMA,
    )  # fmt: skip
    return out


def _dequantize_fake(data, scales, code, absmax2, code2, offset, rows, cols, blocksize, blocksize2, nested, dtype):
    return data.new_empty((rows, cols), dtype=dtype)


_dequantize_op = traceable_op("unsloth::dequantize_4bit", _dequantize_launch, _dequantize_fake)


def offset_tensor(p: Prepared4bit) -> torch.Tensor:
    """The nested absmax's offset as a device tensor (the ops take tensors; a float goes there once a call)."""
    if isinstance(p.offset, torch.Tensor):
        return p.offset
    return torch.full((1,), float(p.offset), dtype=torch.float32, device=p.data.device)


def dequantize_traceable(p: Prepared4bit, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_prepared` as a torch.library op of a 2-D weight: torch.compile traces into it (the
    compiled decode step), where a plain launch would break the graph."""
    if len(p.shape) != 2:
        raise ValueError(f"expected a 2-D weight, got shape {p.shape}")
    return _dequantize_op(p.data, p.scales, p.code, p.absmax2, p.code2, offset_tensor(p), p.shape[0], p.shape[1],
                          p.blocksize, p.blocksize2, p.nested, dtype)  # fmt: skip


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.bfloat16,
    *,
    blocksize: int = 64,
    code: torch.Tensor | None = None,
    nested: NestedAbsmax | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize a bitsandbytes 4-bit weight to a dense tensor of `shape` and `dtype`.

    `packed` holds the bytes (any storage dtype; it is viewed as uint8), `absmax` the per-block
    scales (fp32, or uint8 when `nested` is given), `code` the 16 levels (NF4 by default; pass
    bitsandbytes' FP4 code to read FP4). One kernel launch, also for the nested case.
    """
    prepared = prepare_4bit(packed, absmax, shape, blocksize=blocksize, code=code, nested=nested)
    return dequantize_prepared(prepared, dtype, out)


def prepare_bnb_4bit(weight: torch.Tensor, quant_state) -> Prepared4bit:
    """`prepare_4bit` for a bitsandbytes Params4bit (`weight`, usually `param.data`) and its QuantState.

    The QuantState is duck-typed (absmax, shape, dtype, blocksize, quant_type, code, offset, state2
    with absmax/code/blocksize), so bitsandbytes need not be importable here.
    """
    if getattr(quant_state, "packing_format_for_cpu", False):
        raise ValueError("this 4-bit weight is in bitsandbytes' CPU inference layout (repacked by an eval forward "
                         "on the CPU), which unsloth's kernels do not read; load the model through unsloth "
                         "(FastLanguageModel.from_pretrained), which keeps the canonical layout")
    quant_type = getattr(quant_state, "quant_type", "nf4")
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"unsupported 4-bit quant_type {quant_type!r} (expected 'nf4' or 'fp4')")
    code = getattr(quant_state, "code", None)
    if quant_type == "fp4" and code is None:
        raise ValueError("an FP4 QuantState must carry its code")
    state2 = getattr(quant_state, "state2", None)
    nested = None
    if state2 is not None:
        nested = NestedAbsmax(state2.absmax, state2.code, state2.blocksize, quant_state.offset)
    return prepare_4bit(weight, quant_state.absmax, quant_state.shape, blocksize=quant_state.blocksize, code=code,
                        nested=nested, nf4=quant_type == "nf4")  # fmt: skip


def dequantize_bnb_4bit(
    weight: torch.Tensor, quant_state, *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantize a bitsandbytes Params4bit with its QuantState (see `prepare_bnb_4bit`). `dtype`
    defaults to the dtype recorded in the state (the model's compute dtype)."""
    return dequantize_prepared(prepare_bnb_4bit(weight, quant_state), dtype or quant_state.dtype, out)
