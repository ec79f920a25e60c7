"""The generic fast path: a family we have no patches for trains through our loss, LoRA and checkpointing,
with the loss and LoRA gradients of the unpatched model, and the load message says what is fast."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_families import VOCAB, save_tiny, tiny_model, with_lora
from unsloth.models.checkpointing import apply_gradient_checkpointing
from unsloth.models.patches import family_patches, patch_model, patch_peft_model

# What each stresses: LayerNorm and an ungated MLP (phi), logits divided by a config scale (granite),
# a mixture of experts with eager attention only (gpt_oss), per-layer input embeddings that every
# checkpointed layer takes as an argument (gemma4_text), Gated DeltaNet layers (qwen3_5_text). All
# but phi have family patches, switched off here as `bench_families.py --generic` does.
GENERIC = ["phi", "granite", "gpt_oss", "gemma4_text", "qwen3_5_text"]
# On a GPU machine the kernels run for real there (the interpreter is set only without one).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(seed=1, batch=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[:, :4] = -100
    return ids, labels


def _with_lora(model):
    return with_lora(model, target_modules="all-linear")


def _loss_and_grads(model, ids, labels):
    model.train()
    model.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_generic_path_matches(family: str, checkpointing="unsloth", layers_with_lora=None):
    """Patched through the generic path (and checkpointed) against the untouched model: loss and grads."""
    from peft.tuners.lora import LoraLayer

    reference = tiny_model(family).to(DEVICE)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert report.skipped is None and report.loss
    assert (report.rms_norm, report.rope, report.mlp) == (0, 0, 0)  # the generic path only

    ids, labels = _batch()
    reference, patched = _with_lora(reference), _with_lora(patched)
    lora_layers = sum(isinstance(m, LoraLayer) for m in patched.modules())
    assert patch_peft_model(patched).lora == {"MLP": 0, "linear": lora_layers} and lora_layers
    layers = apply_gradient_checkpointing(patched.get_base_model(), checkpointing)
    assert layers == reference.config.num_hidden_layers
    ref_loss, ref_grads = _loss_and_grads(reference, ids, labels)
    fast_loss, fast_grads = _loss_and_grads(patched, ids, labels)
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert ref_grads.keys() == fast_grads.keys() and ref_grads
    for name, grad in ref_grads.items():
        assert fast_grads[name] is not None, name
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    return report


@pytest.mark.slow
@pytest.mark.parametrize("family", GENERIC)
def test_any_family_trains_through_the_generic_path(family, monkeypatch):
    monkeypatch.setenv("UNSLOTH_FAMILY_PATCHES", "0")
    report = assert_generic_path_matches(family)
    reason = f"no family patches for {family}" if family_patches(family) is None else "UNSLOTH_FAMILY_PATCHES=0"
    assert reason in report.generic_only


def test_family_patches_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("UNSLOTH_FAMILY_PATCHES", "0")
    report = patch_model(tiny_model("llama").to(DEVICE))
    assert report.loss and (report.rms_norm, report.rope, report.mlp) == (0, 0, 0)
    assert "UNSLOTH_FAMILY_PATCHES=0" in report.summary()


def test_the_load_message_says_what_is_fast_and_what_is_not(tmp_path, caplog):
    """Through the loader, as a user loads: a saved tiny phi, LoRA on every linear layer."""
    from unsloth.models.loader import add_lora, load_pretrained

    path = save_tiny("phi", tmp_path)
    with caplog.at_level("INFO", logger="unsloth"):
        model, _ = load_pretrained(str(path), load_in_4bit=False, dtype="float32")
        model = add_lora(model, r=4, target_modules=["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"])
    message = caplog.records[-1].getMessage()
    assert message.startswith("unsloth: phi: generic fast path; fast: fused loss, 12 LoRA linear, "
                              "checkpointing on 2 layers")
    assert "not accelerated: norms, RoPE, MLP stock (no family patches for phi yet)" in message
    assert "input embedding on the GPU (the input embedding is not on a GPU)" in message
    ids, labels = _batch()
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
