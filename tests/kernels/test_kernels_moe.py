"""MoE experts as grouped GEMMs (unsloth_kernels.moe) against a float64 per-pair reference.

Every (token, expert) pair is computed on its own in float64 from the same low-precision inputs
(gathered expert weights, no sorting, no grouping), so the kernels' sort, tile-to-expert mapping,
gathers and per-expert sums are all checked by the comparison. Loads are uneven on purpose: one
expert takes most pairs, some take none.

Tolerances: a result passes through about as many roundings to the dtype as the LoRA MLP's
(gate/up, h, dh, d(gate/up), the LoRA factors x A^T and s dY B), hence the same chain factor 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import DEVICE, assert_close_dtype, f64, needs_kernels, without_gpu

from unsloth_kernels.moe import ExpertWeights, grouped_mm, moe_experts, route

pytestmark = needs_kernels
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CHAIN_FACTOR = 4


def uneven_routing(tokens, experts, k, seed=0):
    """top-k expert ids (distinct per token) skewed towards expert 0, with the last two experts unused
    whenever k leaves room for that; and positive weights summing to 1."""
    g = torch.Generator().manual_seed(seed)
    used = max(k, experts - 2)
    logits = torch.randn(tokens, used, generator=g)
    logits[:, 0] += 2.0
    index = logits.topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return index.to(DEVICE), weights


def make_experts(experts, out, inp, dtype, *, rank, transposed=False, bias=False, seed=0, trainable=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, out, inp, generator=g) / inp**0.5
    if transposed:
        w = w.transpose(1, 2).contiguous()
    w = w.to(DEVICE, dtype).requires_grad_(trainable)
    A = B = None
    if rank:
        # peft's target_parameters storage: A (E r, in) and B (out, r E), seen as (E, r, in) and (E, out, r)
        A = (torch.randn(experts * rank, inp, generator=g) / inp**0.5).to(DEVICE, dtype).requires_grad_()
        B = (torch.randn(out, rank * experts, generator=g) / rank**0.5).to(DEVICE, dtype).requires_grad_()
    b = (torch.randn(experts, out, generator=g) * 0.1).to(DEVICE, dtype).requires_grad_() if bias else None
    return w, A, B, b


def views(w, A, B, b, *, rank, scaling, transposed=False):
    experts = w.shape[0]
    a = b_ = None
    if rank:
        a = A.view(experts, rank, -1)
        b_ = B.view(B.shape[0], rank, experts).permute(2, 0, 1)
    return ExpertWeights(w, a, b_, scaling, b, transposed=transposed)


def ref_act(gu, activation, layout, alpha=1.702, limit=7.0):
    gate, up = (gu[..., ::2], gu[..., 1::2]) if layout == "interleaved" else gu.chunk(2, dim=-1)
    if activation == "gpt_oss":
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)
    fn = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    return fn(gate) * up


def ref_projection(x, p: ExpertWeights, e):
    """x (pairs, in) through each pair's expert e (pairs,) in float64."""
    w = p.weight[e]
    y = torch.einsum("pi,pio->po", x, w) if p.transposed else torch.einsum("pi,poi->po", x, w)
    if p.bias is not None:
        y = y + p.bias[e]
    if p.A is not None:
        xa = torch.einsum("pi,pri->pr", x, p.A[e])
        y = y + p.scaling * torch.einsum("pr,por->po", xa, p.B[e])
    return y


def ref_moe(x, index, weights, gate_up, down, activation, layout):
    tokens, k = index.shape
    e = index.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)
    h = ref_act(ref_projection(xs, gate_up, e), activation, layout)
    y = ref_projection(h, down, e)
    return (y.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)


def run_case(dtype, *, tokens=12, hidden=24, inter=20, experts=6, k=2, rank=4, activation="swiglu",
             layout="concatenated", transposed=False, bias=False, trainable=False, impl="triton", seed=0):
    torch.manual_seed(seed)
    index, weights = uneven_routing(tokens, experts, k, seed)
    weights = weights.to(DEVICE, dtype).requires_grad_()
    x = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE).requires_grad_()
    up_parts = make_experts(experts, 2 * inter, hidden, dtype, rank=rank, transposed=transposed, bias=bias,
                            seed=seed + 1, trainable=trainable)
    down_parts = make_experts(experts, hidden, inter, dtype, rank=rank, transposed=transposed, bias=bias,
                              seed=seed + 2, trainable=trainable)
    gate_up = views(*up_parts, rank=rank, scaling=2.0, transposed=transposed)
    down = views(*down_parts, rank=rank, scaling=0.5, transposed=transposed)
    out = moe_experts(x, index, weights, gate_up, down, activation=activation, layout=layout, impl=impl)
    dout = torch.randn_like(out)
    out.backward(dout)

    ref_leaves = [f64(t) for t in (x, weights, *up_parts, *down_parts)]
    x64, w64, *leaves64 = ref_leaves
    ref_up = views(*leaves64[:4], rank=rank, scaling=2.0, transposed=transposed)
    ref_down = views(*leaves64[4:], rank=rank, scaling=0.5, transposed=transposed)
    expected = ref_moe(x64, index, w64, ref_up, ref_down, activation, layout)
    expected.backward(dout.double())

    n = max(hidden, inter)
    assert_close_dtype(out, expected, dtype, n_reduce=n, name="out", factor=CHAIN_FACTOR)
    assert_close_dtype(x.grad, x64.grad, dtype, n_reduce=2 * n, name="dX", factor=CHAIN_FACTOR)
    assert_close_dtype(weights.grad, w64.grad, dtype, n_reduce=n, name="d(weights)", factor=CHAIN_FACTOR)
    # Per expert: each expert's gradient is its own sum, at its own scale (the rms floor is per expert).
    used = torch.bincount(index.reshape(-1).cpu(), minlength=experts)
    names = ["gate_up.W", "gate_up.A", "gate_up.B", "gate_up.bias", "down.W", "down.A", "down.B", "down.bias"]
    for name, leaf, ref in zip(names, (*up_parts, *down_parts), leaves64):
        if leaf is None or not leaf.requires_grad:
            continue
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, name
        actual, wanted = by_expert(name, leaf.grad, experts), by_expert(name, ref.grad, experts)
        for e in range(experts):
            if used[e] == 0:
                assert not actual[e].any(), f"{name}: expert {e} has no tokens but a nonzero gradient"
            else:
                assert_close_dtype(actual[e], wanted[e], dtype, n_reduce=int(used[e]), name=f"{name}[{e}]",
                                   factor=CHAIN_FACTOR)  # fmt: skip
    return index


def by_expert(name, grad, experts):
    """A gradient as one slice per expert (peft's B keeps the expert index last)."""
    if name.endswith(".A"):
        return grad.view(experts, -1, grad.shape[-1])
    if name.endswith(".B"):
        return grad.view(grad.shape[0], -1, experts).permute(2, 0, 1)
    return grad


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_moe_experts_topk(k, dtype):
    index = run_case(dtype, k=k, experts=10)
    counts = torch.bincount(index.reshape(-1).cpu(), minlength=10)
    assert (counts == 0).any() or k > 8, "the routing should leave some experts empty"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_experts_gpt_oss_layout(dtype):
    """gpt-oss: (E, in, out) weights, interleaved gate/up, biases, the clamped SwiGLU (limit reached)."""
    run_case(dtype, activation="gpt_oss", layout="interleaved", transposed=True, bias=True)


@pytest.mark.parametrize("activation", ["geglu", "geglu_tanh"])
def test_moe_experts_activations(activation):
    run_case(torch.float32, activation=activation)


def test_moe_experts_without_lora_full_finetune():
    """No adapters, trainable expert stacks and biases: dW_e from the per-expert sums."""
    run_case(torch.float32, rank=0, trainable=True, bias=True)
    run_case(torch.float32, rank=0, trainable=True, transposed=True)


def test_moe_experts_one_expert_takes_all():
    run_case(torch.float32, experts=3, k=1, tokens=40)  # several M tiles in one expert, two empty experts


def test_moe_experts_torch_path_matches():
    """The torch path (torch._grouped_mm or its segment loop) computes the same as the reference."""
    run_case(torch.float32, impl="torch", k=2)
    run_case(torch.float32, impl="torch", activation="gpt_oss", layout="interleaved", transposed=True, bias=True)


def test_route_sorts_stably_without_host_sync():
    index = torch.tensor([[2, 0], [0, 1], [2, 1]], device=DEVICE)
    r = route(index, 4)
    assert r.expert_end.tolist() == [2, 4, 6, 6]  # expert 3 empty
    assert r.tokens.tolist() == [0, 1, 1, 2, 0, 2]
    assert r.experts.tolist() == [0, 0, 1, 1, 2, 2]
    flat = index.reshape(-1)
    assert torch.equal(r.experts[r.inverse], flat)


def test_grouped_mm_falls_back_on_unaligned_strides():
    a = torch.randn(7, 3, dtype=torch.float64)
    b = torch.randn(2, 3, 5, dtype=torch.float64)
    end = torch.tensor([4, 7], dtype=torch.int32)
    torch.testing.assert_close(grouped_mm(a, b, end), torch.cat([a[:4] @ b[0], a[4:] @ b[1]]))


def test_moe_experts_rejects_bad_shapes():
    w = torch.zeros(4, 8, 6, device=DEVICE)
    down = ExpertWeights(torch.zeros(4, 6, 4, device=DEVICE))
    x = torch.zeros(2, 6, device=DEVICE)
    index, weights = torch.zeros(2, 1, dtype=torch.long, device=DEVICE), torch.ones(2, 1, device=DEVICE)
    with pytest.raises(ValueError, match="down"):
        moe_experts(x, index, weights, ExpertWeights(w), ExpertWeights(torch.zeros(4, 6, 5, device=DEVICE)))
    with pytest.raises(ValueError, match="LoRA A"):
        moe_experts(x, index, weights, ExpertWeights(w, torch.zeros(4, 2, 5), torch.zeros(4, 8, 2)), down)
    with pytest.raises(ValueError, match="activation"):
        moe_experts(x, index, weights, ExpertWeights(w), down, activation="relu")
    with pytest.raises(ValueError, match="tokens"):
        moe_experts(x, index[:1], weights[:1], ExpertWeights(w), down)


@without_gpu
def test_moe_kernels_compile_for_gpus():
    """The grouped GEMM, the per-expert sums and the activation compile for sm_90 and gfx942."""
    from reference import gpu_compile_facts

    common = {"DOT_FP32": False}
    cases = [
        ("unsloth_kernels.moe", "_grouped_gemm_kernel",
         {"GATHER": True, "HAS_BIAS": True, "LORA": True, "BLOCK_R": 16, "BLOCK_E": 32, "BLOCK_M": 64,
          "BLOCK_N": 128, "BLOCK_K": 64, **common}, 4,
         {"ROWS": "*i32", "EXPERT_END": "*i32", "out_scale": "fp32", "lora_scale": "fp32"}),
        ("unsloth_kernels.moe", "_segment_outer_kernel",
         {"GATHER_R": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, **common}, 4,
         {"ROWS": "*i32", "EXPERT_END": "*i32", "scale": "fp32"}),
        ("unsloth_kernels.moe", "_moe_act_kernel",
         {"ACT": 3, "COL_STEP": 2, "BACKWARD": True, "BLOCK_M": 32, "BLOCK_N": 128}, 4,
         {"alpha": "fp32", "limit": "fp32"}),
    ]
    facts = gpu_compile_facts(cases)
    assert set(facts) == {"sm90", "gfx942"}
    assert all(len(per_target) == len(cases) for per_target in facts.values())


@pytest.mark.slow
def test_moe_experts_nf4_stacks_match_their_dequantized_weights():
    """bitsandbytes 4-bit expert stacks (double-quantized NF4 over the flattened (E, out, in) stack):
    the same outputs and LoRA gradients, bit for bit, as the dense stacks they dequantize to."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    from unsloth_kernels.nf4 import dequantize_bnb_4bit

    dtype, experts, hidden, inter, rank = torch.bfloat16, 5, 32, 16, 4
    index, weights = uneven_routing(10, experts, 2)
    weights = weights.to(DEVICE, dtype)
    x = torch.randn(10, hidden, dtype=dtype, device=DEVICE)
    runs = []
    for quantized in (True, False):
        stacks = []
        for seed, (out, inp) in enumerate(((2 * inter, hidden), (hidden, inter))):
            w, A, B, _ = make_experts(experts, out, inp, dtype, rank=rank, seed=seed)
            packed, state = bnb_functional.quantize_4bit(w.float(), blocksize=64, compress_statistics=True,
                                                         quant_type="nf4")  # fmt: skip
            state.dtype = dtype
            p = views(w, A, B, None, rank=rank, scaling=2.0)
            if quantized:
                p = ExpertWeights(packed, p.A, p.B, p.scaling, quant_state=state)
            else:
                p = ExpertWeights(dequantize_bnb_4bit(packed, state), p.A, p.B, p.scaling)
            stacks.append((p, A, B))
        xi = x.clone().requires_grad_()
        out = moe_experts(xi, index, weights, stacks[0][0], stacks[1][0])
        out.backward(torch.ones_like(out))
        runs.append([out, xi.grad, *(t.grad for _, A, B in stacks for t in (A, B))])
    for quantized, dense in zip(*runs):
        assert torch.equal(quantized, dense)
