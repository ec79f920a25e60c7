"""Mixture-of-experts experts as grouped GEMMs, with LoRA on the expert projections in the same pass.

A routed MoE layer sends each token to k of E experts; expert e computes

    h = act(x W1_e^T + b1_e + s1 (x A1_e^T) B1_e^T)        (gate and up together: W1_e is (2I, H))
    y = h W2_e^T + b2_e + s2 (h A2_e^T) B2_e^T              (down: W2_e is (H, I))

and the token's output is sum_j w_j y_(e_j). Here the (token, expert) pairs are sorted by expert
once (a sort and two cumulative sums on the device, no host sync), and every product runs as one
grouped GEMM over the sorted rows: a Triton program finds its expert from the per-expert row
counts, so there is no per-expert Python loop and an empty expert costs nothing. The first GEMM
gathers its rows straight from the token order (the (tokens x k, H) copy is never made), the
LoRA up-projection `s (x A^T) B^T` is added in the GEMM's epilogue (a rank-r `tl.dot` per tile:
the (rows x out) output is written once) and the bias with it. The skinny `x A^T` is a grouped
GEMM of its own (it is kept for dB).

Backward, with dY the gradient of the sorted expert outputs (the routing weights are applied
outside, by torch, so autograd gives their gradient too):

    dX = dY W_e + (s dY B_e) A_e            (the same grouped GEMM, with W's strides swapped)
    dA_e = (s dY B_e)^T X_e                 dB_e = s dY_e^T (X A_e^T)     dW_e = dY_e^T X_e

the last three as per-expert sums over each expert's rows (`_segment_outer_kernel`). The gated
activation is not saved: backward recomputes it from the saved gate/up pre-activations and
writes h and d(gate/up) over the buffers it reads, as `lora.lora_mlp` does (single-use backward).

Expert weights come as each family stores them: (E, out, in) like nn.Linear, or (E, in, out)
("transposed", gpt-oss, Llama 4), gate and up concatenated ([gate; up]) or interleaved (gate 2j,
up 2j + 1, gpt-oss); LoRA factors as (E, r, in) and (E, out, r) tensors of any strides (peft's
`target_parameters` layout is a view of that shape); bitsandbytes 4-bit expert stacks are
dequantized for the one GEMM that needs them. Where Triton cannot run, `impl="torch"` computes
the same with `torch._grouped_mm` (or a loop over sorted segments where its constraints are not
met) and plain autograd: that is also the baseline the benchmark measures against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ._utils import INTERPRET, block_size_for, cdiv, check_device
from .activations import ACT_CODES, activation_and_derivative
from .nf4 import Prepared4bit, dequantize_prepared, prepare_bnb_4bit

# Gated activations: the shared ones, and gpt-oss's clamped SwiGLU,
# (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g) with g = clamp(gate, max=limit).
_GPT_OSS = 3
MOE_ACTIVATIONS = {**ACT_CODES, "gpt_oss": _GPT_OSS}
LAYOUTS = ("concatenated", "interleaved")


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert: y_e = x W_e^T + bias_e + scaling (x A_e^T) B_e^T.

    `weight`: (E, out, in), or (E, in, out) with `transposed=True`; or bitsandbytes' packed 4-bit
    bytes when `quant_state` is given (its `shape` is the dense stack's). `A`: (E, r, in) and
    `B`: (E, out, r), any strides, or both None (no LoRA). `bias`: (E, out) or None.
    """

    weight: torch.Tensor
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    scaling: float = 1.0
    bias: torch.Tensor | None = None
    transposed: bool = False
    quant_state: Any = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(experts, out, in)."""
        e, d1, d2 = tuple(self.quant_state.shape) if self.quant_state is not None else tuple(self.weight.shape)
        return (e, d2, d1) if self.transposed else (e, d1, d2)

    @property
    def rank(self) -> int:
        return 0 if self.A is None else self.A.shape[1]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight stack in `dtype`; a fresh dequantized copy when it is 4-bit."""
        if self.quant_state is not None:
            return dequantize_prepared(self._prepared_4bit, dtype)
        return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)

    @functools.cached_property
    def _prepared_4bit(self) -> Prepared4bit:
        return prepare_bnb_4bit(self.weight, self.quant_state)

    def strides(self, w: torch.Tensor) -> tuple[int, int, int]:
        """(expert, out, in) strides of the dense stack `w`."""
        se, s1, s2 = w.stride()
        return (se, s2, s1) if self.transposed else (se, s1, s2)

    def validate(self, name: str) -> None:
        shape = tuple(self.quant_state.shape) if self.quant_state is not None else tuple(self.weight.shape)
        if len(shape) != 3:
            raise ValueError(f"{name}: expert weights must be a 3-D stack (experts, out, in); got {shape}")
        experts, out, inp = self.shape
        if (self.A is None) != (self.B is None):
            raise ValueError(f"{name}: give both LoRA factors A and B, or neither")
        if self.A is not None:
            rank = self.A.shape[1] if self.A.dim() == 3 else -1
            if tuple(self.A.shape) != (experts, rank, inp) or tuple(self.B.shape) != (experts, out, rank):
                raise ValueError(f"{name}: LoRA A must be (E, r, in) = ({experts}, r, {inp}) and B (E, out, r) = "
                                 f"({experts}, {out}, r); got {tuple(self.A.shape)}, {tuple(self.B.shape)}")
        if self.bias is not None and tuple(self.bias.shape) != (experts, out):
            raise ValueError(f"{name}: bias must be (E, out) = ({experts}, {out}); got {tuple(self.bias.shape)}")
        if self.quant_state is not None and self.weight.requires_grad:
            raise ValueError(f"{name}: a 4-bit expert stack cannot be trained; train LoRA adapters on it")
        check_device(self.weight, self.A, self.B, self.bias)


class Routing(NamedTuple):
    """The (token, expert) pairs sorted by expert, built on the device without a host sync."""

    tokens: torch.Tensor  # (S,) int32: the token each sorted row reads
    inverse: torch.Tensor  # (T * k,) int64: the sorted row of pair (t, j), at t * k + j
    expert_end: torch.Tensor  # (E,) int32: cumulative row counts
    experts: torch.Tensor  # (S,) int64: each sorted row's expert


def route(top_k_index: torch.Tensor, n_experts: int) -> Routing:
    """Sort the (token, expert) pairs of `top_k_index` (T, k) by expert (stable: tokens stay in order)."""
    flat = top_k_index.reshape(-1)
    experts, order = torch.sort(flat, stable=True)
    k = top_k_index.shape[-1] if top_k_index.dim() > 1 else 1
    counts = torch.zeros(n_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return Routing((order // k).to(torch.int32), inverse, counts.cumsum(0, dtype=torch.int32), experts.long())


# --- the grouped GEMM: Y[rows of e] = X[rows] W_e^T (+ bias_e) (+ XA[rows] LB_e) ----------------


@triton.jit
def _tile_expert(EXPERT_END, pid, n_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of M-tile `pid` in the sorted rows; expert == n_experts past the last tile."""
    e = tl.arange(0, BLOCK_E)
    end = tl.load(EXPERT_END + e, mask=e < n_experts, other=0)
    start = tl.load(EXPERT_END + e - 1, mask=(e > 0) & (e < n_experts), other=0)
    tiles = tl.where(e < n_experts, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_end <= pid).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(e < expert, tiles, 0), 0)
    row_start = tl.sum(tl.where(e == expert, start, 0), 0)
    row_end = tl.sum(tl.where(e == expert, end, 0), 0)
    return expert, row_start + (pid - first_tile) * BLOCK_M, row_end


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:  # fp32 data (no TF32 rounding), or the interpreter (its 16-bit dot is wrong)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _grouped_gemm_kernel(
    X, W, Y, ROWS, EXPERT_END, BIAS, XA, LB,
    n_cols, k_dim, n_experts,
    stride_x, stride_we, stride_wk, stride_wn, stride_y,
    stride_be, stride_xa, stride_lbe, stride_lbr, stride_lbn,
    rank, out_scale, lora_scale,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (BLOCK_M rows of one expert) x (BLOCK_N columns) tile of the grouped product."""
    expert, row0, row_end = _tile_expert(EXPERT_END, tl.program_id(1), n_experts, BLOCK_M, BLOCK_E)
    if expert >= n_experts:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    if GATHER:
        src = tl.load(ROWS + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + src[:, None] * stride_x + ks[None, :]
    w_ptrs = W + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = (k0 + ks) < k_dim
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0).to(x.dtype)
        acc += _dot(x, w, DOT_FP32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    acc = acc * out_scale
    if LORA:  # + lora_scale * XA[rows] @ LB_e: the low-rank term in the epilogue, no second pass
        r = tl.arange(0, BLOCK_R)
        xa = tl.load(XA + rows[:, None].to(tl.int64) * stride_xa + r[None, :],
                     mask=row_mask[:, None] & (r[None, :] < rank), other=0.0)
        lb = tl.load(LB + expert.to(tl.int64) * stride_lbe + r[:, None] * stride_lbr + cols[None, :] * stride_lbn,
                     mask=(r[:, None] < rank) & col_mask[None, :], other=0.0).to(xa.dtype)  # fmt: skip
        acc += lora_scale * _dot(xa, lb, DOT_FP32)
    if HAS_BIAS:
        acc += tl.load(BIAS + expert * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# --- per-expert sums over rows: OUT_e = scale * L_e^T R_e (the weight and LoRA gradients) ----------


@triton.jit
def _segment_outer_kernel(
    L, R, OUT, ROWS, EXPERT_END,
    m_dim, n_dim, n_experts,
    stride_l, stride_r, stride_oe, stride_om, stride_on, scale,
    GATHER_R: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """OUT[e, m, n] = scale * sum over expert e's rows of L[row, m] R[row, n]; zeros for an empty expert."""
    expert = tl.program_id(2)
    start = tl.load(EXPERT_END + expert - 1, mask=expert > 0, other=0)
    end = tl.load(EXPERT_END + expert)
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = ms < m_dim, ns < n_dim
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for row0 in range(start, end, BLOCK_K):
        rows = row0 + ks
        mask = rows < end
        if GATHER_R:
            src = tl.load(ROWS + rows, mask=mask, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        lt = tl.load(L + rows[None, :].to(tl.int64) * stride_l + ms[:, None], mask=m_mask[:, None] & mask[None, :],
                     other=0.0)  # fmt: skip
        r = tl.load(R + src[:, None] * stride_r + ns[None, :], mask=mask[:, None] & n_mask[None, :], other=0.0)
        acc += _dot(lt, r.to(lt.dtype), DOT_FP32)
    out = OUT + expert.to(tl.int64) * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on
    tl.store(out, (acc * scale).to(OUT.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --- the gated activation over gate/up in either layout, forward and in-place backward -----------


@triton.jit
def _moe_act(gate, up, alpha, limit, ACT: tl.constexpr):
    """(h, dh/dgate, dh/dup) in fp32."""
    if ACT == 3:  # gpt-oss: clamp gradients are 1 inside [min, max] (bounds included), as torch's
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        sig = tl.sigmoid(alpha * g)
        glu = g * sig
        dglu = tl.where(gate <= limit, sig + alpha * g * sig * (1.0 - sig), 0.0)
        return (u + 1.0) * glu, (u + 1.0) * dglu, tl.where((up >= -limit) & (up <= limit), glu, 0.0)
    else:
        f, df = activation_and_derivative(gate, ACT)
        return f * up, df * up, f


@triton.jit
def _moe_act_kernel(
    GU, H, n_rows, n_cols, stride_gu, stride_h, up_offset, alpha, limit,
    ACT: tl.constexpr, COL_STEP: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Forward: H = act(gate, up). Backward: H holds dH; writes d(gate), d(up) over GU and h over H."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g_ptrs = GU + rows[:, None] * stride_gu + cols[None, :] * COL_STEP
    u_ptrs = g_ptrs + up_offset
    h_ptrs = H + rows[:, None] * stride_h + cols[None, :]
    gate = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32)
    h, dgate, dup = _moe_act(gate, up, alpha, limit, ACT)
    if BACKWARD:
        dh = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(g_ptrs, (dh * dgate).to(GU.dtype.element_ty), mask=mask)
        tl.store(u_ptrs, (dh * dup).to(GU.dtype.element_ty), mask=mask)
    tl.store(h_ptrs, h.to(H.dtype.element_ty), mask=mask)


# --- launchers ----------------------------------------------------------------------------------

# Launch configurations by kernel kind, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for the GEMMs and
# (BLOCK_M, BLOCK_N, warps) for the activation. Read at each launch, so `bench/bench_moe.py --part
# tune` can sweep them on a GPU; the interpreter gets small tiles (its cost grows with tile size).
#   gemm:   the expert projections, N = 2I, H or I
#   skinny: the LoRA factors' grouped GEMMs, N = rank (x A^T, s dY B)
#   outer:  the per-expert sums over rows (dA, dB, dW)
MOE_TUNING: dict[str, tuple[int, ...]] = (
    {"gemm": (16, 32, 32, 4, 1), "skinny": (16, 32, 32, 4, 1), "outer": (16, 32, 16, 4, 1), "act": (16, 32, 4)}
    if INTERPRET else
    {"gemm": (128, 128, 64, 8, 4), "skinny": (128, 128, 64, 4, 3), "outer": (64, 64, 64, 4, 3), "act": (16, 256, 4)}
)  # fmt: skip
SKINNY_MAX_N = 64  # a grouped GEMM with at most this many output columns uses the "skinny" config


class _Act(NamedTuple):
    code: int
    layout: str
    alpha: float
    limit: float


def _dot_fp32(dtype: torch.dtype) -> bool:
    return INTERPRET or dtype == torch.float32


def _grouped_gemm(x, routing: Routing, gather: bool, w, strides, n_cols, *, bias=None, xa=None, lb=None,
                  lb_strides=(0, 0, 0), out_scale=1.0, lora_scale=1.0, out=None):  # fmt: skip
    """(S, n_cols) = rows of x (gathered by routing.tokens when `gather`) times each row's expert's
    W_e, whose (expert, k, n) strides are `strides`; plus bias_e and lora_scale * xa @ LB_e."""
    rows = routing.tokens.numel()
    k_dim = x.shape[1]
    if out is None:
        out = torch.empty((rows, n_cols), dtype=x.dtype, device=x.device)
    if rows == 0 or n_cols == 0:
        return out
    n_experts = routing.expert_end.numel()
    block_m, block_n, block_k, warps, stages = MOE_TUNING["skinny" if n_cols <= SKINNY_MAX_N else "gemm"]
    block_n = min(block_n, max(16, block_size_for(n_cols)))
    block_k = min(block_k, max(16, block_size_for(k_dim)))
    lora = xa is not None
    grid = (cdiv(n_cols, block_n), cdiv(rows, block_m) + n_experts)
    _grouped_gemm_kernel[grid](
        x, w, out, routing.tokens, routing.expert_end, bias if bias is not None else out,
        xa if lora else out, lb if lora else out,
        n_cols, k_dim, n_experts,
        x.stride(0), *strides, out.stride(0),
        bias.stride(0) if bias is not None else 0, xa.stride(0) if lora else 0, *lb_strides,
        xa.shape[1] if lora else 0, float(out_scale), float(lora_scale),
        GATHER=gather, HAS_BIAS=bias is not None, LORA=lora,
        BLOCK_R=max(16, block_size_for(xa.shape[1])) if lora else 16, BLOCK_E=max(16, block_size_for(n_experts)),
        DOT_FP32=_dot_fp32(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _segment_outer(left, right, routing: Routing, gather_right: bool, out, out_strides, scale=1.0):
    """out[e] (with (expert, m, n) strides `out_strides`) = scale * left_e^T right_e over expert e's rows."""
    n_experts = routing.expert_end.numel()
    m_dim, n_dim = left.shape[1], right.shape[1]
    block_m, block_n, block_k, warps, stages = MOE_TUNING["outer"]
    block_m = min(block_m, max(16, block_size_for(m_dim)))
    block_n = min(block_n, max(16, block_size_for(n_dim)))
    grid = (cdiv(m_dim, block_m), cdiv(n_dim, block_n), n_experts)
    _segment_outer_kernel[grid](
        left, right, out, routing.tokens, routing.expert_end, m_dim, n_dim, n_experts,
        left.stride(0), right.stride(0), *out_strides, float(scale),
        GATHER_R=gather_right, DOT_FP32=_dot_fp32(left.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _act_launch(gu, h, act: _Act, backward: bool):
    rows, width = h.shape
    if rows == 0:
        return
    interleaved = act.layout == "interleaved"
    block_m, block_n, warps = MOE_TUNING["act"]
    _moe_act_kernel[(cdiv(rows, block_m), cdiv(width, block_n))](
        gu, h, rows, width, gu.stride(0), h.stride(0), 1 if interleaved else width, act.alpha, act.limit,
        ACT=act.code, COL_STEP=2 if interleaved else 1, BACKWARD=backward, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps,
    )  # fmt: skip


def _project(x, routing, gather, p: ExpertWeights, dtype):
    """Forward of one projection over the sorted rows: (y, x A^T or None)."""
    experts, out_features, _ = p.shape
    xa = None
    if p.A is not None:
        xa = _grouped_gemm(x, routing, gather, p.A, (p.A.stride(0), p.A.stride(2), p.A.stride(1)), p.rank)
    w = p.dense(dtype)
    se, s_out, s_in = p.strides(w)
    y = _grouped_gemm(x, routing, gather, w, (se, s_in, s_out), out_features, bias=p.bias, xa=xa,
                      lb=p.B, lb_strides=(p.B.stride(0), p.B.stride(2), p.B.stride(1)) if p.B is not None else (0, 0, 0),
                      lora_scale=p.scaling)  # fmt: skip
    return y, xa


def _lora_dy_b(dy, routing, p: ExpertWeights):
    """s dY B_e over the sorted rows: the common factor of dA and of dX's LoRA part (None without LoRA)."""
    if p.A is None:
        return None
    return _grouped_gemm(dy, routing, False, p.B, (p.B.stride(0), p.B.stride(1), p.B.stride(2)), p.rank,
                         out_scale=p.scaling)  # fmt: skip


def _grad_projection(dy, x, gather, xa, routing, p: ExpertWeights, needs, need_x: bool, dy_b=None):
    """(dW, dA, dB, dbias) for one projection (None where not needed) and dX over the sorted rows.

    `dy_b`: s dY B_e when the caller has it already."""
    dtype = dy.dtype
    need_w, need_a, need_b, need_bias = needs
    if dy_b is None:
        dy_b = _lora_dy_b(dy, routing, p)
    grad_w = grad_a = grad_b = grad_bias = None
    if need_a:
        grad_a = torch.empty(p.A.shape, dtype=dtype, device=dy.device)
        _segment_outer(dy_b, x, routing, gather, grad_a, grad_a.stride())
        grad_a = grad_a.to(p.A.dtype)
    if need_b:
        grad_b = torch.empty(p.B.shape, dtype=dtype, device=dy.device)
        _segment_outer(dy, xa, routing, False, grad_b, grad_b.stride(), p.scaling)
        grad_b = grad_b.to(p.B.dtype)
    if need_w:
        grad_w = torch.empty_like(p.weight, dtype=dtype)
        _segment_outer(dy, x, routing, gather, grad_w, p.strides(grad_w))
        grad_w = grad_w.to(p.weight.dtype)
    if need_bias:
        grad_bias = torch.zeros(p.bias.shape, dtype=torch.float32, device=dy.device)
        grad_bias.index_add_(0, routing.experts, dy.float())
        grad_bias = grad_bias.to(p.bias.dtype)
    grad_x = None
    if need_x:
        w = p.dense(dtype)
        se, s_out, s_in = p.strides(w)
        grad_x = _grouped_gemm(dy, routing, False, w, (se, s_out, s_in), p.shape[2], xa=dy_b, lb=p.A,
                               lb_strides=(p.A.stride(0), p.A.stride(1), p.A.stride(2)) if p.A is not None else (0, 0, 0))  # fmt: skip
        del w
    return (grad_w, grad_a, grad_b, grad_bias), grad_x


def _params(p: ExpertWeights):
    return (p.weight, p.A, p.B, p.bias)


def _needs(p: ExpertWeights, flags) -> tuple[bool, ...]:
    return (flags[0] and p.quant_state is None, flags[1] and p.A is not None, flags[2] and p.B is not None,
            flags[3] and p.bias is not None)  # fmt: skip


class _MoeExperts(torch.autograd.Function):
    """The experts of a routed MoE layer over the sorted rows: returns each row's expert output (S, H)."""

    @staticmethod
    def forward(ctx, x, routing, gate_up, down, act, *params):
        dtype = x.dtype
        gu, xa1 = _project(x, routing, True, gate_up, dtype)
        h = torch.empty((gu.shape[0], gu.shape[1] // 2), dtype=dtype, device=x.device)
        _act_launch(gu, h, act, backward=False)
        y, xa2 = _project(h, routing, False, down, dtype)
        del h  # recomputed in backward from gu
        ctx.routing, ctx.gate_up, ctx.down, ctx.act, ctx.used = routing, gate_up, down, act, False
        ctx.save_for_backward(x, gu, xa1, xa2)
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.used:
            raise RuntimeError("moe_experts: backward reuses its saved buffers and can run only once (no retain_graph)")
        ctx.used = True
        x, gu, xa1, xa2 = ctx.saved_tensors
        dy = dy.contiguous()
        routing, gate_up, down = ctx.routing, ctx.gate_up, ctx.down
        needs = ctx.needs_input_grad
        needs_up, needs_down = _needs(gate_up, needs[5:9]), _needs(down, needs[9:13])
        # dh first (h is not saved), then h and d(gate/up) recomputed in place, then down's own gradients
        dy_b = _lora_dy_b(dy, routing, down)
        _, dh = _grad_projection(dy, None, False, None, routing, down, (False,) * 4, need_x=True, dy_b=dy_b)
        _act_launch(gu, dh, ctx.act, backward=True)  # now gu holds d(gate/up) and dh holds h
        h, dgu = dh, gu
        grads_down, _ = _grad_projection(dy, h, False, xa2, routing, down, needs_down, need_x=False, dy_b=dy_b)
        del h, dh
        grads_up, dx_sorted = _grad_projection(dgu, x, True, xa1, routing, gate_up, needs_up, need_x=needs[0])
        grad_x = None
        if dx_sorted is not None:  # each token's gradient: the sum over its k rows
            k = routing.inverse.numel() // x.shape[0] if x.shape[0] else 1
            grad_x = dx_sorted.float()[routing.inverse].view(x.shape[0], k, -1).sum(1).to(x.dtype)
        return (grad_x, None, None, None, None, *grads_up, *grads_down)


# --- the torch path (no Triton): torch._grouped_mm where it applies, else a loop over segments -----


def _grouped_mm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch._grouped_mm's constraints: 16-bit on CUDA (fp32 too on the CPU), 16-byte aligned strides."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype:
        return False
    if a.is_cuda and (a.dtype != torch.bfloat16 or torch.cuda.get_device_capability(a.device) < (8, 0)):
        return False
    size = a.element_size()

    def fits(t):  # row- or column-major matrices, the other stride (and the address) 16-byte aligned
        rows, cols = t.stride()[-2:]
        lead = rows if cols == 1 else cols if rows == 1 else None
        return t.data_ptr() % 16 == 0 and lead is not None and lead * size % 16 == 0

    return fits(a) and fits(b)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, expert_end: torch.Tensor) -> torch.Tensor:
    """Rows of `a` (S, K) sorted by expert times each expert's `b` (E, K, N), differentiable:
    `torch._grouped_mm` where it applies, else one matmul per expert segment (a host sync)."""
    if _grouped_mm_ok(a, b):
        return torch._grouped_mm(a, b, offs=expert_end)
    bounds = [0, *expert_end.tolist()]
    parts = [a[s:e] @ b[i] for i, (s, e) in enumerate(zip(bounds, bounds[1:]))]
    return torch.cat(parts) if parts else a.new_empty((0, b.shape[2]))


def _torch_project(x, routing, p: ExpertWeights, dtype):
    w = p.dense(dtype)
    w_t = w if p.transposed else w.transpose(1, 2)  # (E, in, out)
    y = grouped_mm(x, w_t, routing.expert_end)
    if p.bias is not None:
        y = y + p.bias.to(dtype)[routing.experts]
    if p.A is not None:  # the LoRA term as two more grouped GEMMs, as peft on grouped_mm would do
        # (peft's B is (E, out, r) with the expert stride 1: a small copy makes it a plain stack)
        xa = grouped_mm(x, p.A.to(dtype).transpose(1, 2), routing.expert_end)
        y = y + p.scaling * grouped_mm(xa, p.B.to(dtype).transpose(1, 2).contiguous(), routing.expert_end)
    return y


def _torch_act(gu, act: _Act):
    if act.layout == "interleaved":
        gate, up = gu[:, ::2], gu[:, 1::2]
    else:
        gate, up = gu.chunk(2, dim=-1)
    if act.code == _GPT_OSS:
        gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
        return (up + 1) * gate * torch.sigmoid(gate * act.alpha)
    fn = {ACT_CODES["swiglu"]: torch.nn.functional.silu, ACT_CODES["geglu"]: torch.nn.functional.gelu,
          ACT_CODES["geglu_tanh"]: functools.partial(torch.nn.functional.gelu, approximate="tanh")}[act.code]  # fmt: skip
    return fn(gate) * up


def _torch_experts(x, routing, gate_up, down, act):
    h = _torch_act(_torch_project(x[routing.tokens.long()], routing, gate_up, x.dtype), act)
    return _torch_project(h, routing, down, x.dtype)


# --- public API ---------------------------------------------------------------------------------


def moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    *,
    activation: str = "swiglu",
    layout: str = "concatenated",
    alpha: float = 1.702,
    limit: float = 7.0,
    impl: str = "triton",
) -> torch.Tensor:
    """sum_j top_k_weights[t, j] * expert_(top_k_index[t, j])(x[t]) for every token t of x (T, H).

    Each expert is down(act(gate_up(x))) with LoRA on either projection (see `ExpertWeights`);
    `activation` is "swiglu", "geglu", "geglu_tanh" or "gpt_oss" (clamped SwiGLU with `alpha`
    and `limit`), over gate/up `layout` "concatenated" ([gate; up]) or "interleaved" (gpt-oss).
    `impl="torch"` runs the same math without Triton (`torch._grouped_mm`, autograd). Expert ids
    must lie in [0, E) (they are not checked on the device: that would need a host sync).
    """
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"moe_experts: activation must be one of {tuple(MOE_ACTIVATIONS)}, got {activation!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"moe_experts: layout must be one of {LAYOUTS}, got {layout!r}")
    if impl not in ("triton", "torch"):
        raise ValueError(f"moe_experts: impl must be 'triton' or 'torch', got {impl!r}")
    gate_up.validate("moe_experts (gate_up)")
    down.validate("moe_experts (down)")
    experts, width, hidden = gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"moe_experts: x must be (tokens, {hidden}); got {tuple(x.shape)}")
    if width % 2 or down.shape != (experts, hidden, width // 2):
        raise ValueError(f"moe_experts: gate_up {gate_up.shape} (E, 2I, H) needs down (E, H, I) = "
                         f"({experts}, {hidden}, {width // 2}); got {down.shape}")  # fmt: skip
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must both be (tokens, k) with {x.shape[0]} tokens")  # fmt: skip
    act = _Act(MOE_ACTIVATIONS[activation], layout, float(alpha), float(limit))
    routing = route(top_k_index, experts)
    x = x.contiguous()
    if impl == "torch":
        y = _torch_experts(x, routing, gate_up, down, act)
    else:
        check_device(x)
        y = _MoeExperts.apply(x, routing, gate_up, down, act, *_params(gate_up), *_params(down))
    return combine(y, routing, top_k_weights)


def combine(y: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[t, j] y[row of (t, j)], summed in fp32 (as transformers' grouped path does)."""
    tokens, k = top_k_weights.shape
    picked = y[routing.inverse].view(tokens, k, -1).float()
    return (picked * top_k_weights.float().unsqueeze(-1)).sum(1).to(y.dtype)
