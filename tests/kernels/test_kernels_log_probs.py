"""Fused linear + log-softmax gather against a float64 PyTorch reference (values and every gradient).

Tolerances as in test_kernels_cross_entropy.py (reference.py's rule, LOGIT_FACTOR for the rounding
of logits of size ~3 to the input dtype). The upstream gradient is a random vector, as in DPO,
where chosen and rejected rows get opposite signs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import DEVICE, assert_close_dtype, f64, lm_head_inputs, needs_kernels

from unsloth_kernels.log_probs import fused_linear_log_probs

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LOGIT_FACTOR = 4


def make_inputs(n, hidden, vocab, dtype, *, seed=0, ignore=(), bias=False, device=DEVICE):
    """The loss kernels' inputs, and an upstream gradient per row."""
    x, w, b, labels = lm_head_inputs(n, hidden, vocab, dtype, seed=seed, ignore=ignore, bias=bias, device=device)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return x, w, b, labels, upstream


def reference(x, w, b, labels, *, softcap=None, logit_scale=None):
    """(log_probs, entropy, mean_logits, is_top1) from the full logits, as TRL defines them."""
    z = F.linear(x, w, b)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = labels != -100
    logsm = z.log_softmax(-1)
    logp = logsm.gather(1, labels.clamp(min=0)[:, None])[:, 0] * valid
    entropy = -(logsm.exp() * logsm).sum(-1) * valid
    return logp, entropy, z.mean(-1) * valid, (z.argmax(-1) == labels) & valid


def run_both(x, w, b, labels, upstream, *, train_weight, use_triton=None, **kwargs):
    x_ref, w_ref = f64(x, w)
    b_ref = f64(b) if b is not None else None
    x_ref.requires_grad_()
    w_ref.requires_grad_(train_weight)
    if b_ref is not None:
        b_ref.requires_grad_()
    expected = reference(x_ref, w_ref, b_ref, labels, **kwargs)
    (expected[0] * upstream.double()).sum().backward()

    x, w = x.clone().requires_grad_(), w.clone().requires_grad_(train_weight)
    if b is not None:
        b = b.clone().requires_grad_()
    actual = fused_linear_log_probs(x, w, labels, bias=b, use_triton=use_triton, **kwargs)
    (actual[0] * upstream).sum().backward()
    return (actual, x, w, b), (expected, x_ref, w_ref, b_ref)


CASES = {
    "llama3": dict(vocab=128256),
    "softcap": dict(vocab=151936, softcap=5.0),
    "softcap-and-scale": dict(vocab=1000, softcap=2.0, logit_scale=1.5),
    "bias-trainable-head": dict(vocab=1000, bias=True, train_weight=True),
}


def check(case, dtype, use_triton):
    spec = dict(CASES[case])
    vocab, bias, train_weight = spec.pop("vocab"), spec.pop("bias", False), spec.pop("train_weight", False)
    x, w, b, labels, upstream = make_inputs(3, 24, vocab, dtype, ignore=(1,), bias=bias)
    (out, x, w, b), (ref, x_ref, w_ref, b_ref) = run_both(x, w, b, labels, upstream, train_weight=train_weight,
                                                          use_triton=use_triton, **spec)
    logp, entropy, mean, top1 = out
    assert logp.dtype == entropy.dtype == mean.dtype == torch.float32 and top1.dtype == torch.bool
    for name, got, want in (("log_probs", logp, ref[0]), ("entropy", entropy, ref[1]), ("mean", mean, ref[2])):
        assert_close_dtype(got, want, dtype, n_reduce=vocab, name=name, factor=LOGIT_FACTOR)
    assert torch.equal(top1.cpu(), ref[3].cpu())
    assert not entropy.requires_grad and not mean.requires_grad
    assert_close_dtype(x.grad, x_ref.grad, dtype, n_reduce=vocab, name="dX", factor=LOGIT_FACTOR)
    assert not x.grad[1].any()  # the ignored token
    if train_weight:
        assert_close_dtype(w.grad, w_ref.grad, dtype, n_reduce=3, name="dW", factor=LOGIT_FACTOR)
    else:
        assert w.grad is None
    if b is not None:
        assert_close_dtype(b.grad, b_ref.grad, dtype, n_reduce=3, name="dbias", factor=LOGIT_FACTOR)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_kernel_matches_float64_reference(case, dtype):
    check(case, dtype, use_triton=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_torch_fallback_matches_float64_reference(case, dtype):
    check(case, dtype, use_triton=False)


@pytest.mark.parametrize("use_triton", [pytest.param(True, marks=needs_kernels), False], ids=["triton", "torch"])
def test_chunking_and_top1_of_a_label_that_is_the_argmax(use_triton):
    x, w, _, labels, upstream = make_inputs(7, 16, 300, torch.float32)
    labels[2] = F.linear(x[2], w).argmax()
    results = []
    for chunk in (None, 1, 3):
        xc = x.clone().requires_grad_()
        logp, _, _, top1 = fused_linear_log_probs(xc, w, labels, chunk_size=chunk, use_triton=use_triton)
        (logp * upstream).sum().backward()
        assert top1[2]
        results.append((logp.detach(), xc.grad))
    for logp, dx in results[1:]:
        torch.testing.assert_close(logp, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx, results[0][1], rtol=1e-5, atol=1e-6)


def test_without_grad_and_empty_input():
    x, w, _, labels, _ = make_inputs(3, 16, 300, torch.float32)
    with torch.no_grad():
        logp = fused_linear_log_probs(x.requires_grad_(), w, labels, use_triton=False)[0]
    assert not logp.requires_grad
    empty = torch.zeros(0, 16, device=x.device, requires_grad=True)
    logp = fused_linear_log_probs(empty, w, labels[:0], use_triton=False)[0]
    logp.sum().backward()
    assert logp.shape == (0,) and empty.grad.shape == (0, 16)


def test_bad_arguments_are_named():
    x, w, _, labels, _ = make_inputs(3, 16, 100, torch.float32)
    with pytest.raises(ValueError, match="shift"):
        fused_linear_log_probs(x, w, labels[:2])
    with pytest.raises(ValueError, match="hidden must be"):
        fused_linear_log_probs(x[:, :8], w, labels)
    with pytest.raises(ValueError, match="softcap"):
        fused_linear_log_probs(x, w, labels, softcap=0.0)
