"""RoPE kernel: rotated q, k and their gradients against float64 and HF's apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from reference import (
    DEVICE, UNIT_ROUNDOFF, assert_close_dtype, assert_compile_for_gpus, f64, needs_kernels, real_shapes,
    rope_ref, without_gpu,
)

from unsloth_kernels import apply_rope

pytestmark = needs_kernels
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MAX_POSITIONS = 64


def rope_tables(rot, dtype, device=DEVICE, n=MAX_POSITIONS, base=10000.0):
    """cos/sin (positions, rot) as HF's rotary embedding builds them: duplicated halves."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def qk(batch, n_q, n_kv, seq, head_dim, dtype, layout, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "hf":  # HF: (batch, seq, heads * head_dim) projection viewed and transposed
        q = torch.randn(batch, seq, n_q * head_dim, generator=g).view(batch, seq, n_q, head_dim).transpose(1, 2)
        k = torch.randn(batch, seq, n_kv * head_dim, generator=g).view(batch, seq, n_kv, head_dim).transpose(1, 2)
    else:
        q = torch.randn(batch, n_q, seq, head_dim, generator=g)
        k = torch.randn(batch, n_kv, seq, head_dim, generator=g)
    return q.to(dtype).to(device), k.to(dtype).to(device)


def check_against_float64(dtype, batch, n_q, n_kv, seq, head_dim, rot, cos_form, layout, device=DEVICE):
    q, k = qk(batch, n_q, n_kv, seq, head_dim, dtype, layout, device)
    cos_table, sin_table = rope_tables(rot, dtype, device, n=max(MAX_POSITIONS, seq))
    position_ids = None
    if cos_form == "position_ids":  # packed sequences: each row restarts its positions
        position_ids = torch.cat([torch.arange(seq // 2 + 1), torch.arange(seq - seq // 2 - 1)])
        position_ids = torch.stack([position_ids.roll(b) for b in range(batch)]).to(device)
        cos, sin = cos_table, sin_table
    elif cos_form == "batch":  # what HF's rotary embedding returns: (batch, seq, rot)
        cos, sin = cos_table[:seq].expand(batch, seq, rot), sin_table[:seq].expand(batch, seq, rot)
    else:  # a shared (seq, rot)
        cos, sin = cos_table[:seq], sin_table[:seq]
    qk_, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    oq, ok = apply_rope(qk_, kk, cos, sin, position_ids=position_ids)
    dq, dk = torch.randn_like(oq), torch.randn_like(ok)
    torch.autograd.backward([oq, ok], [dq, dk])
    qr, kr = f64(q, k)
    rq, rk = rope_ref(qr, kr, cos.double(), sin.double(), position_ids)
    torch.autograd.backward([rq, rk], [dq.double(), dk.double()])
    for actual, expected, name in [(oq, rq, "q"), (ok, rk, "k"), (qk_.grad, qr.grad, "dq"), (kk.grad, kr.grad, "dk")]:
        assert actual.dtype == dtype
        assert_close_dtype(actual, expected, dtype, name=name)


CASES = [
    # batch, q heads, kv heads, seq, head_dim, rotary dim, cos/sin form, q/k layout
    (2, 4, 2, 5, 16, 16, "batch", "contiguous"),
    (1, 3, 1, 7, 24, 24, "batch", "hf"),             # GQA, HF's transposed views, odd seq
    (2, 4, 4, 6, 20, 12, "seq", "hf"),               # partial rotary: 8 dims pass through
    (2, 4, 2, 9, 16, 16, "position_ids", "contiguous"),
    (1, 1, 1, 1, 8, 8, "seq", "contiguous"),         # a single token
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_float64(dtype, case):
    check_against_float64(dtype, *case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matches_hf_apply_rotary_pos_emb(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = qk(2, 4, 2, 7, 32, dtype, "hf")
    cos, sin = rope_tables(32, dtype)
    cos, sin = cos[:7].expand(2, 7, 32), sin[:7].expand(2, 7, 32)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    actual_q, actual_k = apply_rope(q.clone(), k.clone(), cos, sin)
    # HF rounds q*cos, rotate_half(q)*sin and their sum to the dtype; we round once, so they agree
    # to within the two extra roundings HF makes.
    for actual, expected in [(actual_q, expected_q), (actual_k, expected_k)]:
        torch.testing.assert_close(actual, expected, rtol=4 * UNIT_ROUNDOFF[dtype], atol=4 * UNIT_ROUNDOFF[dtype])


def test_without_autograd_q_and_k_are_rotated_in_place():
    q, k = qk(2, 4, 2, 5, 16, torch.float32, "hf")
    cos, sin = rope_tables(16, torch.float32)
    expected = rope_ref(q.double(), k.double(), cos[:5].double(), sin[:5].double())
    q_ptr = q.data_ptr()
    out_q, out_k = apply_rope(q, k, cos[:5], sin[:5])
    assert out_q is q and out_k is k and q.data_ptr() == q_ptr
    assert_close_dtype(q, expected[0], torch.float32, name="q")
    assert_close_dtype(k, expected[1], torch.float32, name="k")


def test_without_autograd_inplace_false_leaves_q_and_k_intact():
    q, k = qk(2, 4, 2, 5, 16, torch.float32, "hf")
    q0, k0 = q.clone(), k.clone()
    cos, sin = rope_tables(16, torch.float32)
    expected = rope_ref(q.double(), k.double(), cos[:5].double(), sin[:5].double())
    out_q, out_k = apply_rope(q, k, cos[:5], sin[:5], inplace=False)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert_close_dtype(out_q, expected[0], torch.float32, name="q")
    assert_close_dtype(out_k, expected[1], torch.float32, name="k")


def test_under_autograd_inputs_are_left_intact():
    q, k = qk(1, 2, 1, 3, 8, torch.float32, "contiguous")
    q0, k0 = q.clone(), k.clone()
    cos, sin = rope_tables(8, torch.float32)
    apply_rope(q.requires_grad_(), k.requires_grad_(), cos[:3], sin[:3])
    assert torch.equal(q.detach(), q0) and torch.equal(k.detach(), k0)


def test_bad_arguments_are_named():
    q, k = qk(1, 2, 1, 3, 8, torch.float32, "contiguous")
    cos, sin = rope_tables(8, torch.float32)
    with pytest.raises(ValueError, match="rotary dim"):
        apply_rope(q, k, cos[:3, :7], sin[:3, :7])
    with pytest.raises(ValueError, match=r"seq=3"):
        apply_rope(q, k, cos[:4], sin[:4])
    with pytest.raises(ValueError, match="differ in batch, seq or head_dim"):
        apply_rope(q, k[..., :4], cos[:3], sin[:3])
    with pytest.raises(ValueError, match="position_ids"):
        apply_rope(q, k, cos, sin, position_ids=torch.zeros(1, 5, dtype=torch.long, device=DEVICE))


def test_an_empty_sequence_is_a_no_op():
    q, k = qk(1, 2, 1, 0, 8, torch.float32, "contiguous")
    cos, sin = rope_tables(8, torch.float32)
    out_q, out_k = apply_rope(q, k, cos[:0], sin[:0])
    assert out_q.shape == q.shape and out_k.shape == k.shape


COMPILE_CASES = [  # Llama-3.1-8B heads (32 q, 8 kv, 128 wide); then a partial rotary, copied pass-through
    ("unsloth_kernels.rope", "_rope_kernel", dict(HALF=64, N_PASS=0, BLOCK_QH=32, BLOCK_KH=8, BLOCK_HALF=64,
                                                  BLOCK_PASS=1, HAS_POS=p, BACKWARD=b, COPY_PASS=False), 8)
    for p in (False, True) for b in (False, True)
] + [
    ("unsloth_kernels.rope", "_rope_kernel", dict(HALF=32, N_PASS=64, BLOCK_QH=32, BLOCK_KH=8, BLOCK_HALF=32,
                                                  BLOCK_PASS=64, HAS_POS=False, BACKWARD=False, COPY_PASS=True), 8)
]


@without_gpu
def test_kernels_compile_for_cuda_and_rocm_gpus():
    assert_compile_for_gpus(COMPILE_CASES)


@real_shapes
@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_real_shapes(dtype, layout):
    check_against_float64(dtype, 8, 32, 8, 2048, 128, 128, "batch", layout, device="cuda")
