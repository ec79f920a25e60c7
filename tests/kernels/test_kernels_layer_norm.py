"""LayerNorm kernel: output and gradients (x, weight, bias) against float64 and torch.nn.LayerNorm."""

from __future__ import annotations

import pytest
import torch
from reference import (
    DEVICE, assert_close_dtype, assert_compile_for_gpus, f64, layer_norm_ref, needs_kernels, real_shapes,
    strided_layouts, tolerance, without_gpu,
)

import unsloth_kernels._utils as kernel_utils
from unsloth_kernels import LayerNorm, layer_norm

pytestmark = needs_kernels
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# The last shape has enough rows (150) that each backward program walks several tiles.
SHAPES = [(1, 129), (5, 1000), (2, 7, 129), (3, 50, 1000)]


def check_against_float64(shape, dtype, bias, device=DEVICE):
    g = torch.Generator().manual_seed(0)
    # An offset mean makes the centring matter (and catches a variance computed without it).
    x = (torch.randn(shape, generator=g) + 3).to(dtype).to(device)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
    b = (0.5 * torch.randn(shape[-1], generator=g)).to(dtype).to(device) if bias else None
    dy = torch.randn(shape, generator=g).to(dtype).to(device)
    xk, wk = x.clone().requires_grad_(), weight.clone().requires_grad_()
    bk = b.clone().requires_grad_() if bias else None
    y = layer_norm(xk, wk, bk)
    y.backward(dy)
    xr, wr = f64(x, weight)
    br = f64(b) if bias else None
    yr = layer_norm_ref(xr, wr, br)
    yr.backward(dy.double())
    hidden, rows = shape[-1], x.numel() // shape[-1]
    assert y.dtype == dtype
    assert_close_dtype(y, yr, dtype, n_reduce=hidden, name="y")
    assert_close_dtype(xk.grad, xr.grad, dtype, n_reduce=hidden, name="dx")
    # dweight sums `rows` terms, each carrying the error of a `hidden`-long row reduction.
    assert_close_dtype(wk.grad, wr.grad, dtype, n_reduce=rows + hidden, name="dweight")
    if bias:
        assert_close_dtype(bk.grad, br.grad, dtype, n_reduce=rows, name="dbias")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_float64(dtype, shape, bias):
    check_against_float64(shape, dtype, bias)


def test_strided_inputs_and_gradients_give_the_contiguous_results():
    layouts = strided_layouts(12, 64, torch.float32, seed=0)
    dy_layouts = strided_layouts(12, 64, torch.float32, seed=1)  # dy laid out like x, values alike
    weight = torch.linspace(0.5, 1.5, 64, device=DEVICE)
    bias = torch.linspace(-1, 1, 64, device=DEVICE)
    results = {}
    for layout, x in layouts.items():
        x, w, b = x.detach().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()
        y = layer_norm(x, w, b)
        y.backward(dy_layouts[layout])
        assert y.shape == x.shape
        results[layout] = (y, x.grad, w.grad, b.grad)
    for layout, result in results.items():
        for got, want in zip(result, results["contiguous"]):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=layout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_module_is_a_drop_in_for_torch_layer_norm(dtype):
    torch_ln = torch.nn.LayerNorm(1000, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        torch_ln.weight.normal_(1.0, 0.2)
        torch_ln.bias.normal_(0.0, 0.2)
    ours = LayerNorm(1000, eps=1e-5).to(DEVICE, dtype)
    ours.load_state_dict(torch_ln.state_dict())
    assert ours.variance_epsilon == torch_ln.eps
    x = torch.randn(4, 5, 1000, device=DEVICE).to(dtype)
    # Both compute in fp32 and round once; they differ only in the order of the fp32 sums.
    tol = tolerance(dtype, n_reduce=1000)
    torch.testing.assert_close(ours(x), torch_ln(x), rtol=tol, atol=tol)


def test_bad_arguments_are_named():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight shape"):
        layer_norm(x, torch.ones(63, device=DEVICE))
    with pytest.raises(ValueError, match="bias shape"):
        layer_norm(x, torch.ones(64, device=DEVICE), torch.zeros(3, device=DEVICE))


def test_an_empty_batch_gives_empty_outputs_and_zero_grads():
    x = torch.randn(0, 64, device=DEVICE, requires_grad=True)
    weight = torch.ones(64, device=DEVICE, requires_grad=True)
    bias = torch.zeros(64, device=DEVICE, requires_grad=True)
    layer_norm(x, weight, bias).sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("train_weight,train_bias", [(False, True), (True, False), (False, False)])
def test_frozen_parameters_get_no_gradient_and_the_rest_is_unchanged(train_weight, train_bias):
    # A gradient nobody needs is neither accumulated nor reduced; what is computed must be
    # bit-identical to the all-trainable run.
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(3, 50, 1000, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    weight, bias = ((1 + 0.2 * torch.randn(1000, generator=g)).to(torch.bfloat16).to(DEVICE) for _ in range(2))

    def grads(train_w, train_b):
        xk, wk, bk = x.clone().requires_grad_(), weight.clone().requires_grad_(train_w), bias.clone().requires_grad_(train_b)
        layer_norm(xk, wk, bk).backward(dy)
        return xk.grad, wk.grad, bk.grad

    dx, dw, db = grads(True, True)
    dx_f, dw_f, db_f = grads(train_weight, train_bias)
    assert torch.equal(dx, dx_f)
    assert torch.equal(dw, dw_f) if train_weight else dw_f is None
    assert torch.equal(db, db_f) if train_bias else db_f is None


def test_grads_summed_over_many_partials(monkeypatch):
    # More backward programs than one step of sum_partials takes, not a multiple of it, and a
    # width that is not a multiple of its column block: dW and dB through one launch.
    monkeypatch.setitem(kernel_utils.NORM_TUNING["backward"], "programs_per_sm", 20)
    monkeypatch.setattr(kernel_utils, "SUM_BLOCK_P", 16)
    monkeypatch.setattr(kernel_utils, "SUM_BLOCK_N", 64)
    check_against_float64((300, 1000), torch.float32, bias=True)


COMPILE_CASES = [  # Llama-3.1-8B-wide rows, tiled as the launcher tiles them (see _utils.row_tile)
    ("unsloth_kernels.layer_norm", "_layer_norm_fwd", dict(HAS_BIAS=b, BLOCK_M=2, BLOCK_N=4096), 16) for b in (False, True)
] + [
    ("unsloth_kernels.layer_norm", "_layer_norm_bwd", dict(HAS_DW=w, HAS_DB=b, BLOCK_M=2, BLOCK_N=4096), 16)
    for w, b in ((True, True), (True, False), (False, False))
]


@without_gpu
def test_kernels_compile_for_cuda_and_rocm_gpus():
    assert_compile_for_gpus(COMPILE_CASES)


@real_shapes
@pytest.mark.parametrize("dtype", DTYPES)
def test_real_shapes(dtype):
    check_against_float64((8, 2048, 4096), dtype, bias=True, device="cuda")
