"""Fused linear + cross-entropy: the LM-head loss without ever holding the full logits.

The (N, V) logits of a large vocabulary dwarf everything else in a fine-tuning step (16k tokens x
128k vocabulary is 4 GiB in bf16, and the unfused path also keeps fp32 copies and their gradient).
Here the tokens are processed in chunks; per chunk:

1. logits = x_chunk @ W^T (+ bias)             torch matmul (cuBLAS / hipBLAS), in the input dtype
2. one Triton program per row: online softmax over V in fp32, the row's loss, and the gradient of
   the row's loss w.r.t. its logits written back *into the logits buffer* (no second buffer)
3. dX_chunk = dlogits @ W                      straight into the dX output
4. dW += dlogits^T @ x_chunk, dbias += sum     only when the weight / bias are trainable

So the gradients are ready when forward returns; backward only scales them, in place, by
grad_output times the reduction's 1/count.
Peak extra memory is one chunk of logits (bounded by `_CHUNK_BYTES`) plus the gradients themselves.

Semantics match `torch.nn.functional.cross_entropy(F.linear(x, W, b), labels)`, with two optional
logit transforms applied before the softmax (gradients flow through both):
`logit_scale` multiplies the logits (Cohere, Granite) and `softcap` squashes them to
`softcap * tanh(logits / softcap)` (Gemma 2). Reduction "mean" divides by the number of labels
that are not `ignore_index`, or by `total_tokens` when given (HF Trainer's `num_items_in_batch`
under gradient accumulation). Unlike torch, a batch whose labels are all ignored gives loss 0 and
zero gradients instead of NaN: such batches happen with packing and must not poison the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import direct_launch
from ._utils import block_size_for, check_device, is_hip

# One chunk of logits (in the input dtype) stays under this; see `chunk_rows`. 256 MiB is 1024 rows
# at V = 128256 in bf16: faster than 512-row chunks (cuBLAS is slow on the 512-row products) for
# 0.25 GiB more (docs/benchmarks.md, "Tuned constants").
_CHUNK_BYTES = 256 * 1024 * 1024
# The per-row softmax program: vocabulary elements per loop step, and warps (32 warps over 16384
# elements stream a chunk faster than 8 over 8192: docs/benchmarks.md, "Tuned constants").
# ROCm's warps are 64 wide and a program holds at most 1024 threads, hence 8 there.
_MAX_BLOCK_V = 16384
_CE_WARPS = 8 if is_hip() else 32


@triton.jit
def _transform(logits, softcap, logit_scale, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """The logits the softmax sees, and d(them)/d(raw logits) (1 when untransformed)."""
    z = logits
    dz = tl.full(logits.shape, 1.0, tl.float32)
    if HAS_SCALE:
        z = z * logit_scale
        dz = dz * logit_scale
    if HAS_SOFTCAP:
        # tanh through exp (portable: no libdevice); exact at +-inf saturation.
        t = 1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0)
        z = softcap * t
        dz = dz * (1.0 - t * t)
    return z, dz


@direct_launch
@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,
    logits_stride,
    labels_ptr,
    loss_ptr,
    V,
    ignore_index,
    softcap,
    logit_scale,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per row: loss = logsumexp(z) - z[label]; logits row <- (softmax(z) - onehot) * dz.

    The gradient is stored unscaled (entries in [-1, 1]); the 1/count of the mean is applied to dX
    and dW at the end, so fp16 gradients of large batches do not underflow here.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)

    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if COMPUTE_GRAD:
            zero = tl.zeros([BLOCK_V], dtype=logits_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                tl.store(row_ptr + start + cols, zero, mask=start + cols < V)
    else:
        # Pass 1: running max and sum of exp over the row (online softmax), all in fp32.
        running_max = -float("inf")
        running_sum = 0.0
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            raw = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            z, _ = _transform(raw, softcap, logit_scale, HAS_SCALE, HAS_SOFTCAP)
            z = tl.where(mask, z, -float("inf"))
            new_max = tl.maximum(running_max, tl.max(z, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)

        target_raw = tl.load(row_ptr + label).to(tl.float32)
        target, _ = _transform(target_raw, softcap, logit_scale, HAS_SCALE, HAS_SOFTCAP)
        tl.store(loss_ptr + row, lse - target)

        # Pass 2: the gradient, written over the logits (the row is re-read, mostly from L2).
        if COMPUTE_GRAD:
            for start in range(0, V, BLOCK_V):
                mask = start + cols < V
                raw = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                z, dz = _transform(raw, softcap, logit_scale, HAS_SCALE, HAS_SOFTCAP)
                p = tl.exp(z - lse)
                p = tl.where(start + cols == label, p - 1.0, p)
                grad = p * dz
                tl.store(row_ptr + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def chunk_rows(n_rows: int, vocab: int, element_size: int) -> int:
    """Rows per chunk: a power of two whose logits fit in `_CHUNK_BYTES`, at least 16 rows."""
    rows = max(_CHUNK_BYTES // max(vocab * element_size, 1), 16)
    rows = 1 << (rows.bit_length() - 1)
    return max(1, min(rows, block_size_for(n_rows)))


def _fused_linear_cross_entropy_forward(
    hidden, weight, bias, labels, ignore_index, softcap, logit_scale, reduction, total_tokens, chunk_size, need_grads
):
    """Loss, the (dX, dW, dbias) of the summed loss (None where not wanted), and the loss's scale.

    The scale (1 for "sum", 1/count for "mean") stays a device tensor: no host sync to count labels.
    """
    n_rows, _ = hidden.shape
    vocab = weight.shape[0]
    need_dx, need_dw, need_db = need_grads
    compute_grad = need_dx or need_dw or need_db
    device = hidden.device

    if reduction == "sum":
        scale = torch.ones((), dtype=torch.float32, device=device)
    elif total_tokens is not None:
        scale = 1.0 / torch.as_tensor(total_tokens, dtype=torch.float32, device=device)
    else:
        scale = 1.0 / (labels != ignore_index).sum().to(torch.float32).clamp_min(1.0)

    rows = chunk_size or chunk_rows(n_rows, vocab, hidden.element_size())
    rows = max(1, min(rows, n_rows))
    logits_buffer = torch.empty(rows, vocab, dtype=hidden.dtype, device=device)
    losses = torch.empty(n_rows, dtype=torch.float32, device=device)
    grad_hidden = torch.empty_like(hidden) if need_dx else None
    grad_weight = torch.zeros_like(weight) if need_dw else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if need_db else None

    block_v = min(block_size_for(vocab), _MAX_BLOCK_V)
    weight_t = weight.t()
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        x = hidden[start:end]
        logits = logits_buffer[: end - start]
        if bias is None:
            torch.mm(x, weight_t, out=logits)
        else:
            torch.addmm(bias, x, weight_t, out=logits)
        _cross_entropy_rows_kernel[(end - start,)](
            logits, logits.stride(0), labels[start:end], losses[start:end],
            vocab, ignore_index, float(softcap or 0.0), float(logit_scale or 1.0),
            HAS_SCALE=logit_scale is not None, HAS_SOFTCAP=softcap is not None,
            COMPUTE_GRAD=compute_grad, BLOCK_V=block_v, num_warps=_CE_WARPS,
        )  # fmt: skip
        # `logits` now holds d(loss)/d(logits) for this chunk.
        if need_dx:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if need_dw:
            grad_weight.addmm_(logits.t(), x)
        if need_db:
            grad_bias += logits.sum(dim=0, dtype=torch.float32)

    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return losses.sum() * scale, grad_hidden, grad_weight, grad_bias, scale


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, softcap, logit_scale, reduction, total_tokens,
                chunk_size, grad_enabled):  # fmt: skip
        need = ctx.needs_input_grad
        need_grads = (grad_enabled and need[0], grad_enabled and need[1], grad_enabled and bias is not None and need[2])
        loss, grad_hidden, grad_weight, grad_bias, scale = _fused_linear_cross_entropy_forward(
            hidden, weight, bias, labels, ignore_index, softcap, logit_scale, reduction, total_tokens, chunk_size,
            need_grads,
        )  # fmt: skip
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, scale)
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.used:
            raise RuntimeError("fused_linear_cross_entropy: backward can run once per forward (no retain_graph)")
        ctx.used = True
        *grads, scale = ctx.saved_tensors
        factor = grad_output * scale
        # Scaling in place: the gradient buffers were made for this call and are used once.
        grad_hidden, grad_weight, grad_bias = (None if g is None else g.mul_(factor.to(g.dtype)) for g in grads)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float | None = None,
    reduction: str = "mean",
    total_tokens: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T (+ bias)` against `labels`, without materialising the logits.

    hidden: (N, H) or (B, T, H); labels: (N,) or (B, T), already shifted by the caller; weight: (V, H).
    reduction: "mean" (over non-ignored labels, or over `total_tokens` when given) or "sum".
    A frozen weight (requires_grad False, as in LoRA) costs no weight-gradient matmul.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if total_tokens is not None and reduction != "mean":
        raise ValueError("total_tokens divides the summed loss; use it with reduction='mean'")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the weight's {weight.shape[-1]}")
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1)
    if labels_1d.numel() != hidden_2d.shape[0]:
        raise ValueError(f"{labels_1d.numel()} labels for {hidden_2d.shape[0]} tokens; shift labels before calling")
    if labels.device != hidden.device or weight.device != hidden.device:
        raise ValueError(f"hidden ({hidden.device}), weight ({weight.device}) and labels ({labels.device}) "
                         "must be on one device")  # fmt: skip
    check_device(hidden, weight, labels, bias)
    # Autocast-style: compute in the weight's dtype; autograd casts dX back to hidden's dtype.
    hidden_2d = hidden_2d.to(weight.dtype).contiguous()
    return FusedLinearCrossEntropyFunction.apply(
        hidden_2d, weight, bias, labels_1d.contiguous(), ignore_index, softcap, logit_scale, reduction,
        total_tokens, chunk_size, torch.is_grad_enabled(),
    )  # fmt: skip
