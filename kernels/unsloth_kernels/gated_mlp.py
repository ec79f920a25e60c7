"""The gated MLP of full fine-tuning, down(act(gate(x)) * up(x)), with its dense weights trained.

Autograd through the module keeps gate(x), up(x) and h = act(gate(x)) * up(x) for the backward
pass: three (tokens x intermediate) buffers per layer, and with their gradients the largest
tensors of a layer's backward. This Function keeps gate(x) and up(x) only; backward recomputes h
in the activation kernel over dh, as the LoRA MLP does (lora.py).

Inside our checkpoint's recompute, where the MLP's output only joins the residual stream and is
never read (`output_needed=False`), forward computes nothing and keeps x. Backward then recomputes
gate(x) and up(x) a chunk of tokens at a time: the down projection's forward, a third of the MLP's
matmuls, never runs again, and each (tokens x intermediate) buffer stays within `CHUNK_BYTES`.
Weight gradients are summed over the chunks in the compute dtype (each chunk's matmul accumulates
in fp32), then returned in the weights' dtype.
"""

from __future__ import annotations

import torch

from .activations import ACT_CODES
from .lora import _flat, _gated_backward_, _gated_forward, _mlp_chunk_rows, _no_autocast


# Per (rows x intermediate) buffer of the chunked backward, where three of them (gate, up, dh) are the
# largest tensors alive at a full fine-tuning step's peak: half the LoRA MLP's, whose step keeps no
# weight gradients beside them.
CHUNK_BYTES = 64 * 1024 * 1024


class _DenseGatedMLP(torch.autograd.Function):
    @staticmethod
    @_no_autocast
    def forward(ctx, x, w_gate, w_up, w_down, activation, output_needed):
        ctx.activation, ctx.used = activation, False
        dtype = x.dtype
        if not output_needed:
            ctx.save_for_backward(x, w_gate, w_up, w_down)
            # A stand-in of the right shape that costs no memory: nothing reads its values.
            return x.new_zeros(()).expand(x.shape[0], w_down.shape[0])
        e, g = x @ w_gate.to(dtype).t(), x @ w_up.to(dtype).t()
        out = _gated_forward(e, g, activation) @ w_down.to(dtype).t()
        ctx.save_for_backward(x, w_gate, w_up, w_down, e, g)
        return out

    @staticmethod
    @_no_autocast
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError("dense_gated_mlp: backward overwrites its saved buffers and can run only once "
                               "(no retain_graph)")  # fmt: skip
        ctx.used = True
        x, w_gate, w_up, w_down, *saved = ctx.saved_tensors
        dtype = x.dtype
        dy = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        need_x, *need_w = ctx.needs_input_grad[:4]
        wg, wu, wd = (w.to(dtype) for w in (w_gate, w_up, w_down))
        rows = x.shape[0] if saved else _mlp_chunk_rows(x.shape[0], wg.shape[0], x.element_size(), CHUNK_BYTES)
        grad_x = torch.empty_like(x) if need_x else None
        grads = [None, None, None]  # gate, up, down
        for start in range(0, x.shape[0], rows):
            chunk = slice(start, start + rows)
            xc, dyc = x[chunk], dy[chunk]
            e, g = saved if saved else (xc @ wg.t(), xc @ wu.t())
            dh = dyc @ wd
            _gated_backward_(e, g, dh, ctx.activation)  # now dh holds h, e holds d(gate), g holds d(up)
            for i, (need, a, b) in enumerate(((need_w[0], e, xc), (need_w[1], g, xc), (need_w[2], dyc, dh))):
                if need:
                    grads[i] = a.t() @ b if grads[i] is None else grads[i].addmm_(a.t(), b)
            del dh, a, b  # b is h: the next chunk's buffers would otherwise come on top of it
            if grad_x is not None:
                torch.mm(e, wg, out=grad_x[chunk])
                grad_x[chunk].addmm_(g, wu)
            del e, g
        grads = [None if d is None else d.to(w.dtype) for d, w in zip(grads, (w_gate, w_up, w_down))]
        return grad_x, *grads, None, None


def dense_gated_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                    activation: str = "swiglu", *, output_needed: bool = True) -> torch.Tensor:
    """down(act(x w_gate^T) * (x w_up^T)) for bias-free dense weights (out, in), any of them trainable.

    In the autocast dtype when autocast is on (as nn.Linear would compute). `output_needed=False` is
    for a recompute pass whose caller never reads the output (only its gradient flows back): the
    result is then a zero stand-in and backward recomputes what it needs, in chunks of tokens.
    """
    if activation not in ACT_CODES:
        raise ValueError(f"activation must be one of {tuple(ACT_CODES)}, got {activation!r}")
    inter, hidden = w_gate.shape
    if w_up.shape != (inter, hidden) or w_down.shape != (hidden, inter) or x.shape[-1] != hidden:
        raise ValueError(f"dense_gated_mlp: gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} must be "
                         f"(intermediate, {x.shape[-1]}) and down {tuple(w_down.shape)} their transpose")  # fmt: skip
    out = _DenseGatedMLP.apply(_flat(x), w_gate, w_up, w_down, activation, output_needed)
    return out.reshape(*x.shape[:-1], w_down.shape[0])
