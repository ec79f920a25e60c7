"""Rotary position embedding for q and k in one Triton launch (HF's rotate_half convention).

For the first R = cos.shape[-1] dims of each head (R < head_dim: partial rotary, the rest pass
through), with halves t1 = t[:R/2], t2 = t[R/2:R]:

    out1 = t1 * cos1 - t2 * sin1        out2 = t2 * cos2 + t1 * sin2

which is HF's `t * cos + rotate_half(t) * sin`. The backward is the transpose of that linear map:
the same kernel with (sin1, sin2) -> (-sin2, -sin1), i.e. rotation by -sin for HF's duplicated
cos/sin halves.

One program per (batch, position) handles every head of q and of k, so cos/sin are read once per
token. The kernel takes strides, so HF's (batch, heads, seq, head_dim) views of a
(batch, seq, heads * head_dim) projection are used as they are, with no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import direct_launch
from ._utils import block_size_for, check_device, num_warps_for


@triton.jit
def _rotate_heads(X, XO, x_base, xo_base, stride_h, stride_ho, n_heads, c1, c2, s1, s2,
                  HALF: tl.constexpr, N_PASS: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                  COPY_PASS: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (d < HALF)
    x_row = X + x_base + h * stride_h
    xo_row = XO + xo_base + h * stride_ho
    x1 = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(xo_row + d, (x1 * c1 - x2 * s1).to(XO.dtype.element_ty), mask=mask)
    tl.store(xo_row + HALF + d, (x2 * c2 + x1 * s2).to(XO.dtype.element_ty), mask=mask)
    if COPY_PASS:  # out of place: the dims past the rotary part are copied unchanged
        p = tl.arange(0, BLOCK_PASS)[None, :]
        pmask = (h < n_heads) & (p < N_PASS)
        tl.store(xo_row + 2 * HALF + p, tl.load(x_row + 2 * HALF + p, mask=pmask), mask=pmask)


@direct_launch
@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, POS,
    seq_len, n_q_heads, n_k_heads,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s,
    sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s,
    scos_b, scos_s, spos_b, spos_s,
    HALF: tl.constexpr, N_PASS: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, COPY_PASS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid % seq_len
    if HAS_POS:  # cos/sin are a table indexed by each token's position (packed sequences)
        cs = tl.load(POS + b * spos_b + s * spos_s).to(tl.int64) * scos_s
    else:
        cs = b * scos_b + s * scos_s
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = d < HALF
    c1 = tl.load(COS + cs + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the forward map
        s1, s2 = -s2, -s1
    _rotate_heads(Q, QO, b * sq_b + s * sq_s, b * sqo_b + s * sqo_s, sq_h, sqo_h, n_q_heads,
                  c1, c2, s1, s2, HALF, N_PASS, BLOCK_QH, BLOCK_HALF, BLOCK_PASS, COPY_PASS)
    _rotate_heads(K, KO, b * sk_b + s * sk_s, b * sko_b + s * sko_s, sk_h, sko_h, n_k_heads,
                  c1, c2, s1, s2, HALF, N_PASS, BLOCK_KH, BLOCK_HALF, BLOCK_PASS, COPY_PASS)


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_launch(q, k, q_out, k_out, cos, sin, position_ids, backward: bool) -> None:
    """Rotate q, k into q_out, k_out (which may be q, k themselves). cos/sin: (B|1, S|P, R)."""
    batch, n_q_heads, seq_len, head_dim = q.shape
    n_k_heads = k.shape[1]
    rot = cos.shape[-1]
    n_pass = head_dim - rot
    copy_pass = n_pass > 0 and q_out.data_ptr() != q.data_ptr()
    if position_ids is not None:
        pos = position_ids.expand(batch, seq_len)
        spos = (pos.stride(0), pos.stride(1))
        scos = (0, cos.stride(-2))
    else:
        pos = cos  # unused
        spos = (0, 0)
        scos = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1))
    block_qh, block_kh = block_size_for(n_q_heads), block_size_for(n_k_heads)
    block_half = block_size_for(rot // 2)
    _rope_kernel[(batch * seq_len,)](
        q, k, q_out, k_out, cos, sin, pos,
        seq_len, n_q_heads, n_k_heads,
        *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3],
        *scos, *spos,
        HALF=rot // 2, N_PASS=n_pass,
        BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half, BLOCK_PASS=block_size_for(n_pass),
        HAS_POS=position_ids is not None, BACKWARD=backward, COPY_PASS=copy_pass,
        num_warps=num_warps_for(2 * (block_qh + block_kh) * block_half),
    )


def _rotated(q, k, cos, sin, position_ids):
    """q and k rotated into new tensors."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rope_launch(q, k, q_out, k_out, cos, sin, position_ids, backward=False)
    return q_out, k_out


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids):
        ctx.save_for_backward(cos, sin, position_ids)
        return _rotated(q, k, cos, sin, position_ids)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        dq, dk = _last_dim_unit(dq), _last_dim_unit(dk)
        dq_in, dk_in = torch.empty_like(dq), torch.empty_like(dk)
        rope_launch(dq, dk, dq_in, dk_in, cos, sin, position_ids, backward=True)
        return dq_in, dk_in, None, None, None


def _check_rope_args(q, k, cos, sin, position_ids):
    # Shapes compared as tuples of ints: comparing torch.Size objects is slower, and this runs
    # on every call, where host time is the step time for an op this fast.
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be (batch, heads, seq, head_dim); got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or tuple(q.shape[2:]) != tuple(k.shape[2:]):
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, seq or head_dim")
    if q.dtype != k.dtype:
        raise ValueError(f"apply_rope: q dtype {q.dtype} != k dtype {k.dtype}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    batch, _, seq_len, head_dim = q.shape
    rot = cos.shape[-1]
    if rot % 2 or rot > head_dim or rot == 0:
        raise ValueError(f"apply_rope: rotary dim {rot} (cos.shape[-1]) must be even and at most head_dim {head_dim}")
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[1] != seq_len or position_ids.shape[0] not in (1, batch):
            raise ValueError(f"apply_rope: position_ids must be (batch or 1, seq={seq_len}); got {tuple(position_ids.shape)}")
        if cos.dim() != 2 and not (cos.dim() == 3 and cos.shape[0] == 1):
            raise ValueError(f"apply_rope: with position_ids, cos/sin are a (positions, rot) table; got {tuple(cos.shape)}")
    elif cos.shape[-2] != seq_len or not (cos.dim() == 2 or (cos.dim() == 3 and cos.shape[0] in (1, batch))):
        raise ValueError(f"apply_rope: cos/sin must be (batch or 1, seq={seq_len}, rot) or (seq, rot); got {tuple(cos.shape)}")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               position_ids: torch.Tensor | None = None, inplace: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (batch, n_heads, seq, head_dim) and k (batch, n_kv_heads, seq, head_dim); returns (q, k).

    cos/sin as HF's rotary embedding returns them, (batch, seq, rot) or (seq, rot); with
    `position_ids` (batch, seq) they are a (positions, rot) table looked up per token.

    Without autograd (inference, or no input needing grad) q and k are rotated in place and
    returned, unless `inplace=False` (someone else still reads them). Under autograd the result
    goes to new tensors: the traffic is the same, and rotating HF's transposed views in place
    would make autograd copy them again in backward.
    """
    _check_rope_args(q, k, cos, sin, position_ids)
    check_device(q, k, cos, sin, position_ids)
    if cos.dim() == 2:  # -> (B|1, S|P, rot)
        cos, sin = cos[None], sin[None]
    cos, sin = _last_dim_unit(cos), _last_dim_unit(sin)
    if sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if position_ids is not None:
        cos, sin = cos[0], sin[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return RoPEFunction.apply(_last_dim_unit(q), _last_dim_unit(k), cos, sin, position_ids)
    if not inplace:
        return _rotated(_last_dim_unit(q), _last_dim_unit(k), cos, sin, position_ids)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("apply_rope: in-place rotation needs q and k with unit stride in head_dim")
    rope_launch(q, k, q, k, cos, sin, position_ids, backward=False)
    return q, k
