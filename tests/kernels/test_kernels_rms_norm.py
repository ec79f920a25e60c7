"""RMSNorm kernel: output and every gradient against float64, and exact behaviour of HF's modules.

Runs on the CPU through TRITON_INTERPRET=1 at small, odd shapes; with UNSLOTH_TEST_REAL_SHAPES=1 on a
GPU, the same comparison runs at Llama-3.1-8B shapes (16384 x 4096).
"""

from __future__ import annotations

import pytest
import torch
from reference import (
    DEVICE, UNIT_ROUNDOFF, assert_close_dtype, assert_compile_for_gpus, f64, needs_kernels, real_shapes,
    rms_norm_ref, strided_layouts, without_gpu,
)

import unsloth_kernels._utils as kernel_utils
from unsloth_kernels import RMSNorm, rms_norm

pytestmark = needs_kernels
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# A single row, hidden sizes that are not powers of two, a batch of 1, a 3-D batch, and enough
# rows (150) that each backward program walks several tiles, the last one partial.
SHAPES = [(1, 129), (5, 1000), (1, 3, 64), (2, 7, 129), (3, 50, 1000)]
MODES = [("llama", 0.0), ("gemma", 1.0)]  # (cast, offset)
# Bit-level comparisons with HF: Triton's CPU interpreter converts fp32 -> bf16 by truncation (the GPU
# rounds to nearest-even like torch), so under the interpreter they run in fp16 only.
EXACT_DTYPES = [torch.float16] + ([] if kernel_utils.INTERPRET else [torch.bfloat16])


def make_inputs(shape, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x.to(device), weight.to(device), dy.to(device)


def check_against_float64(shape, dtype, cast, offset, residual=False, device=DEVICE):
    x, weight, dy = make_inputs(shape, dtype, device=device)
    r = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device) if residual else None
    ds = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype).to(device) if residual else None
    xk, wk = x.clone().requires_grad_(), weight.clone().requires_grad_()
    rk = r.clone().requires_grad_() if residual else None
    out = rms_norm(xk, wk, 1e-6, offset=offset, residual=rk, cast=cast)
    xr, wr = f64(x, weight)
    rr = f64(r) if residual else None
    ref = rms_norm_ref(xr, wr, 1e-6, offset, rr)
    hidden, rows = shape[-1], x.numel() // shape[-1]
    if residual:
        torch.autograd.backward(out, (dy, ds))
        torch.autograd.backward(ref, (dy.double(), ds.double()))
        assert_close_dtype(out[1], ref[1], dtype, name="x + residual")
        assert_close_dtype(rk.grad, rr.grad, dtype, n_reduce=hidden, name="d residual")
        out, ref = out[0], ref[0]
    else:
        out.backward(dy)
        ref.backward(dy.double())
    assert out.dtype == dtype
    assert_close_dtype(out, ref, dtype, n_reduce=hidden, name="y")
    assert_close_dtype(xk.grad, xr.grad, dtype, n_reduce=hidden, name="dx")
    # dweight sums `rows` terms, each carrying the error of a `hidden`-long row reduction.
    assert_close_dtype(wk.grad, wr.grad, dtype, n_reduce=rows + hidden, name="dweight")


@pytest.mark.parametrize("cast,offset", MODES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_float64(dtype, shape, cast, offset):
    check_against_float64(shape, dtype, cast, offset)


@pytest.mark.parametrize("cast,offset", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual_add_returns_the_sum_and_sums_both_gradients(dtype, cast, offset):
    check_against_float64((3, 5, 1000), dtype, cast, offset, residual=True)


@pytest.mark.parametrize("dtype", EXACT_DTYPES)
def test_residual_sum_is_rounded_like_hf_before_normalising(dtype):
    # HF: hidden = residual + hidden (in the activation dtype), then norm(hidden): same sum, same y.
    x, weight, _ = make_inputs((4, 129), dtype)
    r = torch.randn(4, 129).to(dtype).to(DEVICE)
    y, s = rms_norm(x, weight, residual=r)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(y, rms_norm(s, weight), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", EXACT_DTYPES)
def test_llama_module_matches_hf_llama_rmsnorm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden = 1000
    hf = LlamaRMSNorm(hidden, eps=1e-5).to(DEVICE, dtype)
    ours = RMSNorm(hidden, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        hf.weight.normal_(1.0, 0.2)
    ours.load_state_dict(hf.state_dict())
    assert ours.variance_epsilon == hf.variance_epsilon
    x = torch.randn(6, 9, hidden, device=DEVICE).to(dtype)
    expected, actual = hf(x), ours(x)
    # Same roundings in the same order; only the fp32 sum of squares may differ in its last bit,
    # which in rare cases moves the normalised row, rounded to dtype, by one ulp (relative <= 2u);
    # the product with the weight is rounded again (<= u): 3u in all.
    assert actual.dtype == expected.dtype
    assert (actual == expected).float().mean() > 0.99
    torch.testing.assert_close(actual, expected, rtol=3 * UNIT_ROUNDOFF[dtype], atol=0)


@pytest.mark.parametrize("dtype", EXACT_DTYPES)
def test_gemma_module_matches_hf_gemma_rmsnorm(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    hidden = 129
    hf = GemmaRMSNorm(hidden, eps=1e-6).to(DEVICE, dtype)
    ours = RMSNorm(hidden, eps=1e-6, offset=1.0, cast="gemma").to(DEVICE, dtype)
    assert torch.equal(ours.weight, hf.weight)  # both start at zero: (1 + w) = 1
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.2)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(6, 9, hidden, device=DEVICE).to(dtype)
    expected, actual = hf(x), ours(x)
    assert (actual == expected).float().mean() > 0.99
    torch.testing.assert_close(actual, expected, rtol=2 * UNIT_ROUNDOFF[dtype], atol=0)


@pytest.mark.parametrize("dtype", EXACT_DTYPES)
def test_fp32_weight_with_16_bit_input_promotes_like_hf(dtype):
    # HF Llama: `self.weight * hidden.to(input_dtype)` with an fp32 weight gives an fp32 output.
    x, weight, _ = make_inputs((3, 64), dtype)
    y = rms_norm(x, weight.float())
    assert y.dtype == torch.float32
    x_hat = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, weight.float() * x_hat.to(dtype), rtol=2 * UNIT_ROUNDOFF[dtype], atol=0)


@pytest.mark.parametrize("residual", [False, True])
def test_strided_inputs_and_gradients_give_the_contiguous_results(residual):
    x_layouts = strided_layouts(12, 64, torch.float32, seed=0)
    r_layouts = strided_layouts(12, 64, torch.float32, seed=1)
    weight = torch.linspace(0.5, 1.5, 64, device=DEVICE)
    dy = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = {}
    for layout in x_layouts:
        x = x_layouts[layout].detach().requires_grad_()
        w = weight.clone().requires_grad_()
        r = r_layouts[layout].detach().requires_grad_() if residual else None
        out = rms_norm(x, w, residual=r)
        outs = out if residual else (out,)
        # ds as autograd may hand it over: expanded, every stride 0 but the last.
        grads = (dy, dy[:1, :1].expand_as(dy)) if residual else (dy,)
        torch.autograd.backward(outs, grads)
        assert all(o.shape == x.shape for o in outs)
        results[layout] = [*outs, x.grad, w.grad] + ([r.grad] if residual else [])
    for layout, result in results.items():
        for got, want in zip(result, results["contiguous"]):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=layout)


def test_bad_arguments_are_named():
    x, weight, _ = make_inputs((2, 64), torch.float32)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(x, weight[:10])
    with pytest.raises(ValueError, match="cast must be one of"):
        rms_norm(x, weight, cast="mistral")
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(x, weight, residual=x[:1])


def test_cpu_tensors_without_the_interpreter_get_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    x, weight, _ = make_inputs((2, 64), torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rms_norm(x, weight)


def test_an_empty_batch_gives_empty_outputs_and_zero_weight_grad():
    x = torch.randn(0, 64, device=DEVICE, requires_grad=True)
    weight = torch.ones(64, device=DEVICE, requires_grad=True)
    y = rms_norm(x, weight)
    y.sum().backward()
    assert y.shape == (0, 64) and torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_frozen_weight_gets_no_gradient_and_the_same_dx(residual):
    # LoRA freezes the norms: backward then skips dW (its accumulation and its reduction launch),
    # and the input gradients must be bit-identical to those of a trainable weight.
    x, weight, dy = make_inputs((3, 50, 1000), torch.bfloat16)
    r = torch.randn_like(x) if residual else None
    grads = []
    for trainable in (True, False):
        xk, wk = x.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
        rk = r.clone().requires_grad_() if residual else None
        out = rms_norm(xk, wk, residual=rk)
        torch.autograd.backward(out, (dy, dy) if residual else dy)
        assert (wk.grad is not None) == trainable
        grads.append((xk.grad, rk.grad if residual else None))
    (dx, dr), (dx_frozen, dr_frozen) = grads
    assert torch.equal(dx, dx_frozen) and (not residual or torch.equal(dr, dr_frozen))


def test_weight_grad_summed_over_many_partials(monkeypatch):
    # Many backward programs (more partial rows than one step of sum_partials takes, and not a
    # multiple of it) and a width that is not a multiple of its column block.
    monkeypatch.setitem(kernel_utils.NORM_TUNING["backward"], "programs_per_sm", 20)
    monkeypatch.setattr(kernel_utils, "SUM_BLOCK_P", 16)
    monkeypatch.setattr(kernel_utils, "SUM_BLOCK_N", 64)
    check_against_float64((300, 1000), torch.float32, "llama", 0.0)


COMPILE_CASES = [  # Llama-3.1-8B rows, 4096 wide, tiled as the launcher tiles them (see _utils.row_tile)
    ("unsloth_kernels.rms_norm", "_rms_norm_fwd", dict(HAS_RESIDUAL=r, LLAMA_CAST=c, BLOCK_M=2, BLOCK_N=4096), 16)
    for r in (False, True) for c in (False, True)
] + [
    ("unsloth_kernels.rms_norm", "_rms_norm_bwd", dict(HAS_DS=d, HAS_DW=w, LLAMA_CAST=c, BLOCK_M=2, BLOCK_N=4096), 16)
    for d in (False, True) for w in (False, True) for c in (False, True)
]


@without_gpu
def test_kernels_compile_for_cuda_and_rocm_gpus():
    assert_compile_for_gpus(COMPILE_CASES)


@real_shapes
@pytest.mark.parametrize("cast,offset,residual", [("llama", 0.0, False), ("gemma", 1.0, False), ("llama", 0.0, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_real_shapes(dtype, cast, offset, residual):
    check_against_float64((8, 2048, 4096), dtype, cast, offset, residual=residual, device="cuda")
