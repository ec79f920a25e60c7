"""Per family: patched against unpatched on a tiny random model — logits, loss and LoRA gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from peft.tuners.lora import LoraLayer

from tiny_families import DECODER_TARGETS, VOCAB, decoder_linears, has_tiny_config, target_names, tiny_model, with_lora
from unsloth.models.patches import FAMILIES, MLP_FEEDS_RESIDUAL, patch_model, patch_peft_model
from unsloth.models.checkpointing import apply_gradient_checkpointing

# The multimodal registry names (gemma4, qwen3_5, the vision families) are tested as their text models
# here, and whole in tests/models/test_vision_models.py.
FAMILY_NAMES = sorted(f for f in FAMILIES if has_tiny_config(f))


def _attention_layers(config) -> int:
    """Layers with softmax attention (q, k, v, o): Qwen3.5's others are Gated DeltaNet."""
    types = getattr(config, "layer_types", None) or []
    return sum(t != "linear_attention" for t in types) or config.num_hidden_layers


# Gemma 4 rotates q and k in separate calls (another signature); GLM and GLM-4 rotate interleaved
# pairs: their RoPE stays stock
STOCK_ROPE = {"gemma4_text", "glm", "glm4"}


def _rope_layers(config) -> int:
    return 0 if config.model_type in STOCK_ROPE else _attention_layers(config)


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
    config = reference.config.get_text_config()  # Mistral 3: its text model's
    layers = config.num_hidden_layers
    assert report.skipped is None
    assert report.rms_norm >= 2 * layers + 1  # two per layer and the final norm (more with q/k norms)
    assert report.rope == _rope_layers(config)
    assert report.mlp == layers
    assert report.loss

    ids, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)

    targets = decoder_linears(reference)
    reference, patched = with_lora(reference, targets), with_lora(patched, targets)
    # every LoRA layer on a fused path: one MLP kernel (gate, up, down) per layer and q, k, v, o per
    # attention; where gate and up are one projection (Phi-4, GLM, Granite 4), all are LoRA linears
    attention = _attention_layers(config)
    lora = {kind: n for kind, n in patch_peft_model(patched).lora.items() if n}  # dense Gemma 4: no experts
    lora_layers = sum(isinstance(m, LoraLayer) for m in patched.modules())
    names = target_names(targets)
    if {"gate_proj", "up_proj"} <= names:
        assert lora == {"MLP": layers, "linear": 4 * attention}
    else:
        assert lora == {"linear": lora_layers} and lora_layers == (len(names) - 2) * attention + 2 * layers
    if checkpointing:  # a vision-language model's tower layers are checkpointed too
        tower = getattr(reference.config, "vision_config", None)
        assert apply_gradient_checkpointing(patched.get_base_model(), checkpointing) == (
            layers + (tower.num_hidden_layers if tower is not None else 0))
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
    # the projections on the linear path (q, k, v and o of every layer) were replayed, not recomputed
    assert sum(replayed) == (lora["linear"] if checkpointing else 0)


def _lora_grads(model, ids, labels) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    model(input_ids=ids, labels=labels).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


# The families whose MLP_FEEDS_RESIDUAL membership this pass decided; the older ones are decided
# by test_patched_matches_unpatched's checkpointed run.
DECIDED = ["smollm3", "ministral", "ministral3", "mistral3", "granite", "olmo2", "olmo3", "phi3", "glm", "glm4",
           "granitemoehybrid"]


@pytest.mark.slow
@pytest.mark.parametrize("family", DECIDED)
def test_mlp_feeds_residual_holds_exactly_where_the_registry_says(family):
    """Skipping the MLP's output in the recompute pass keeps the gradients exactly for the families in
    MLP_FEEDS_RESIDUAL, and breaks them for the others (OLMo's norm after the MLP reads it), so the
    registry's choice is what the model needs. Phi-4, GLM and Granite 4 have no LoRA MLP kernel
    (gate and up are one projection): the flag has nothing to act on there."""
    reference = tiny_model(family)
    patched = copy.deepcopy(reference)
    patch_model(patched)
    targets = decoder_linears(reference)
    reference, patched = with_lora(reference, targets), with_lora(patched, targets)
    patch_peft_model(patched)
    mlps = [m for m in patched.modules() if hasattr(m, "_unsloth_mlp_feeds_residual")]
    if not {"gate_proj", "up_proj"} <= target_names(targets):
        assert not mlps and family not in MLP_FEEDS_RESIDUAL
        return
    assert len(mlps) == reference.config.get_text_config().num_hidden_layers
    assert all(m._unsloth_mlp_feeds_residual == (family in MLP_FEEDS_RESIDUAL) for m in mlps)
    for m in mlps:  # the skip forced on, whatever the registry says
        m._unsloth_mlp_feeds_residual = True
    apply_gradient_checkpointing(patched.get_base_model(), "unsloth")
    ids, labels = _batch()
    expected, actual = _lora_grads(reference, ids, labels), _lora_grads(patched, ids, labels)
    holds = all(torch.allclose(actual[n], g, rtol=1e-4, atol=1e-6) for n, g in expected.items())
    assert holds == (family in MLP_FEEDS_RESIDUAL)


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


@pytest.mark.parametrize("family", ["phi3", "qwen3_5_text"])
def test_partial_rotary_runs_our_kernel(family, monkeypatch):
    """Phi-4-mini (3/4 of each head) and Qwen3.5 rotate part of each head: the dispatcher takes those
    calls only because the partial probe matched, and the logits stay the stock model's."""
    from unsloth.models.patches import rope

    reference = tiny_model(family)
    config = reference.config
    assert config.rope_parameters["partial_rotary_factor"] < 1
    patched = copy.deepcopy(reference)
    patch_model(patched)
    calls = []
    original = rope._fast_rope
    monkeypatch.setattr(rope, "_fast_rope", lambda q, *a: calls.append(q.shape[-1]) or original(q, *a))
    ids = _batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    assert len(calls) == _attention_layers(config)


def test_a_partial_probe_is_needed_for_partial_calls():
    """Llama's function cannot rotate part of a head: its partial probe fails, so its dispatcher is made
    with partial=False and leaves such calls to the stock function."""
    import transformers.models.llama.modeling_llama as llama

    from unsloth.models.patches.rope import _matches

    assert _matches(llama.apply_rotary_pos_emb, 16, "cpu", torch.float32)
    assert not _matches(llama.apply_rotary_pos_emb, 16, "cpu", torch.float32, rot=8)


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
    # FSDP2 swaps its gathered parameters into the modules' dicts, registering nothing: they are read there
    gathered = torch.nn.Parameter(layer.lora_B["default"].weight.detach().clone())
    layer.lora_B["default"]._parameters["weight"] = gathered
    assert lora_weights(layer).B is gathered
    from peft import LoraConfig

    model.add_adapter("second", LoraConfig(r=2, lora_alpha=2, lora_dropout=0.0, target_modules=DECODER_TARGETS))
    model.set_adapter("second")  # another adapter, registered after the first view was kept
    assert lora_weights(layer).A is layer.lora_A["second"].weight
    model.set_adapter("default")
    assert lora_weights(layer).A is layer.lora_A["default"].weight
    layer.lora_dropout["default"] = torch.nn.Dropout(0.1)
    assert lora_weights(layer) is None  # dropout: the fast path does not apply
    with model.disable_adapter():
        assert lora_weights(layer) is None


def test_training_with_fp32_adapters_follows_each_optimizer_step(monkeypatch):
    """A bf16 model with fp32 adapters (peft's default): the kernels keep each adapter's bf16 cast
    between steps, and every optimizer step (here bitsandbytes-free SGD through a write that bumps no
    version counter) makes the next forward use the new weights, as the unpatched model does."""
    import unsloth_kernels.lora as lora_module

    reference = tiny_model("llama").to(torch.bfloat16)
    patched = copy.deepcopy(reference)
    patch_model(patched)
    patched, reference = with_lora(patched), with_lora(reference)
    patch_peft_model(patched)
    with torch.no_grad():
        for model in (patched, reference):
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()
                    if "lora_B" in name:
                        p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    ids, labels = _batch()

    class DataSGD(torch.optim.Optimizer):  # writes through .data: no version bump, as a fused kernel may not
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.data.add_(p.grad, alpha=-group["lr"])

    losses = {}
    for name, model in (("patched", patched), ("reference", reference)):
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = DataSGD(params, {"lr": 1.0})
        losses[name] = []
        for _ in range(3):
            generation = lora_module._weights_generation
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
            assert lora_module._weights_generation > generation  # the step hook fired
    assert losses["patched"][0] != losses["patched"][-1]  # the weights moved, and the patched model saw it
    # bf16 kernels against stock: 4e-4 apart here; stale casts were 1.5e-2 and 3e-2 off by steps 2 and 3
    torch.testing.assert_close(torch.tensor(losses["patched"]), torch.tensor(losses["reference"]), rtol=0, atol=3e-3)
