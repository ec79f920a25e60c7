"""LoRA projections with hand-written backward: single linears, the gated MLP, and fused Q/K/V.

A LoRA linear computes y = x W^T + bias + s (x A^T) B^T with the base W frozen (dense, or 4-bit in
bitsandbytes' format and dequantized on the fly) and only A (r, in), B (out, r) trained, s = alpha / r.
Autograd through the plain composition keeps more than it needs and makes several extra passes;
the functions here save only x and the rank-r product x A^T (plus, for the MLP, the two gate/up
pre-activations) and compute

    dX = dY W + s (dY B) A        dA = s (dY B)^T X        dB = s dY^T (X A^T)

with every matmul in torch (cuBLAS / hipBLAS), the LoRA terms folded into the base outputs with
`addmm_(alpha=s)` so no separate buffers are made. Projections of one input (Q/K/V, gate/up) stack
their A matrices, so x is read once for all their x A^T and once for all their dA, and the LoRA part
of dX is a single matmul. A dequantized NF4 weight lives only for the one matmul that needs it, in
forward and again in backward.

In the MLP, down(act(gate(x)) * up(x)), the activation is not saved: one Triton kernel recomputes it
in backward and writes h, d(gate), d(up) over the buffers it reads (dh, gate, up). That makes the
backward single-use: calling it twice (retain_graph) raises instead of returning wrong gradients.
The MLP's gate/up LoRA terms (and in backward down's part of dh) are added inside those activation
kernels rather than by addmm_, so its (tokens x intermediate) tensors are not passed over again.

These fast paths assume lora_dropout == 0 (dropout would need the dropped x kept for dA); the
trainer falls back to peft's own modules otherwise. The base weight and its quantization are never
trained here; a trainable bias gets its gradient.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ._launch import direct_launch
from ._utils import INTERPRET, block_size_for, cdiv, check_device
from .activations import ACT_CODES, activation_and_derivative
from .nf4 import Prepared4bit, dequantize_prepared, prepare_bnb_4bit

ACTIVATIONS = tuple(ACT_CODES)  # "swiglu", "geglu", "geglu_tanh"


@dataclass(frozen=True)
class LoraWeights:
    """One LoRA-adapted linear: y = x W^T + bias + scaling * (x A^T) B^T.

    `weight` is the frozen base (out, in), or bitsandbytes' packed 4-bit bytes when `quant_state`
    (a bnb QuantState or anything with the same attributes) is given.
    """

    weight: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    quant_state: Any = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.B.shape[0]

    @property
    def in_features(self) -> int:
        return self.A.shape[1]

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense base weight in `dtype`; a fresh dequantized copy when the base is 4-bit."""
        if self.quant_state is not None:
            return dequantize_prepared(self._prepared_4bit, dtype)
        return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)  # a no-op .to still costs a call

    @functools.cached_property
    def _prepared_4bit(self) -> Prepared4bit:
        # Prepared once per LoraWeights: the trainer's patch keeps one per layer while it is unchanged.
        return prepare_bnb_4bit(self.weight, self.quant_state)

    def validate(self, name: str = "lora") -> None:
        if "_valid" in self.__dict__:  # checked already: the fields are frozen, and so are the base's shapes
            return
        self._check(name)
        self.__dict__["_valid"] = True

    def _check(self, name: str) -> None:
        rank = self.A.shape[0]
        if self.A.dim() != 2 or self.B.dim() != 2 or self.B.shape[1] != rank:
            raise ValueError(
                f"{name}: A must be (r, in) and B (out, r); got {tuple(self.A.shape)}, {tuple(self.B.shape)}"
            )
        shape = tuple(self.quant_state.shape) if self.quant_state is not None else tuple(self.weight.shape)
        if shape != (self.out_features, self.in_features):
            raise ValueError(f"{name}: base weight {shape} does not match LoRA (out, in) = "
                             f"{(self.out_features, self.in_features)}")  # fmt: skip
        if self.quant_state is None and self.weight.requires_grad:
            raise ValueError(f"{name}: the base weight must be frozen (requires_grad=False); LoRA trains A and B only")
        check_device(self.weight, self.A, self.B, self.bias)


# --- the activation of the gated MLP, forward and in-place backward -------------------------------
#
# Both kernels can also add the gate/up projections' LoRA terms s (x A^T) B^T on the fly (and in
# backward the down projection's s (dY B) A to dh): rank-r products done per tile with tl.dot, so
# those (tokens x intermediate) outputs are never read and written again by a separate addmm_.


class _GateUpLora(NamedTuple):
    """The gate and up LoRA terms folded into the activation kernels: x [A_gate; A_up]^T, B's, scalings."""

    xa: torch.Tensor
    b_gate: torch.Tensor
    b_up: torch.Tensor
    scale_gate: float
    scale_up: float


class _DownLora(NamedTuple):
    """Down's LoRA part of dh: (s dY B) A, as s dY B (tokens x r) and A (r x intermediate)."""

    dy_b: torch.Tensor
    a: torch.Tensor


# (BLOCK_M, BLOCK_N, warps) of the activation kernels, read at each launch (bench/gated_tiles.py sets
# it to time the others). One tile serves every rank up to the folding limit: gated_tiles.py on an
# H100 (2026-12-06) timed the LoRA MLP's forward + backward at 1.23 ms with 16 x 128 / 8 warps against
# 1.68 with the earlier 32 x 128 / 4 warps at the TTS shape (rank 64), and 19.45 against 19.80 ms at
# Llama-8B's (rank 16). Compiled for sm_90 (bench/kernel_resources.py --gated), the earlier tile
# spilled (984 bytes a thread in backward at rank 64, 424 at rank 16); this one spills nothing.
GATED_TILE = (16, 128, 8)
_MAX_FOLDED_RANK = 64  # larger ranks keep the separate addmm_ (a tile of B would not fit in registers)


@triton.jit
def _low_rank(XA, W, rows, cols, n_rows, n_cols, stride_xa, stride_w_r, stride_w_col,
              RANK: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr, dtype: tl.constexpr):
    """XA[rows, :RANK] @ W[:RANK, cols] as an fp32 tile (W given by its strides along r and cols).

    Both factors are rounded to the activations' dtype (as torch's addmm in that dtype would see
    them); the products are exact and summed in fp32.
    """
    r = tl.arange(0, BLOCK_R)
    a = tl.load(XA + rows[:, None] * stride_xa + r[None, :], mask=(rows[:, None] < n_rows) & (r[None, :] < RANK),
                other=0.0).to(dtype)  # fmt: skip
    w = tl.load(W + r[:, None] * stride_w_r + cols[None, :] * stride_w_col,
                mask=(r[:, None] < RANK) & (cols[None, :] < n_cols), other=0.0).to(dtype)  # fmt: skip
    if DOT_FP32:  # fp32 activations (no TF32 rounding), or the interpreter (its bf16 dot is wrong)
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(a, w)


@direct_launch
@triton.jit
def _gated_kernel(
    E, G, DH, XA, BG, BU, DYB, AD,
    n_rows, n_cols, stride, stride_xa,
    sbg_r, sbg_col, sbu_r, sbu_col, stride_dyb, sad_r, sad_col,
    scale_g, scale_u,
    ACT: tl.constexpr, BACKWARD: tl.constexpr, LORA: tl.constexpr, LORA_DH: tl.constexpr,
    RANK_G: tl.constexpr, RANK_U: tl.constexpr, RANK_D: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Forward: h = act(e) * g into DH. Backward: reads e, g, dh; writes h over dh, d(e) over e, d(g)
    over g. With LORA, e and g get their LoRA terms added first; with LORA_DH, dh gets down's."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None] * stride + cols[None, :]
    dtype = E.dtype.element_ty
    e = tl.load(E + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if LORA:
        e += scale_g * _low_rank(XA, BG, rows, cols, n_rows, n_cols, stride_xa, sbg_r, sbg_col,
                                 RANK_G, BLOCK_R, DOT_FP32, dtype)  # fmt: skip
        g += scale_u * _low_rank(XA + RANK_G, BU, rows, cols, n_rows, n_cols, stride_xa, sbu_r, sbu_col,
                                 RANK_U, BLOCK_R, DOT_FP32, dtype)  # fmt: skip
    f, df = activation_and_derivative(e, ACT)
    if BACKWARD:
        dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        if LORA_DH:
            dh += _low_rank(DYB, AD, rows, cols, n_rows, n_cols, stride_dyb, sad_r, sad_col,
                            RANK_D, BLOCK_R, DOT_FP32, dtype)  # fmt: skip
        tl.store(E + offs, (dh * g * df).to(dtype), mask=mask)
        tl.store(G + offs, (dh * f).to(dtype), mask=mask)
    tl.store(DH + offs, (f * g).to(DH.dtype.element_ty), mask=mask)


def _gated_launch(e, g, dh, activation, backward, gate_up: _GateUpLora | None, down: _DownLora | None):
    n_rows, n_cols = e.shape
    if e.numel() == 0:
        return
    if not (e.stride() == g.stride() == dh.stride() and e.stride(1) == 1):
        raise ValueError("lora_mlp: the gate, up and dh buffers must share one row-major layout")
    ranks = [gate_up.b_gate.shape[1], gate_up.b_up.shape[1]] if gate_up else [1, 1]
    ranks.append(down.a.shape[0] if down else 1)
    xa, bg, bu = gate_up[:3] if gate_up else (e, e, e)
    dyb, ad = down if down else (e, e)
    block_m, block_n, warps = GATED_TILE
    _gated_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
        e, g, dh, xa, bg, bu, dyb, ad,
        n_rows, n_cols, e.stride(0), xa.stride(0),
        bg.stride(1), bg.stride(0), bu.stride(1), bu.stride(0), dyb.stride(0), ad.stride(0), ad.stride(1),
        gate_up.scale_gate if gate_up else 0.0, gate_up.scale_up if gate_up else 0.0,
        ACT=ACT_CODES[activation], BACKWARD=backward, LORA=gate_up is not None, LORA_DH=down is not None,
        RANK_G=ranks[0], RANK_U=ranks[1], RANK_D=ranks[2], BLOCK_R=max(16, block_size_for(max(ranks))),
        DOT_FP32=INTERPRET or e.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip


def _gated_forward(e: torch.Tensor, g: torch.Tensor, activation: str, gate_up: _GateUpLora | None = None):
    h = torch.empty_like(e)
    _gated_launch(e, g, h, activation, False, gate_up, None)
    return h


def _gated_backward_(e, g, dh, activation: str, gate_up: _GateUpLora | None = None, down: _DownLora | None = None):
    _gated_launch(e, g, dh, activation, True, gate_up, down)


def _folds(projections) -> bool:
    """Whether the MLP's LoRA terms go into the activation kernels (ranks that fit a register tile)."""
    return all(p.A.shape[0] <= _MAX_FOLDED_RANK for p in projections)


def _gate_up_lora(xa, params, gate, up) -> _GateUpLora:
    return _GateUpLora(xa, params[1], params[4], gate.scaling, up.scaling)


# --- projections of one input: forward and backward ----------------------------------------------
#
# Projections that share an input (Q/K/V; gate/up) stack their A matrices, so x is read once for
# all the x A^T products in forward and once for all the dA in backward, and the LoRA part of dX
# is one matmul: dX += [s_i dY_i B_i] @ [A_i] over the stacked rank.


# --- parameters in the compute dtype ---------------------------------------------------------------
#
# LoRA parameters are often kept in fp32 while the model computes in bf16 (peft's default), and a step
# uses each of them several times (forward, the checkpoint's recompute, backward; every micro-batch
# of an accumulated step). Each use was a cast: a launch, which on a host-paced step (batch 1, or a
# vision tower's small matmuls) costs as much as the GPU work. The cast is kept (in a side table
# keyed by the parameter, so nothing extra is pickled with it) while the parameter is unchanged: same
# version counter (an in-place write bumps it), same storage, and no optimizer step since
# (`new_weights`: the models layer calls it after each one, for optimizers that write through their
# own kernels).

_weights_generation = 0
_casts: dict[int, tuple] = {}  # id(first tensor) -> (weak reference to it, {slot: (state, cast)})


def new_weights() -> None:
    """Forget the casts kept for the LoRA parameters (an optimizer has just changed them)."""
    global _weights_generation
    _weights_generation += 1


def _kept(tensors, dtype: torch.dtype, build):
    """build(), kept for tensors[0] while none of `tensors` changed (see above)."""
    state = (_weights_generation, *[(t._version, t.data_ptr()) for t in tensors])
    slot = (dtype, *map(id, tensors[1:]))
    first = tensors[0]
    entry = _casts.get(id(first))
    if entry is None or entry[0]() is not first:
        entry = (weakref.ref(first, lambda _, key=id(first): _casts.pop(key, None)), {})
        _casts[id(first)] = entry
    kept = entry[1]
    hit = kept.get(slot)
    if hit is not None and hit[0] == state:
        return hit[1]
    value = build()
    kept[slot] = (state, value)
    return value


def _in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A parameter in `dtype`: itself, or its kept cast."""
    return t if t.dtype == dtype else _kept((t,), dtype, lambda: t.detach().to(dtype))


def _stacked_a(params, count: int, dtype: torch.dtype) -> torch.Tensor:
    if count == 1:
        return _in(params[0], dtype)
    a = [params[3 * i] for i in range(count)]
    return _kept(a, dtype, lambda: torch.cat([t.detach().to(dtype) for t in a]))


@functools.lru_cache(maxsize=None)
def _zero(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((), device=device, dtype=dtype)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * (a @ b) in one matmul launch (the scaling in cuBLAS's alpha, not a second kernel):
    on a QLoRA step at batch 2 the host's launches, not the GPU, set the pace."""
    return torch.addmm(_zero(a.device, a.dtype), a, b, beta=0, alpha=scale)


def _project(x: torch.Tensor, projections, params, *, fold: bool = False):
    """Each y_i = x W_i^T + bias_i + s_i (x A_i^T) B_i^T, and the stacked x [A_i]^T (kept for dB).

    `fold`: leave the LoRA terms out of y_i (the caller's kernel adds them from the returned xa).
    """
    dtype = x.dtype
    xa = x @ _stacked_a(params, len(projections), dtype).t()
    outputs, col = [], 0
    for i, p in enumerate(projections):
        _, B, bias = params[3 * i : 3 * i + 3]
        weight_t = p.base_weight(dtype).t()  # a dequantized copy lives only for this matmul
        y = x @ weight_t if bias is None else torch.addmm(_in(bias, dtype), x, weight_t)
        rank = B.shape[1]
        if not fold:
            y.addmm_(xa[:, col : col + rank], _in(B, dtype).t(), alpha=p.scaling)
        outputs.append(y)
        col += rank
    return outputs, xa


def _grad_projections(grad_outputs, x, xa, projections, params, needs, *, need_x=True, fold_x=False):
    """(dA, dB, dbias) per projection (parameters' dtypes, None where not needed), dX, and s dY B.

    `x` may be None when no dA is wanted from it here: the MLP's down projection computes its dA
    from the returned s dY B once h has been recomputed. `fold_x`: leave the LoRA part (s dY B) A
    out of dX (the caller's kernel adds it).
    """
    dtype = grad_outputs[0].dtype
    count = len(projections)
    # s_i dY_i B_i side by side: the common factor of dA_i (with x) and of dX's LoRA part (with A_i).
    dy_b = [_scaled_mm(dy, _in(params[3 * i + 1], dtype), p.scaling)
            for i, (p, dy) in enumerate(zip(projections, grad_outputs))]  # fmt: skip
    dy_b = dy_b[0] if count == 1 else torch.cat(dy_b, dim=1)
    want_a = x is not None and any(needs[3 * i] for i in range(count))
    grad_a_stacked = dy_b.t() @ x if want_a else None
    grads, col = [], 0
    for i, (p, dy) in enumerate(zip(projections, grad_outputs)):
        A, B, bias = params[3 * i : 3 * i + 3]
        rank = A.shape[0]
        need_a, need_b, need_bias = needs[3 * i : 3 * i + 3]
        grad_a = grad_a_stacked[col : col + rank].to(A.dtype) if need_a and want_a else None
        grad_b = _scaled_mm(dy.t(), xa[:, col : col + rank], p.scaling).to(B.dtype) if need_b else None
        grad_bias = dy.sum(0, dtype=torch.float32).to(bias.dtype) if need_bias and bias is not None else None
        grads += [grad_a, grad_b, grad_bias]
        col += rank
    grad_x = None
    if need_x:
        for p, dy in zip(projections, grad_outputs):
            weight = p.base_weight(dtype)
            grad_x = dy @ weight if grad_x is None else grad_x.addmm_(dy, weight)
            del weight  # a dequantized copy need not outlive its matmul
        if not fold_x:
            grad_x.addmm_(dy_b, _stacked_a(params, count, dtype))
    return grads, grad_x, dy_b


def _flat(x: torch.Tensor) -> torch.Tensor:
    """Rows of x, in the autocast dtype when autocast is on (as nn.Linear would compute)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    return x.reshape(-1, x.shape[-1]).contiguous()


def _autocast_off(device_type: str):
    """torch.autocast(enabled=False), or no context where autocast is off already (backward, most
    inference): entering one costs host time, which a host-paced step pays at every projection."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _no_autocast(method):
    """Run a forward/backward with autocast off: the dtypes are chosen explicitly inside."""

    @functools.wraps(method)
    def wrapper(ctx, first, *args):
        with _autocast_off(first.device.type):
            return method(ctx, first, *args)

    return wrapper


def _params(projections) -> list:
    return [t for p in projections for t in (p.A, p.B, p.bias)]


class _LoraProjections(torch.autograd.Function):
    """Several LoRA projections of one input (1 for a linear, 3 for Q/K/V): one dX in backward."""

    @staticmethod
    @_no_autocast
    def forward(ctx, x, projections, replay, *params):
        # replay: (outputs, xa) this same forward gave on this same x earlier, returned as they are
        outputs, xa = replay if replay is not None else _project(x, projections, params)
        ctx.projections = projections
        ctx.save_for_backward(x, xa, *params)
        return tuple(outputs)

    @staticmethod
    @_no_autocast
    def backward(ctx, *grad_outputs):
        x, xa, *params = ctx.saved_tensors
        grad_outputs = [dy.contiguous() for dy in grad_outputs]
        grads, grad_x, _ = _grad_projections(
            grad_outputs, x, xa, ctx.projections, params, ctx.needs_input_grad[3:], need_x=ctx.needs_input_grad[0]
        )
        return (grad_x, None, None, *grads)


class _LoraMLP(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) with the activation recomputed in backward.

    With `output_needed=False` (a checkpointed layer's recompute pass, where the MLP's output only
    joins the residual stream and is never read) forward computes nothing and saves x; backward
    then does the work in token chunks: gate and up are recomputed, and the down projection's
    forward, a third of the MLP's matmuls, is never run again. The chunks bound the (rows x
    intermediate) buffers to `MLP_CHUNK_BYTES` each.
    """

    @staticmethod
    @_no_autocast
    def forward(ctx, x, projections, activation, output_needed, *params):
        ctx.projections, ctx.activation, ctx.used = projections, activation, False
        ctx.output_needed = output_needed
        ctx.fold = _folds(projections)
        if not output_needed:
            ctx.save_for_backward(x, *params)
            # A stand-in of the right shape that costs no memory: nothing reads its values.
            return x.new_zeros(()).expand(x.shape[0], projections[2].out_features)
        out, saved = _mlp_forward(x, projections, activation, params, ctx.fold)
        ctx.save_for_backward(x, *saved, *params)
        return out

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError("lora_mlp: backward reuses its saved buffers and can run only once (no retain_graph)")
        ctx.used = True
        dy = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        needs = ctx.needs_input_grad[4:]
        if ctx.output_needed:
            x, e, g, xa_gate_up, ha_down, *params = ctx.saved_tensors
            grads, grad_x = _mlp_backward(x, e, g, xa_gate_up, ha_down, dy, ctx, params, needs)
            return (grad_x, None, None, None, *grads)
        x, *params = ctx.saved_tensors
        rows = _mlp_chunk_rows(x.shape[0], ctx.projections[0].out_features, x.element_size())
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        total = None
        for start in range(0, x.shape[0], rows):
            chunk = slice(start, start + rows)
            (e, g), xa_gate_up = _project(x[chunk], ctx.projections[:2], params[:6], fold=ctx.fold)
            grads, grad_x_chunk = _mlp_backward(x[chunk], e, g, xa_gate_up, None, dy[chunk], ctx, params, needs)
            del e, g, xa_gate_up
            if grad_x is not None:
                grad_x[chunk] = grad_x_chunk
            total = grads if total is None else [t if t is None else t.add_(c) for t, c in zip(total, grads)]
        return (grad_x, None, None, None, *total)


MLP_CHUNK_BYTES = 128 * 1024 * 1024  # per (rows x intermediate) buffer in the chunked backward


def _mlp_forward(x, projections, activation, params, fold: bool):
    """down(act(gate(x)) * up(x)), and what backward needs of it: (e, g, x [A_g; A_u]^T, h A_down^T)."""
    gate, up, down = projections
    (e, g), xa_gate_up = _project(x, (gate, up), params[:6], fold=fold)
    h = _gated_forward(e, g, activation, _gate_up_lora(xa_gate_up, params, gate, up) if fold else None)
    (out,), ha_down = _project(h, (down,), params[6:])
    return out, (e, g, xa_gate_up, ha_down)


def _mlp_chunk_rows(n_rows: int, intermediate: int, element_size: int, chunk_bytes: int | None = None) -> int:
    """Rows per chunk: even chunks, each (rows x intermediate) buffer within `chunk_bytes` (MLP_CHUNK_BYTES)."""
    most = max(1, (chunk_bytes or MLP_CHUNK_BYTES) // (intermediate * element_size))
    return cdiv(n_rows, cdiv(n_rows, most))


def _mlp_backward(x, e, g, xa_gate_up, ha_down, dy, ctx, params, needs):
    """Gradients of the gated MLP from its saved (or just recomputed) gate/up outputs e, g.

    Overwrites e and g. `ha_down` (h A_down^T, for down's dB) may be None: it is then computed from
    h once the activation has been recomputed. Returns (grads of all params, dX).
    """
    gate, up, down = ctx.projections
    # down: dh first (h is not saved), then h, d(gate), d(up) recomputed in place, then down's dA, dB.
    (_, grad_b_down, grad_bias_down), dh, dy_b = _grad_projections(
        [dy], None, ha_down, (down,), params[6:], (False, needs[7] and ha_down is not None, needs[8]),
        fold_x=ctx.fold,
    )
    folded = (_gate_up_lora(xa_gate_up, params, gate, up), _DownLora(dy_b, params[6])) if ctx.fold else (None, None)
    _gated_backward_(e, g, dh, ctx.activation, *folded)  # now dh holds h, e holds d(gate), g holds d(up)
    h, d_gate, d_up = dh, e, g
    grad_a_down = (dy_b.t() @ h).to(params[6].dtype) if needs[6] else None
    if needs[7] and ha_down is None:
        ha_down = h @ _in(params[6], h.dtype).t()
        grad_b_down = _scaled_mm(dy.t(), ha_down, down.scaling).to(params[7].dtype)
    del h, dh, dy_b, ha_down, folded

    grads_gate_up, grad_x, _ = _grad_projections(
        [d_gate, d_up], x, xa_gate_up, (gate, up), params[:6], needs[:6], need_x=ctx.needs_input_grad[0]
    )
    return [*grads_gate_up, grad_a_down, grad_b_down, grad_bias_down], grad_x


# --- public API -----------------------------------------------------------------------------------


def lora_linear(
    x: torch.Tensor,
    base: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    base_quant_state: Any = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x base^T + bias + scaling * (x lora_A^T) lora_B^T; `base` is 4-bit when a quant state is given."""
    return lora_o(x, LoraWeights(base, lora_A, lora_B, float(scaling), base_quant_state, bias))


def lora_o(x: torch.Tensor, o: LoraWeights, *, replay: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A single LoRA projection (the attention output projection, or any linear).

    `replay`: the (y, xa) that `lora_o_forward` gave for this same x earlier (a checkpoint's first
    pass): y is returned as it is, with the backward wired to x and the parameters, so recomputing
    a layer skips this projection's matmuls.
    """
    o.validate("lora_o")
    if replay is not None:
        y, xa = replay
        if y.shape != (*x.shape[:-1], o.out_features) or xa.shape != (y.numel() // o.out_features, o.A.shape[0]):
            raise ValueError(f"lora_o: the replayed output {tuple(y.shape)} / x A^T {tuple(xa.shape)} "
                             f"do not fit x {tuple(x.shape)} and this projection")  # fmt: skip
        replay = ((y.reshape(-1, o.out_features),), xa)
    (y,) = _LoraProjections.apply(_flat(x), (o,), replay, *_params((o,)))
    return y.reshape(*x.shape[:-1], o.out_features)


def lora_o_forward(x: torch.Tensor, o: LoraWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient-free forward of `lora_o`, with the rank-r product x A^T a later `replay` needs."""
    o.validate("lora_o")
    rows = _flat(x)  # in the autocast dtype, as lora_o computes
    with torch.no_grad(), _autocast_off(x.device.type):
        (y,), xa = _project(rows, (o,), _params((o,)))
    return y.reshape(*x.shape[:-1], o.out_features), xa


def lora_qkv(
    x: torch.Tensor, q: LoraWeights, k: LoraWeights, v: LoraWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Q, K, V projections of one input, with one backward that accumulates dX from all three."""
    projections = (q, k, v)
    for name, p in zip("qkv", projections):
        p.validate(f"lora_qkv ({name})")
    outputs = _LoraProjections.apply(_flat(x), projections, None, *_params(projections))
    return tuple(y.reshape(*x.shape[:-1], p.out_features) for y, p in zip(outputs, projections))


def lora_mlp(
    x: torch.Tensor, gate: LoraWeights, up: LoraWeights, down: LoraWeights, activation: str = "swiglu",
    *, output_needed: bool = True,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), act = SiLU ("swiglu"), GELU ("geglu") or tanh-GELU ("geglu_tanh").

    `output_needed=False` is for a recompute pass whose caller never reads the output (only its
    gradient flows back): the result is then a zero stand-in and backward recomputes what it needs.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, p in (("gate", gate), ("up", up), ("down", down)):
        p.validate(f"lora_mlp ({name})")
    if gate.out_features != up.out_features or down.in_features != gate.out_features:
        raise ValueError("lora_mlp: gate and up must have the same width, and down must take it as input")
    projections = (gate, up, down)
    params = _params(projections)
    if torch.is_grad_enabled() and (x.requires_grad or any(t is not None and t.requires_grad for t in params)):
        out = _LoraMLP.apply(_flat(x), projections, activation, output_needed, *params)
    else:  # nothing to save for a backward (inference, a checkpointed layer's first pass): in token chunks
        with _autocast_off(x.device.type):
            out = _mlp_forward_in_chunks(_flat(x), projections, activation, params)
    return out.reshape(*x.shape[:-1], down.out_features)


def _mlp_forward_in_chunks(x, projections, activation, params):
    """The MLP's output alone, a chunk of tokens at a time: each (rows x intermediate) buffer stays
    within MLP_CHUNK_BYTES, and the down projection runs on chunks, where cuBLAS is faster than on
    all tokens at once (docs/benchmarks.md, "Tuned constants")."""
    fold = _folds(projections)
    rows = _mlp_chunk_rows(x.shape[0], projections[0].out_features, x.element_size())
    if rows >= x.shape[0]:
        return _mlp_forward(x, projections, activation, params, fold)[0]
    out = torch.empty((x.shape[0], projections[2].out_features), dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[0], rows):
        out[start : start + rows] = _mlp_forward(x[start : start + rows], projections, activation, params, fold)[0]
    return out
