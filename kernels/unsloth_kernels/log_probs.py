"""Fused linear + log-softmax gather: per-token log-probabilities of the labels, never the full logits.

Preference training (DPO, KTO, ORPO, SimPO) needs log p(label) of every completion token, of the
policy and of the reference. Computed the plain way, `log_softmax(hidden @ W^T)` holds the
(tokens x vocab) logits and their fp32 softmax: 2 x 1024 x 2 tokens at a 128k vocabulary is
2 GiB in bf16 and 4 GiB more in fp32. Here the tokens go through the LM head in chunks, the
sibling of `cross_entropy.py`; per chunk:

1. logits = x_chunk @ W^T (+ bias)               torch matmul, in the input dtype
2. one program per row: an online softmax over V in fp32 that gives log p(label), the entropy,
   the mean logit and whether the label is the top token; and, when the gradient is wanted now,
   d log p(label) / d logits = (onehot - softmax) * dz written back over the logits
3. with a frozen head (LoRA): dX_unit = dlogits @ W straight into a buffer of hidden's size

Unlike a loss, log p is a vector whose upstream gradient is only known in backward. With a frozen
head the gradient is linear in it per row, so forward stores dX_unit and backward scales its rows:
no second matmul. With a trainable head (full fine-tuning) backward recomputes each chunk's
logits, as dW needs the per-row scale inside the sum.

The entropy, mean logit and top-1 flag are statistics (no gradient), as TRL's trainers log them.
Logit transforms as in `cross_entropy.py`: `logit_scale` multiplies, `softcap` squashes to
`softcap * tanh(z / softcap)`. Rows whose label is `ignore_index` give 0 everywhere. Off the GPU
(and without TRITON_INTERPRET=1) the row step runs in torch, chunked the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import direct_launch
from ._utils import INTERPRET, block_size_for
from .cross_entropy import _CE_WARPS, _MAX_BLOCK_V, _transform, chunk_rows


@direct_launch
@triton.jit
def _log_prob_rows_kernel(
    logits_ptr,
    logits_stride,
    labels_ptr,
    logp_ptr,
    entropy_ptr,
    mean_ptr,
    top1_ptr,
    V,
    ignore_index,
    softcap,
    logit_scale,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per row: log p(label), entropy, mean logit, label == argmax; logits row <- (onehot - p) * dz."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)

    if label == ignore_index:
        tl.store(logp_ptr + row, 0.0)
        tl.store(entropy_ptr + row, 0.0)
        tl.store(mean_ptr + row, 0.0)
        tl.store(top1_ptr + row, 0)
        if COMPUTE_GRAD:
            zero = tl.zeros([BLOCK_V], dtype=logits_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                tl.store(row_ptr + start + cols, zero, mask=start + cols < V)
    else:
        # One pass, all in fp32: running max m, sum of exp(z - m), sum of exp(z - m) * z, sum of z.
        running_max = -float("inf")
        running_sum = 0.0
        running_dot = 0.0
        logit_sum = 0.0
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            raw = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            z, _ = _transform(raw, softcap, logit_scale, HAS_SCALE, HAS_SOFTCAP)
            z_or_zero = tl.where(mask, z, 0.0)
            z = tl.where(mask, z, -float("inf"))
            new_max = tl.maximum(running_max, tl.max(z, axis=0))
            rescale = tl.exp(running_max - new_max)
            e = tl.exp(z - new_max)
            running_sum = running_sum * rescale + tl.sum(e, axis=0)
            running_dot = running_dot * rescale + tl.sum(e * z_or_zero, axis=0)
            logit_sum += tl.sum(z_or_zero, axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)

        target_raw = tl.load(row_ptr + label).to(tl.float32)
        target, _ = _transform(target_raw, softcap, logit_scale, HAS_SCALE, HAS_SOFTCAP)
        tl.store(logp_ptr + row, target - lse)
        tl.store(entropy_ptr + row, lse - running_dot / running_sum)  # H = lse - E_p[z]
        tl.store(mean_ptr + row, logit_sum / V)
        tl.store(top1_ptr + row, (target >= running_max).to(tl.int8))

        if COMPUTE_GRAD:
            for start in range(0, V, BLOCK_V):
                mask = start + cols < V
                raw = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                z, dz = _transform(raw, softcap, logit_scale, HAS_SCALE, HAS_SOFTCAP)
                p = tl.exp(z - lse)
                g = tl.where(start + cols == label, 1.0 - p, -p) * dz
                tl.store(row_ptr + start + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _rows_triton(logits, labels, out, ignore_index, softcap, logit_scale, compute_grad):
    vocab = logits.shape[1]
    logp, entropy, mean, top1 = out
    _log_prob_rows_kernel[(logits.shape[0],)](
        logits, logits.stride(0), labels, logp, entropy, mean, top1,
        vocab, ignore_index, float(softcap or 0.0), float(logit_scale or 1.0),
        HAS_SCALE=logit_scale is not None, HAS_SOFTCAP=softcap is not None,
        COMPUTE_GRAD=compute_grad, BLOCK_V=min(block_size_for(vocab), _MAX_BLOCK_V), num_warps=_CE_WARPS,
    )  # fmt: skip


def _rows_torch(logits, labels, out, ignore_index, softcap, logit_scale, compute_grad):
    """The row step in torch (a CPU without the interpreter): the same results, fp32 per chunk."""
    z = logits.float()
    dz = None
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = softcap * t
        dz = (1.0 - t * t) * (logit_scale if logit_scale is not None else 1.0)
    elif logit_scale is not None:
        dz = logit_scale
    valid = labels != ignore_index
    safe = labels.clamp(min=0).unsqueeze(1)
    lse = torch.logsumexp(z, dim=1)
    p = torch.exp(z - lse.unsqueeze(1))
    target = z.gather(1, safe).squeeze(1)
    logp, entropy, mean, top1 = out
    logp.copy_(torch.where(valid, target - lse, 0.0))
    entropy.copy_(torch.where(valid, lse - (p * z).sum(1), 0.0))
    mean.copy_(torch.where(valid, z.mean(1), 0.0))
    top1.copy_(valid & (target >= z.max(1).values))
    if compute_grad:
        g = (-p).scatter_add_(1, safe, torch.ones_like(target).unsqueeze(1))
        if dz is not None:
            g = g * dz
        logits.copy_(g.masked_fill_(~valid.unsqueeze(1), 0.0))


def _chunks(hidden, weight, bias, labels, rows, step):
    """For each chunk of rows: its logits (one reused buffer), then `step(start, end, x, logits)`."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    buffer = torch.empty(rows, vocab, dtype=hidden.dtype, device=hidden.device)
    weight_t = weight.t()
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        x, logits = hidden[start:end], buffer[: end - start]
        if bias is None:
            torch.mm(x, weight_t, out=logits)
        else:
            torch.addmm(bias, x, weight_t, out=logits)
        step(start, end, x, logits)


class FusedLinearLogProbsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, softcap, logit_scale, chunk_size, use_triton,
                grad_enabled):  # fmt: skip
        need = ctx.needs_input_grad
        need_dx = grad_enabled and need[0]
        need_dw = grad_enabled and (need[1] or (bias is not None and need[2]))
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        rows = max(1, min(chunk_size or chunk_rows(n_rows, vocab, hidden.element_size()), max(n_rows, 1)))
        device = hidden.device
        out = (torch.empty(n_rows, dtype=torch.float32, device=device),
               torch.empty(n_rows, dtype=torch.float32, device=device),
               torch.empty(n_rows, dtype=torch.float32, device=device),
               torch.empty(n_rows, dtype=torch.int8 if use_triton else torch.bool, device=device))
        rows_step = _rows_triton if use_triton else _rows_torch
        # A frozen head: the gradient w.r.t. hidden is ready now, up to each row's upstream scale.
        eager = need_dx and not need_dw
        unit_dx = torch.empty_like(hidden) if eager else None

        def step(start, end, x, logits):
            part = tuple(o[start:end] for o in out)
            rows_step(logits, labels[start:end], part, ignore_index, softcap, logit_scale, eager)
            if eager:
                torch.mm(logits, weight, out=unit_dx[start:end])

        if n_rows:
            _chunks(hidden, weight, bias, labels, rows, step)
        logp, entropy, mean, top1 = out
        ctx.mark_non_differentiable(entropy, mean, top1)
        ctx.settings = (ignore_index, softcap, logit_scale, rows, rows_step, need_dx, need_dw)
        ctx.eager = eager
        if eager:
            ctx.save_for_backward(unit_dx)
        elif need_dx or need_dw:
            ctx.save_for_backward(hidden, weight, bias, labels)
        return logp, entropy, mean, top1.bool()

    @staticmethod
    def backward(ctx, grad_logp, *_stats):
        ignore_index, softcap, logit_scale, rows, rows_step, need_dx, need_dw = ctx.settings
        if ctx.eager:
            (unit_dx,) = ctx.saved_tensors
            grad_hidden = unit_dx * grad_logp.unsqueeze(1).to(unit_dx.dtype)
            return grad_hidden, None, None, None, None, None, None, None, None, None
        hidden, weight, bias, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if need_dx else None
        grad_weight = torch.zeros_like(weight) if need_dw and ctx.needs_input_grad[1] else None
        grad_bias = (torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
                     if bias is not None and ctx.needs_input_grad[2] else None)
        scratch = tuple(torch.empty(rows, dtype=dtype, device=hidden.device)
                        for dtype in (torch.float32, torch.float32, torch.float32,
                                      torch.int8 if rows_step is _rows_triton else torch.bool))

        def step(start, end, x, logits):
            part = tuple(s[: end - start] for s in scratch)
            rows_step(logits, labels[start:end], part, ignore_index, softcap, logit_scale, True)
            logits.mul_(grad_logp[start:end].unsqueeze(1).to(logits.dtype))
            if grad_hidden is not None:
                torch.mm(logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight.addmm_(logits.t(), x)
            if grad_bias is not None:
                grad_bias.add_(logits.sum(dim=0, dtype=torch.float32))

        if hidden.shape[0]:
            _chunks(hidden, weight, bias, labels, rows, step)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def fused_linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float | None = None,
    chunk_size: int | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T (+ bias))[label] per token, without materialising the logits.

    hidden: (N, H); labels: (N,), already shifted by the caller; weight: (V, H).
    Returns (log_probs, entropy, mean_logits, is_top1), each (N,): fp32, fp32, fp32, bool. Only
    log_probs carries a gradient. `use_triton`: None picks the Triton kernel on a GPU (or under
    TRITON_INTERPRET=1) and torch elsewhere.
    """
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if hidden.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden must be (tokens, {weight.shape[-1]}), got {tuple(hidden.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"{labels.numel()} labels for {hidden.shape[0]} tokens; shift labels before calling")
    if labels.device != hidden.device or weight.device != hidden.device:
        raise ValueError(f"hidden ({hidden.device}), weight ({weight.device}) and labels ({labels.device}) "
                         "must be on one device")  # fmt: skip
    if use_triton is None:
        use_triton = INTERPRET or not hidden.is_cpu
    hidden = hidden.to(weight.dtype).contiguous()  # autocast-style; autograd casts dX back
    return FusedLinearLogProbsFunction.apply(
        hidden, weight, bias, labels.contiguous(), ignore_index, softcap, logit_scale, chunk_size, use_triton,
        torch.is_grad_enabled(),
    )
