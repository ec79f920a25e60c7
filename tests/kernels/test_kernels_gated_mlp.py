"""The full fine-tuning gated MLP (dense trained weights) against float64 autograd of the plain composition.

Tolerances as in test_kernels_lora.py: a weight gradient goes through about as many roundings to
`dtype` as the LoRA MLP's longest chain (e, g, dh, h, d(gate), d(up), the product), hence the same
CHAIN_FACTOR over the plain bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import DEVICE, assert_close_dtype, f64, needs_kernels

import unsloth_kernels.gated_mlp as gated_mlp
from unsloth_kernels.gated_mlp import dense_gated_mlp

pytestmark = needs_kernels
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CHAIN_FACTOR = 4
ACTIVATION_REF = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": lambda t: F.gelu(t, approximate="tanh")}
HIDDEN, INTER, ROWS = 24, 40, 11  # not powers of two; 11 rows split 4, 4, 3 when chunked


def weights(dtype, *, seed=0, trained=(True, True, True)):
    g = torch.Generator().manual_seed(seed)
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    return [(torch.randn(*s, generator=g) / s[1] ** 0.5).to(DEVICE, dtype).requires_grad_(t)
            for s, t in zip(shapes, trained)]  # fmt: skip


def reference(x, ws, activation):
    """Float64 leaves of the same values, and the MLP computed on them."""
    x64, ws64 = f64(x), [f64(w) if w.requires_grad else w.detach().double() for w in ws]
    wg, wu, wd = ws64
    out = (ACTIVATION_REF[activation](x64 @ wg.t()) * (x64 @ wu.t())) @ wd.t()
    return x64, ws64, out


def check(x, ws, x64, ws64, dtype):
    assert_close_dtype(x.grad, x64.grad, dtype, n_reduce=INTER, name="dX", factor=CHAIN_FACTOR)
    for name, w, r in zip(("gate", "up", "down"), ws, ws64):
        if w.requires_grad:
            assert w.grad.dtype == w.dtype
            assert_close_dtype(w.grad, r.grad, dtype, n_reduce=ROWS, name=f"d{name}", factor=CHAIN_FACTOR)
        else:
            assert w.grad is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(ACTIVATION_REF))
def test_output_and_gradients(activation, dtype):
    ws = weights(dtype, seed=1)
    x = torch.randn(2, ROWS, HIDDEN, dtype=dtype, device=DEVICE).requires_grad_()
    out = dense_gated_mlp(x, *ws, activation)
    dout = torch.randn_like(out)
    out.backward(dout)
    x64, ws64, expected = reference(x, ws, activation)
    expected.backward(dout.double())
    assert out.shape == (2, ROWS, HIDDEN)
    assert_close_dtype(out, expected, dtype, n_reduce=INTER, name="out", factor=CHAIN_FACTOR)
    check(x, ws, x64, ws64, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_rows", [None, 4], ids=["one chunk", "chunks of 4 rows"])
def test_without_output_gives_the_gradients(chunk_rows, dtype, monkeypatch):
    """The recompute pass of a checkpointed layer: no output, every gradient as float64 gives it."""
    if chunk_rows:
        monkeypatch.setattr(gated_mlp, "CHUNK_BYTES", INTER * torch.finfo(dtype).bits // 8 * chunk_rows)
    ws = weights(dtype, seed=2)
    x = torch.randn(ROWS, HIDDEN, dtype=dtype, device=DEVICE).requires_grad_()
    out = dense_gated_mlp(x, *ws, output_needed=False)
    assert out.shape == (ROWS, HIDDEN)
    assert out.count_nonzero() == 0 and out.untyped_storage().nbytes() <= 4  # a stand-in, no buffer
    dout = torch.randn(ROWS, HIDDEN, dtype=dtype, device=DEVICE)
    (out * 0 + out).backward(dout)  # the output only feeds a sum, as in a residual stream
    x64, ws64, expected = reference(x, ws, "swiglu")
    expected.backward(dout.double())
    check(x, ws, x64, ws64, dtype)


def test_frozen_weights_get_no_gradient_and_fp32_weights_compute_in_the_autocast_dtype():
    """A frozen projection gets none; fp32 master weights under bf16 autocast compute in bf16 (as
    nn.Linear would) and get fp32 gradients."""
    ws = weights(torch.float32, seed=3, trained=(True, False, True))
    x = torch.randn(ROWS, HIDDEN, device=DEVICE).requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = dense_gated_mlp(x, *ws)
    assert out.dtype == torch.bfloat16
    dout = torch.randn_like(out)
    out.backward(dout)
    x64, ws64, expected = reference(x.detach().bfloat16().requires_grad_(), [w.detach().bfloat16().requires_grad_(
        w.requires_grad) for w in ws], "swiglu")  # fmt: skip
    expected.backward(dout.double())
    assert x.grad.dtype == torch.float32
    check(x, ws, x64, ws64, torch.bfloat16)


def test_backward_twice_is_refused_and_bad_shapes_are_named():
    ws = weights(torch.float32)
    out = dense_gated_mlp(torch.randn(2, HIDDEN, device=DEVICE, requires_grad=True), *ws).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        out.backward()
    with pytest.raises(ValueError, match="gate .* up .* down"):
        dense_gated_mlp(torch.randn(2, HIDDEN, device=DEVICE), ws[0], ws[1], ws[0])
    with pytest.raises(ValueError, match="activation"):
        dense_gated_mlp(torch.randn(2, HIDDEN, device=DEVICE), *ws, "relu")
