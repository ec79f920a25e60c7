"""Fused linear + cross-entropy against a float64 PyTorch reference (loss and every gradient).

Tolerances (see reference.py): the kernel rounds the logits to the input dtype once (the matmul
output), computes softmax in fp32, rounds the gradient of the logits to the input dtype once, and
the dX / dW matmuls round their fp32 sums once more. `assert_close_dtype`'s per-dtype bound covers
those few roundings. One effect needs `LOGIT_FACTOR`: rounding a logit of size |z| to the dtype moves
it by u|z| absolutely, so exp(z - lse), the loss and every gradient carry a relative error of about
u|z|, not u. The test logits have |z| up to ~3 (see make_inputs); the CPU interpreter also truncates
instead of rounding to bf16 (twice the error), hence 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import DEVICE, assert_close_dtype, f64, lm_head_inputs, needs_kernels, real_shapes

from unsloth_kernels.cross_entropy import chunk_rows, fused_linear_cross_entropy

pytestmark = needs_kernels
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LOGIT_FACTOR = 4




def reference(x, w, b, labels, *, softcap=None, logit_scale=None, reduction="mean", total_tokens=None):
    logits = F.linear(x, w, b)
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, labels, reduction="sum")
    if reduction == "mean":
        loss = loss / (total_tokens if total_tokens is not None else (labels != -100).sum())
    return loss


def run_both(x, w, b, labels, *, train_weight, **kwargs):
    x_ref, w_ref, b_ref = f64(x, w, b) if b is not None else (*f64(x, w), None)
    w_ref.requires_grad_(train_weight)
    expected = reference(x_ref, w_ref, b_ref, labels, **kwargs)
    expected.backward()

    x, w = x.clone().requires_grad_(), w.clone().requires_grad_(train_weight)
    if b is not None:
        b = b.clone().requires_grad_()
    actual = fused_linear_cross_entropy(x, w, labels, bias=b, **kwargs)
    actual.backward()
    return (actual, x, w, b), (expected, x_ref, w_ref, b_ref)


CASES = {
    "llama3": dict(vocab=128256),
    "qwen2-softcap": dict(vocab=151936, softcap=5.0),
    "scaled": dict(vocab=128256, logit_scale=0.25),
    "softcap-and-scale": dict(vocab=1000, softcap=2.0, logit_scale=1.5),
    "bias-trainable-head": dict(vocab=1000, bias=True, train_weight=True),
    "sum": dict(vocab=1000, reduction="sum", train_weight=True),
    "total-tokens": dict(vocab=1000, total_tokens=7),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_matches_float64_reference(case, dtype):
    spec = dict(CASES[case])
    vocab, bias, train_weight = spec.pop("vocab"), spec.pop("bias", False), spec.pop("train_weight", False)
    # 3 tokens, one ignored; hidden 24 is not a power of two. Interpreter cost grows with N * V.
    x, w, b, labels = lm_head_inputs(3, 24, vocab, dtype, ignore=(1,), bias=bias)
    (loss, x, w, b), (ref, x_ref, w_ref, b_ref) = run_both(x, w, b, labels, train_weight=train_weight, **spec)

    assert loss.dtype == torch.float32
    assert_close_dtype(loss, ref, dtype, n_reduce=vocab, name="loss", factor=LOGIT_FACTOR)
    assert_close_dtype(x.grad, x_ref.grad, dtype, n_reduce=vocab, name="dX", factor=LOGIT_FACTOR)
    assert not x.grad[1].any()  # the ignored token
    if train_weight:
        assert_close_dtype(w.grad, w_ref.grad, dtype, n_reduce=3, name="dW", factor=LOGIT_FACTOR)
    else:
        assert w.grad is None  # a frozen head gets no gradient (and costs no dW matmul)
    if b is not None:
        assert_close_dtype(b.grad, b_ref.grad, dtype, n_reduce=3, name="dbias", factor=LOGIT_FACTOR)


def test_ignored_row_has_no_gradient():
    x, w, _, labels = lm_head_inputs(4, 16, 500, torch.float32, ignore=(2,))
    x.requires_grad_()
    fused_linear_cross_entropy(x, w, labels).backward()
    assert not x.grad[2].any() and x.grad[0].any()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_labels_ignored_gives_zero_not_nan(reduction):
    # torch's mean would be 0/0 = NaN; packing can produce such batches, so we define it as 0.
    x, w, _, labels = lm_head_inputs(3, 16, 700, torch.bfloat16, ignore=(0, 1, 2))
    x.requires_grad_()
    w.requires_grad_()
    loss = fused_linear_cross_entropy(x, w, labels, reduction=reduction)
    loss.backward()
    assert loss.item() == 0.0
    assert not x.grad.any() and not w.grad.any()


def test_empty_batch_gives_zero():
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long, device=DEVICE)
    loss = fused_linear_cross_entropy(x, torch.randn(50, 16, device=DEVICE), labels)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == (0, 16)


def test_chunking_does_not_change_the_result():
    x, w, _, labels = lm_head_inputs(7, 16, 300, torch.float32, ignore=(3,))
    results = []
    for chunk in (None, 1, 2, 3):
        xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fused_linear_cross_entropy(xc, wc, labels, chunk_size=chunk)
        loss.backward()
        results.append((loss.detach(), xc.grad, wc.grad))
    # Only the matmuls' blocking changes with the chunk: fp32 rounding-level differences (the
    # gradients here are ~0.1, so atol 1e-6 is ~10 ulp of fp32 at that scale).
    for loss, dx, dw in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=0)
        torch.testing.assert_close(dx, results[0][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dw, results[0][2], rtol=1e-5, atol=1e-6)


def test_upstream_gradient_scales_and_batch_shape_is_flattened():
    x, w, _, labels = lm_head_inputs(6, 16, 300, torch.float32)
    x3 = x.reshape(2, 3, 16).clone().requires_grad_()
    (fused_linear_cross_entropy(x3, w, labels.reshape(2, 3)) * 2.5).backward()
    x_ref = x.double().requires_grad_()
    (reference(x_ref, w.double(), None, labels) * 2.5).backward()
    assert x3.grad.shape == (2, 3, 16)
    assert_close_dtype(x3.grad.reshape(6, 16), x_ref.grad, torch.float32, n_reduce=300, name="dX")


def test_without_grad_returns_the_loss():
    x, w, _, labels = lm_head_inputs(3, 16, 300, torch.float32)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x.requires_grad_(), w, labels)
    assert not loss.requires_grad
    assert_close_dtype(loss, reference(x.double(), w.double(), None, labels), torch.float32, n_reduce=300)


def test_backward_twice_is_refused():
    x, w, _, labels = lm_head_inputs(2, 16, 100, torch.float32)
    loss = fused_linear_cross_entropy(x.requires_grad_(), w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()


def test_bad_arguments_are_named():
    x, w, _, labels = lm_head_inputs(3, 16, 100, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(x, w, labels, reduction="none")
    with pytest.raises(ValueError, match="shift"):
        fused_linear_cross_entropy(x, w, labels[:2])
    with pytest.raises(ValueError, match="hidden size"):
        fused_linear_cross_entropy(x[:, :8], w, labels)
    with pytest.raises(ValueError, match="total_tokens"):
        fused_linear_cross_entropy(x, w, labels, reduction="sum", total_tokens=4)


def test_chunk_rows_bounds_the_logits_chunk():
    rows = chunk_rows(16384, 128256, 2)
    chunk_bytes = rows * 128256 * 2
    assert rows & (rows - 1) == 0 and chunk_bytes <= 256 * 2**20 < 2 * chunk_bytes  # the largest that fits
    assert chunk_rows(3, 128256, 2) == 4  # never more than the batch needs (next power of two)


# Norm-wise bound of dX against fp32 math at the real shape (bf16 logits; see the test).
DX_FP32_RELATIVE = 2e-2


@real_shapes
def test_real_shape_on_gpu_memory_and_accuracy():
    # Llama-3 head, 16k tokens, frozen lm_head: extra memory beyond inputs and dX is one chunk of
    # bf16 logits (its gradient is written over it) plus per-row statistics (1 MiB covers them),
    # 0.245 GiB where the unfused path needs ~23.5 GiB; loss/dX match an fp32 reference.
    n, hidden, vocab = 16384, 4096, 128256
    x, w, _, labels = lm_head_inputs(n, hidden, vocab, torch.bfloat16, ignore=range(0, n, 7), device="cuda")
    x.requires_grad_()
    # Warm up first: Triton compilation and cuBLAS's workspace are one-time costs, not per call.
    fused_linear_cross_entropy(x[:64].detach().requires_grad_(), w, labels[:64]).backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(x, w, labels)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - x.grad.numel() * x.grad.element_size()
    one_chunk = chunk_rows(n, vocab, 2) * vocab * 2
    assert extra <= one_chunk + 2**20, f"extra memory {extra / 2**30:.3f} GiB, one chunk {one_chunk / 2**30:.3f} GiB"

    x_ref = x.detach().float().requires_grad_()
    expected = reference(x_ref, w.float(), None, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=2e-3, atol=0)
    # dX as a whole against fp32 math: the logits (and their gradient) are rounded to bf16 before
    # the dX GEMM, which moves single elements that cancel by far more than 2% of their size.
    relative = ((x.grad.float() - x_ref.grad).norm() / x_ref.grad.norm()).item()
    assert relative <= DX_FP32_RELATIVE, f"dX differs from fp32 math by {relative:.3g} (norm-wise)"
    del x_ref, expected
    # Element by element against the same rounding in the model's dtype, which is what HF's
    # eager head computes: bf16 logits, softmax in fp32, its gradient rounded to bf16 for dX.
    x_hf = x.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(x_hf, w).float(), labels, ignore_index=-100).backward()
    expected_dx = x_hf.grad.float()
    torch.testing.assert_close(x.grad.float(), expected_dx, rtol=2e-2, atol=2e-2 * expected_dx.abs().mean().item())
