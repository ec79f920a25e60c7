"""Per family: patched against unpatched on a tiny random model — logits, loss and LoRA gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_families import VOCAB, has_tiny_config, tiny_model, with_lora
from unsloth.models.patches import FAMILIES, patch_model, patch_peft_model
from unsloth.models.checkpointing import apply_gradient_checkpointing

# The multimodal registry names (gemma4, qwen3_5, the vision families) are tested as their text models
# here, and whole in tests/models/test_vision_models.py.
FAMILY_NAMES = sorted(f for f in FAMILIES if has_tiny_config(f))


def _attention_layers(config) -> int:
    """Layers with softmax attention (q, k, v, o): Qwen3.5's others are Gated DeltaNet."""
    types = getattr(config, "layer_types", None) or []
    return sum(t != "linear_attention" for t in types) or config.num_hidden_layers


def _rope_layers(config) -> int:
    # Gemma 4 rotates q and k in separate calls (another signature), so its RoPE stays stock
    return 0 if config.model_type == "gemma4_text" else _attention_layers(config)


def _batch(seed=1, batch=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100  # a masked prompt, as SFT batches have
    return ids, labels


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, "unsloth"], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_patched_matches_unpatched(family, checkpointing, monkeypatch):
    """Checkpointed: the patched model also recomputes its layers in backward (where the fused MLP of
    a family in MLP_FEEDS_RESIDUAL skips its output, and the attention projections replay the
    outputs the first pass kept); the reference keeps everything."""
    from unsloth.models import checkpointing as memory

    replayed = []
    kept_for_recompute = memory.kept_for_recompute

    def counting(key):
        kept = kept_for_recompute(key)
        replayed.append(kept is not None)
        return kept

    monkeypatch.setattr(memory, "kept_for_recompute", counting)
    reference = tiny_model(family)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    layers = reference.config.num_hidden_layers
    assert report.skipped is None
    assert report.rms_norm >= 2 * layers + 1  # two per layer and the final norm (more with q/k norms)
    assert report.rope == _rope_layers(reference.config)
    assert report.mlp == layers
    assert report.loss

    ids, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)

    reference, patched = with_lora(reference), with_lora(patched)
    # every LoRA layer on a fused path: one MLP (gate, up, down) per layer and q, k, v, o per attention
    attention = _attention_layers(reference.config)
    lora = {kind: n for kind, n in patch_peft_model(patched).lora.items() if n}  # dense Gemma 4: no experts
    assert lora == {"MLP": layers, "linear": 4 * attention}
    if checkpointing:
        assert apply_gradient_checkpointing(patched.get_base_model(), checkpointing) == layers
    for model in (reference, patched):
        model.train()
        model.zero_grad()
    ref_loss = reference(input_ids=ids, labels=labels).loss
    fast_loss = patched(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-5, atol=1e-5)
    ref_loss.backward()
    fast_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    fast_grads = {n: p.grad for n, p in patched.named_parameters() if p.requires_grad}
    assert ref_grads.keys() == fast_grads.keys() and ref_grads
    for name, grad in ref_grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        # fp32 throughout; the fused loss and LoRA backward sum in another order, and that difference
        # grows through the layers' backward to ~1e-5 relative (1e-5 fails for some families): 1e-4.
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # q, k, v and o of every layer were replayed, not recomputed
    assert sum(replayed) == (4 * attention if checkpointing else 0)


def test_without_kernels_a_model_trains_unpatched_and_says_so(caplog, monkeypatch):
    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model = tiny_model("phi")
    with caplog.at_level("INFO", logger="unsloth"):
        report = patch_model(model)
    assert report.skipped and "UNSLOTH_KERNELS=0" in report.skipped
    assert "phi: unpatched" in caplog.text and "transformers + peft" in caplog.text
    ids, labels = _batch()
    model = with_lora(model)
    assert patch_peft_model(model).lora == {}
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_unpatched_model_of_a_patched_family_keeps_the_stock_rope():
    """The RoPE dispatcher is module-wide; models that were not patched must not see our kernel."""
    from unsloth.models.patches import rope

    patched = tiny_model("llama")
    patch_model(patched)
    plain = tiny_model("llama")
    calls = []
    original = rope._fast_rope
    rope._fast_rope = lambda *a: calls.append(1) or original(*a)
    try:
        with torch.no_grad():
            plain(input_ids=_batch()[0])
            assert not calls
            patched(input_ids=_batch()[0])
            assert len(calls) == patched.config.num_hidden_layers
    finally:
        rope._fast_rope = original


def test_lora_layers_take_the_fused_paths_and_fall_back_when_disabled():
    reference = tiny_model("llama")
    patched = copy.deepcopy(reference)
    patch_model(patched)
    patched = with_lora(patched)
    report = patch_peft_model(patched)
    layers = reference.config.num_hidden_layers
    assert report.lora == {"MLP": layers, "linear": 4 * layers}
    ids, _ = _batch()
    reference = with_lora(reference)
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
        with patched.disable_adapter(), reference.disable_adapter():  # peft's own path, base model only
            torch.testing.assert_close(patched(input_ids=ids).logits, reference(input_ids=ids).logits,
                                       rtol=1e-4, atol=1e-4)


def test_the_kernels_view_of_a_lora_layer_is_kept_until_the_layer_changes():
    from peft.tuners.lora import LoraLayer

    from unsloth.models.patches.lora import lora_weights

    model = with_lora(tiny_model("llama"))
    layer = next(m for m in model.modules() if isinstance(m, LoraLayer))
    first = lora_weights(layer)
    assert first is not None and lora_weights(layer) is first  # unchanged: the same view
    layer.lora_A["default"].weight = torch.nn.Parameter(torch.zeros_like(first.A))
    second = lora_weights(layer)
    assert second is not first and second.A is layer.lora_A["default"].weight
    layer.scaling["default"] = 3.0
    assert lora_weights(layer).scaling == 3.0
    base = layer.get_base_layer()
    kept = lora_weights(layer)
    base.weight.data = base.weight.data.clone()  # what moving a model does: same parameter, new storage
    assert lora_weights(layer) is not kept
    layer.lora_dropout["default"] = torch.nn.Dropout(0.1)
    assert lora_weights(layer) is None  # dropout: the fast path does not apply
    with model.disable_adapter():
        assert lora_weights(layer) is None
