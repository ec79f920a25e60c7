"""LoRA projections with hand-written backward: single linears, the gated MLP, and fused Q/K/V.

A LoRA linear computes y = x W^T + bias + s (x A^T) B^T with the base W frozen (dense, or 4-bit in
bitsandbytes' format and dequantized on the fly) and only A (r, in), B (out, r) trained, s = alpha / r.
Autograd through the plain composition keeps more than it needs and makes several extra passes;
the functions here save only x and the rank-r product x A^T (plus, for the MLP, the two gate/up
pre-activations) and compute

    dX = dY W + s (dY B) A        dA = s (dY B)^T X        dB = s dY^T (X A^T)

with every matmul in torch (cuBLAS / hipBLAS), the LoRA terms folded into the base outputs with
`addmm_(alpha=s)` so no separate buffers are made. A dequantized NF4 weight lives only for the one
matmul that needs it, in forward and again in backward.

In the MLP, down(act(gate(x)) * up(x)), the activation is not saved: one Triton kernel recomputes it
in backward and writes h, d(gate), d(up) over the buffers it reads (dh, gate, up). That makes the
backward single-use: calling it twice (retain_graph) raises instead of returning wrong gradients.

These fast paths assume lora_dropout == 0 (dropout would need the dropped x kept for dA); the
trainer falls back to peft's own modules otherwise. The base weight and its quantization are never
trained here; a trainable bias gets its gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ._utils import check_device
from .nf4 import dequantize_bnb_4bit

ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")
_ELEMENTWISE_BLOCK = 1024


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
            return dequantize_bnb_4bit(self.weight, self.quant_state, dtype=dtype)
        return self.weight.to(dtype)

    def validate(self, name: str = "lora") -> None:
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


@triton.jit
def _tanh(x):
    # Portable (no libdevice): saturates correctly at +-inf.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _activation_and_derivative(e, ACTIVATION: tl.constexpr):
    """f(e) and f'(e) in fp32 for SiLU, exact GELU and tanh-approximated GELU."""
    if ACTIVATION == "swiglu":
        sig = 1.0 / (1.0 + tl.exp(-e))
        f = e * sig
        df = sig * (1.0 + e * (1.0 - sig))
    elif ACTIVATION == "geglu":
        cdf = 0.5 * (1.0 + tl.erf(e * 0.7071067811865476))
        f = e * cdf
        df = cdf + e * 0.3989422804014327 * tl.exp(-0.5 * e * e)
    else:
        inner = 0.7978845608028654 * (e + 0.044715 * e * e * e)
        t = _tanh(inner)
        f = 0.5 * e * (1.0 + t)
        df = 0.5 * (1.0 + t) + 0.5 * e * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * e * e)
    return f, df


@triton.jit
def _gated_forward_kernel(e_ptr, g_ptr, h_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(e_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    f, _ = _activation_and_derivative(e, ACTIVATION)
    tl.store(h_ptr + offs, (f * g).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_backward_kernel(e_ptr, g_ptr, dh_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """Reads e, g, dh; writes h over dh, d(e) over e, d(g) over g."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(e_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    f, df = _activation_and_derivative(e, ACTIVATION)
    tl.store(dh_ptr + offs, (f * g).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(e_ptr + offs, (dh * g * df).to(e_ptr.dtype.element_ty), mask=mask)
    tl.store(g_ptr + offs, (dh * f).to(g_ptr.dtype.element_ty), mask=mask)


def _gated_forward(e: torch.Tensor, g: torch.Tensor, activation: str) -> torch.Tensor:
    h = torch.empty_like(e)
    n = e.numel()
    if n == 0:
        return h
    _gated_forward_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
        e, g, h, n, ACTIVATION=activation, BLOCK=_ELEMENTWISE_BLOCK
    )
    return h


def _gated_backward_(e: torch.Tensor, g: torch.Tensor, dh: torch.Tensor, activation: str) -> None:
    n = e.numel()
    if n == 0:
        return
    _gated_backward_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
        e, g, dh, n, ACTIVATION=activation, BLOCK=_ELEMENTWISE_BLOCK
    )


# --- one projection: forward, and the two halves of its backward ---------------------------------


def _project(x: torch.Tensor, p: LoraWeights, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None):
    """y = x W^T + bias + s (x A^T) B^T, and x A^T (kept for dB)."""
    xa = x @ A.to(x.dtype).t()
    weight_t = p.base_weight(x.dtype).t()
    y = x @ weight_t if bias is None else torch.addmm(bias.to(x.dtype), x, weight_t)
    y.addmm_(xa, B.to(x.dtype).t(), alpha=p.scaling)
    return y, xa


def _grad_input(dy, dy_b, p: LoraWeights, A, out=None):
    """dX = dY W + s (dY B) A, accumulated into `out` when given."""
    weight = p.base_weight(dy.dtype)
    if out is None:
        out = dy @ weight
    else:
        out.addmm_(dy, weight)
    del weight  # a dequantized copy need not outlive its matmul
    return out.addmm_(dy_b, A.to(dy.dtype), alpha=p.scaling)


def _grad_params(dy, dy_b, x, xa, p: LoraWeights, A, B, bias, needs):
    """(dA, dB, dbias) in the parameters' dtypes; None where not needed."""
    need_a, need_b, need_bias = needs
    grad_a = (dy_b.t() @ x).mul_(p.scaling).to(A.dtype) if need_a else None
    grad_b = (dy.t() @ xa).mul_(p.scaling).to(B.dtype) if need_b else None
    grad_bias = dy.sum(0, dtype=torch.float32).to(bias.dtype) if need_bias and bias is not None else None
    return grad_a, grad_b, grad_bias


def _flat(x: torch.Tensor) -> torch.Tensor:
    """Rows of x, in the autocast dtype when autocast is on (as nn.Linear would compute)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    return x.reshape(-1, x.shape[-1]).contiguous()


def _no_autocast(method):
    """Run a forward/backward with autocast off: the dtypes are chosen explicitly inside."""

    @functools.wraps(method)
    def wrapper(ctx, first, *args):
        with torch.autocast(first.device.type, enabled=False):
            return method(ctx, first, *args)

    return wrapper


def _params(projections) -> list:
    return [t for p in projections for t in (p.A, p.B, p.bias)]


class _LoraProjections(torch.autograd.Function):
    """Several LoRA projections of one input (1 for a linear, 3 for Q/K/V): one dX in backward."""

    @staticmethod
    @_no_autocast
    def forward(ctx, x, projections, *params):
        outputs, xas = [], []
        for i, p in enumerate(projections):
            A, B, bias = params[3 * i : 3 * i + 3]
            y, xa = _project(x, p, A, B, bias)
            outputs.append(y)
            xas.append(xa)
        ctx.projections = projections
        ctx.save_for_backward(x, *xas, *params)
        return tuple(outputs)

    @staticmethod
    @_no_autocast
    def backward(ctx, *grad_outputs):
        x, *rest = ctx.saved_tensors
        count = len(ctx.projections)
        xas, params = rest[:count], rest[count:]
        need_x = ctx.needs_input_grad[0]
        grad_x, grads = None, []
        for i, (p, dy) in enumerate(zip(ctx.projections, grad_outputs)):
            A, B, bias = params[3 * i : 3 * i + 3]
            dy = dy.contiguous()
            dy_b = dy @ B.to(dy.dtype)
            grads += _grad_params(dy, dy_b, x, xas[i], p, A, B, bias, ctx.needs_input_grad[2 + 3 * i : 5 + 3 * i])
            if need_x:
                grad_x = _grad_input(dy, dy_b, p, A, out=grad_x)
        return (grad_x, None, *grads)


class _LoraMLP(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) with the activation recomputed in backward."""

    @staticmethod
    @_no_autocast
    def forward(ctx, x, projections, activation, *params):
        gate, up, down = projections
        e, xa_gate = _project(x, gate, *params[0:3])
        g, xa_up = _project(x, up, *params[3:6])
        h = _gated_forward(e, g, activation)
        out, ha_down = _project(h, down, *params[6:9])
        ctx.projections, ctx.activation, ctx.used = projections, activation, False
        ctx.save_for_backward(x, e, g, xa_gate, xa_up, ha_down, *params)
        return out

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError("lora_mlp: backward reuses its saved buffers and can run only once (no retain_graph)")
        ctx.used = True
        x, e, g, xa_gate, xa_up, ha_down, *params = ctx.saved_tensors
        gate, up, down = ctx.projections
        needs = ctx.needs_input_grad[3:]
        dy = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()

        dy_b = dy @ params[7].to(dy.dtype)
        dh = _grad_input(dy, dy_b, down, params[6])
        _gated_backward_(e, g, dh, ctx.activation)  # now dh holds h, e holds d(gate), g holds d(up)
        h, d_gate, d_up = dh, e, g
        grads_down = _grad_params(dy, dy_b, h, ha_down, down, *params[6:9], needs[6:9])
        del h, dh, dy_b

        d_gate_b = d_gate @ params[1].to(d_gate.dtype)
        d_up_b = d_up @ params[4].to(d_up.dtype)
        grads_gate = _grad_params(d_gate, d_gate_b, x, xa_gate, gate, *params[0:3], needs[0:3])
        grads_up = _grad_params(d_up, d_up_b, x, xa_up, up, *params[3:6], needs[3:6])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _grad_input(d_gate, d_gate_b, gate, params[0])
            grad_x = _grad_input(d_up, d_up_b, up, params[3], out=grad_x)
        return (grad_x, None, None, *grads_gate, *grads_up, *grads_down)


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


def lora_o(x: torch.Tensor, o: LoraWeights) -> torch.Tensor:
    """A single LoRA projection (the attention output projection, or any linear)."""
    o.validate("lora_o")
    (y,) = _LoraProjections.apply(_flat(x), (o,), *_params((o,)))
    return y.reshape(*x.shape[:-1], o.out_features)


def lora_qkv(
    x: torch.Tensor, q: LoraWeights, k: LoraWeights, v: LoraWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Q, K, V projections of one input, with one backward that accumulates dX from all three."""
    projections = (q, k, v)
    for name, p in zip("qkv", projections):
        p.validate(f"lora_qkv ({name})")
    outputs = _LoraProjections.apply(_flat(x), projections, *_params(projections))
    return tuple(y.reshape(*x.shape[:-1], p.out_features) for y, p in zip(outputs, projections))


def lora_mlp(
    x: torch.Tensor, gate: LoraWeights, up: LoraWeights, down: LoraWeights, activation: str = "swiglu"
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), act = SiLU ("swiglu"), GELU ("geglu") or tanh-GELU ("geglu_tanh")."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, p in (("gate", gate), ("up", up), ("down", down)):
        p.validate(f"lora_mlp ({name})")
    if gate.out_features != up.out_features or down.in_features != gate.out_features:
        raise ValueError("lora_mlp: gate and up must have the same width, and down must take it as input")
    projections = (gate, up, down)
    out = _LoraMLP.apply(_flat(x), projections, activation, *_params(projections))
    return out.reshape(*x.shape[:-1], down.out_features)
