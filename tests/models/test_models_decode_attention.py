"""Decoding attention on the key/value heads themselves (no repeat_kv), against transformers' own."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations import sdpa_attention
from transformers.modeling_utils import AttentionInterface

from tiny_families import compile_decode_as_on_a_gpu, tiny_model, transformers_attention
from unsloth.models import generation
from unsloth.models.patches import decode_attention
from unsloth.models.patches.decode_attention import grouped_decode_attention, patch_decode_attention


def _module(groups: int):
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    return module


def _inputs(batch, kv_heads, groups, length, dim, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=generator, dtype=dtype)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=dtype) for _ in range(2))
    filled = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] < filled[:, None]).view(batch, 1, 1, length)
    return query, key, value, mask


@pytest.mark.parametrize("batch, kv_heads, groups, length", [(1, 1, 2, 3), (3, 2, 4, 9), (2, 8, 4, 33), (4, 1, 8, 5)])
def test_grouped_decode_attention_is_transformers_sdpa_attention(batch, kv_heads, groups, length):
    """Bool and additive masks, shared by the heads: the same output as transformers' repeat_kv path."""
    query, key, value, mask = _inputs(batch, kv_heads, groups, length, dim=16)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    for attention_mask in (mask, additive, mask[:1].expand(batch, 1, 1, length)):
        expected, _ = sdpa_attention.sdpa_attention_forward(_module(groups), query, key, value, attention_mask,
                                                            scaling=0.25)  # fmt: skip
        got = grouped_decode_attention(query, key, value, attention_mask, scaling=0.25)
        assert got.shape == (batch, 1, kv_heads * groups, 16)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def _transformers_function(monkeypatch):
    """transformers' own "sdpa" function, registered again for this test (the wrapper may be installed)."""
    original = AttentionInterface._global_mapping["sdpa"]
    original = getattr(original, "_unsloth_original", original)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", original)
    return original


@pytest.fixture
def installed(monkeypatch):
    """The wrapper installed afresh over transformers' function for this test only."""
    _transformers_function(monkeypatch)
    assert patch_decode_attention()
    return AttentionInterface._global_mapping["sdpa"]


def test_only_a_single_masked_grouped_query_is_taken(installed, monkeypatch):
    """The wrapper takes one query token with groups and a head-shared mask; anything else (a prompt, no
    groups, a per-head mask, a position bias) is transformers' own call, with transformers' output."""
    taken, real = [], decode_attention.grouped_decode_attention
    monkeypatch.setattr(decode_attention, "grouped_decode_attention",
                        lambda *a, **kw: taken.append(1) or real(*a, **kw))  # fmt: skip
    query, key, value, mask = _inputs(2, 2, 2, 6, dim=8)
    calls = [
        (_module(2), query, key, value, mask, {}),  # taken
        (_module(2), torch.randn(2, 4, 3, 8), key, value, mask.expand(2, 1, 3, 6), {}),  # a prompt
        (_module(2), query, key, value, mask.expand(2, 4, 1, 6), {}),  # a mask per head
        (_module(2), query, key, value, mask, {"position_bias": torch.zeros(2, 4, 1, 6)}),
        (_module(1), query[:, :2], key, value, mask, {}),  # no groups
    ]
    for i, (module, q, k, v, m, extra) in enumerate(calls):
        got, _ = installed(module, q, k, v, m, scaling=0.5, **extra)
        expected, _ = installed._unsloth_original(module, q, k, v, m, scaling=0.5, **extra)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        assert len(taken) == 1, f"call {i}"


def test_the_patch_installs_once_checked_and_can_be_turned_off(monkeypatch):
    original = _transformers_function(monkeypatch)
    monkeypatch.setenv("UNSLOTH_DECODE_ATTENTION", "0")
    assert not patch_decode_attention() and AttentionInterface._global_mapping["sdpa"] is original
    monkeypatch.delenv("UNSLOTH_DECODE_ATTENTION")
    assert patch_decode_attention() and patch_decode_attention()
    wrapped = AttentionInterface._global_mapping["sdpa"]
    assert wrapped._unsloth_original is original
    # a transformers whose function no longer agrees with the wrapper keeps its own
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", original)
    monkeypatch.setattr(decode_attention, "grouped_decode_attention", lambda q, k, v, *a, **kw: 2 * q.transpose(1, 2))
    assert not patch_decode_attention() and AttentionInterface._global_mapping["sdpa"] is original


def test_the_compiled_decode_step_has_no_repeat_kv_and_gives_transformers_tokens(installed, monkeypatch):
    """A tiny GQA Llama (4 query heads on 2 key/value heads), batched prompts with left padding, the decode
    step compiled as on a GPU (where transformers' own function repeats the heads even for one query
    token): the fast path's greedy tokens equal transformers' own generate (its function, repeat_kv and
    all), and only the prompt's forward copies key/value heads, none traced into the decode step."""
    model = tiny_model("llama").eval()
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    ids = torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                   eos_token_id=None)  # fmt: skip
    with transformers_attention():
        expected = model.generate(**options)
    lengths = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: lengths.append(x.shape[2]) or real(x, n))
    compile_decode_as_on_a_gpu(monkeypatch)
    torch._dynamo.reset()
    generation.enable(model)
    try:
        assert torch.equal(model.generate(**options), expected)
    finally:
        generation.disable(model)
        torch._dynamo.reset()
    # the prompt's forward: key and value of every layer, once each
    assert len(lengths) == 2 * model.config.num_hidden_layers, lengths
