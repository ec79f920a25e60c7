"""Our torch chunked gated delta rule (unsloth_kernels.delta_rule) against transformers' torch reference:
outputs, final state and every gradient, on random inputs; then a tiny Qwen3.5 trained through it.

Both compute in float32 whatever the input dtype, so float64 inputs compare at float32 rounding; a wrong
formula is off by O(1). The decays are strong enough (g down to -3 per step) that a chunk's running sum
would overflow float32's exp if the masking came after it."""

from __future__ import annotations

import inspect

import pytest
import torch

from tiny_families import VOCAB, tiny_model
from unsloth.models.patches.delta_rule import OURS, route_delta_rule
from unsloth_kernels.delta_rule import chunk_gated_delta_rule

modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
reference = inspect.unwrap(modeling.torch_chunk_gated_delta_rule)  # the torch function, under any wrapper
pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(length, dtype, state, seed=0, batch=2, k_heads=2, v_heads=4, dim=16):
    """q, k, v, g, beta and the start state (or None), leaves that want gradients. Two v heads per k head."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, length, k_heads, dim), (batch, length, k_heads, dim), (batch, length, v_heads, dim)]
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
    g = -3 * torch.rand(batch, length, v_heads, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, length, v_heads, generator=gen, dtype=torch.float64)
    start = torch.randn(batch, v_heads, dim, dim, generator=gen, dtype=torch.float64) if state else None
    return [None if x is None else x.to(dtype).requires_grad_() for x in (q, k, v, g, beta, start)]


def _run(rule, inputs, l2norm, seed=1):
    """The output, final state, and the gradients of a random weighting of both."""
    *qkvgb, start = inputs
    out, final = rule(*qkvgb, initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    gen = torch.Generator().manual_seed(seed)
    loss = (out.double() * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum() + \
        (final.double() * torch.randn(final.shape, generator=gen, dtype=torch.float64)).sum()
    leaves = [x for x in inputs if x is not None]
    return out, final, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("length", [1, 37, 64, 130])
@pytest.mark.parametrize("state, l2norm", [(False, False), (True, True), (True, False), (False, True)])
def test_matches_transformers_outputs_state_and_gradients(length, state, l2norm):
    inputs = _inputs(length, torch.float64, state)
    ours, theirs = _run(chunk_gated_delta_rule, inputs, l2norm), _run(reference, inputs, l2norm)
    assert ours[0].dtype == theirs[0].dtype == torch.float64 and ours[0].shape == (2, length, 4, 16)
    assert ours[1].dtype == theirs[1].dtype == torch.float32
    assert ours[0].abs().max() > 0 and ours[1].abs().max() > 0
    for a, b in zip([ours[0], ours[1], *ours[2]], [theirs[0], theirs[1], *theirs[2]]):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def test_without_a_final_state_asked_for_none_comes_back():
    q, k, v, g, beta, _ = _inputs(37, torch.float32, False)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta)
    assert final is None
    torch.testing.assert_close(out, reference(q, k, v, g, beta)[0])


def test_bf16_inputs_come_back_bf16_within_bf16_rounding():
    inputs = _inputs(130, torch.bfloat16, True)
    ours, theirs = _run(chunk_gated_delta_rule, inputs, True), _run(reference, inputs, True)
    assert ours[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in ours[2])
    for a, b in zip([ours[0], ours[1], *ours[2]], [theirs[0], theirs[1], *theirs[2]]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_a_tiny_qwen3_5_trains_through_our_rule_as_through_transformers(monkeypatch):
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", modeling.torch_chunk_gated_delta_rule)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
                      target_modules=["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"])
    model = tiny_model("qwen3_5_text")
    with torch.no_grad():  # slow decays (g near -0.03 a step), so that chunk-to-chunk state carries weight
        model.model.layers[0].linear_attn.A_log.fill_(-4.0)
    model = get_peft_model(model, lora)
    ids = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(0))  # two chunks, one partial

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    expected = loss_and_grads()  # transformers' torch path: fla is not installed here
    assert route_delta_rule(model)[0].startswith(OURS)
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, expected[0])
    assert grads.keys() == expected[1].keys() and any("linear_attn" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=1e-4, atol=1e-6, msg=name)
