"""Gradient checkpointing of decoder layers (and offload on a GPU) keeps the gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_families import VOCAB, tiny_llama
from unsloth.models.checkpointing import apply_gradient_checkpointing


def _lora_grads(model, ids, mode):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                  task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    layers = apply_gradient_checkpointing(peft_model.get_base_model(), mode)
    peft_model.train()
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    return layers, loss.detach(), {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", [True, "unsloth"])
def test_checkpointed_layers_give_the_same_gradients(mode, monkeypatch):
    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # "unsloth" offloads only on a GPU
    model = tiny_llama().to(device)
    ids = torch.randint(0, VOCAB, (2, 16), device=device)
    _, ref_loss, ref_grads = _lora_grads(copy.deepcopy(model), ids, False)
    layers, loss, grads = _lora_grads(model, ids, mode)
    assert layers == model.config.num_hidden_layers
    torch.testing.assert_close(loss, ref_loss)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def _patched_lora_model(model, mode):
    """Our kernels patched in, LoRA on the attention projections, checkpointing in `mode`."""
    from peft import LoraConfig, get_peft_model

    from unsloth.models.patches import patch_model, patch_peft_model

    patch_model(model)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    patch_peft_model(peft_model)
    apply_gradient_checkpointing(peft_model.get_base_model(), mode)
    peft_model.train()
    return peft_model


def _step(peft_model, *batches):
    """Forward every batch, then one backward of the summed losses; returns (loss, grads)."""
    peft_model.zero_grad()
    loss = sum(peft_model(input_ids=ids, labels=ids).loss for ids in batches)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}


def _patched_lora_grads(model, ids, mode):
    return _step(_patched_lora_model(model, mode), ids)


def test_replayed_projections_give_the_recomputed_gradients(monkeypatch):
    """Our kernels on: with offload the attention projections keep their outputs (on a GPU, in pinned
    host memory) and the recompute replays them; the gradients are those of a plain recompute."""
    from unsloth.models import checkpointing as memory

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama().to(device)
    ids = torch.randint(0, VOCAB, (2, 16), device=device)
    ref_loss, ref_grads = _patched_lora_grads(copy.deepcopy(model), ids, True)
    replays = []
    kept_for_recompute = memory.kept_for_recompute

    def counting(key):
        replays.append(kept_for_recompute(key))
        return replays[-1]

    monkeypatch.setattr(memory, "kept_for_recompute", counting)
    loss, grads = _patched_lora_grads(model, ids, "unsloth")
    assert sum(r is not None for r in replays) == 4 * model.config.num_hidden_layers
    torch.testing.assert_close(loss, ref_loss)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host buffers: a GPU")
def test_the_next_step_reuses_the_pinned_buffers():
    model = tiny_llama().cuda()
    ids = torch.randint(0, VOCAB, (2, 16), device="cuda")
    _patched_lora_grads(model, ids, "unsloth")
    offloader = model.model.layers[0]._unsloth_offloader
    first = {h.data_ptr() for entry in offloader.saved for h in entry.host}
    model(input_ids=ids, labels=ids).loss.backward()
    second = {h.data_ptr() for entry in offloader.saved for h in entry.host}
    assert first and second == first


def test_two_forwards_before_one_backward_keep_their_own_saved_tensors():
    """A step's pinned buffers are reused by the next pass only once its backward has fetched them."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama().to(device)
    first, second = (torch.randint(0, VOCAB, (2, 16), device=device) for _ in range(2))
    grads = {}
    for mode in (True, "unsloth"):
        peft_model = _patched_lora_model(copy.deepcopy(model), mode)
        _step(peft_model, first)  # a whole step first: its buffers are then free for the next pass
        grads[mode] = _step(peft_model, first, second)[1]
    for name, grad in grads[True].items():
        torch.testing.assert_close(grads["unsloth"][name], grad, msg=name)


def test_kept_outputs_changed_in_place_are_not_replayed():
    from unsloth.models.checkpointing import _Offloader

    offloader = _Offloader()
    entry = offloader.save(torch.zeros(3), 0)
    changed, untouched = torch.ones(2), torch.ones(2)
    entry.keep("changed", (changed,))
    entry.keep("untouched", (untouched,))
    changed.add_(1)
    entry.seal()
    hidden, kept = entry.fetch()
    assert torch.equal(hidden, torch.zeros(3))
    assert set(kept) == {"untouched"} and torch.equal(kept["untouched"][0][0], torch.ones(2))


def test_a_pass_that_starts_above_layer_zero_still_recycles_the_last_one():
    """A multimodal model's text-only batches never run its vision tower's layers (numbered first)."""
    from unsloth.models.checkpointing import _Offloader

    offloader = _Offloader()
    for _ in range(3):
        for layer in (5, 6, 7):
            offloader.save(torch.zeros(3), layer)
        assert [entry.layer_index for entry in offloader.saved] == [5, 6, 7]


class _SideInputLayer(torch.nn.Linear):
    def forward(self, x, side, **kwargs):  # as transformers' layers take use_cache and others
        return torch.tanh(super().forward(x) * side)


class _LayersWithASharedInput(torch.nn.Module):
    """Each layer takes the hidden state and a tensor computed once for all of them (as Gemma 4's
    per-layer inputs are), which needs a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList(_SideInputLayer(8, 8) for _ in range(3))

    def forward(self, x):
        side = self.shared(x)
        for layer in self.layers:
            x = layer(x, side)
        return x.square().sum()


@pytest.mark.parametrize("mode", [True, "unsloth"])
def test_a_layer_argument_that_needs_a_gradient_gets_it_through_the_checkpoint(mode):
    reference, checkpointed = _LayersWithASharedInput(), _LayersWithASharedInput()
    assert apply_gradient_checkpointing(checkpointed, mode) == 3
    x = torch.randn(2, 8)
    reference(x).backward()
    checkpointed(x).backward()
    for (name, p), q in zip(reference.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_replay_can_be_switched_off(monkeypatch):
    from unsloth.models.checkpointing import _Offloader

    monkeypatch.setenv("UNSLOTH_REPLAY_PROJECTIONS", "0")
    entry = _Offloader().save(torch.zeros(3), 0)
    assert not entry.room_to_keep()


def test_checkpointing_stays_out_of_inference():
    model = tiny_llama()
    apply_gradient_checkpointing(model, True)
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 11)
    with pytest.raises(ValueError, match="True, False or"):
        apply_gradient_checkpointing(model, "always")


@pytest.mark.parametrize("mode", [True, "unsloth"])
def test_layers_that_share_kv_states_keep_their_gradients(mode, monkeypatch):
    """Gemma 4 E2B / E4B: the last layers reuse the K/V that earlier layers store in a mapping all
    layers are handed. A no-grad first pass in the storing layers would cut the readers' gradients
    to them."""
    import transformers

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    from tiny_families import COMMON

    config = transformers.Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=64, vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert [layer.self_attn.is_kv_shared_layer for layer in model.model.layers] == [False, False, True, True]
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    _, ref_loss, ref_grads = _lora_grads(copy.deepcopy(model), ids, False)
    layers, loss, grads = _lora_grads(model, ids, mode)
    assert layers == 4
    torch.testing.assert_close(loss, ref_loss)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_an_adapter_added_after_checkpointing_gets_its_gradients(monkeypatch):
    """The checkpoint keeps each layer's list of parameter dicts between calls: an adapter added later
    (new modules and parameters) must still be among the Function's inputs and get its gradients."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    apply_gradient_checkpointing(model.get_base_model(), True)
    model.train()
    ids = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()  # the layers' parameter lists are now cached
    model.add_adapter("late", LoraConfig(r=2, target_modules=["v_proj"]))
    model.base_model.set_adapter(["default", "late"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    late = {n: p.grad for n, p in model.named_parameters() if ".late." in n}
    assert late and all(g is not None and g.abs().sum() > 0 for g in late.values()), late.keys()


def _trained_once(model):
    """One checkpointed training step: every layer's parameter dicts are kept, the hooks registered."""
    apply_gradient_checkpointing(model, True)
    model.train()
    ids = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    return model


def test_the_kept_parameter_lists_survive_layer_slicing_and_follow_a_replaced_weight(monkeypatch):
    from unsloth.models.checkpointing import _trainable_parameters

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model = _trained_once(tiny_llama())
    layer = model.model.layers[0]
    kept = layer.__dict__["_unsloth_kept"]["parameter dicts"]
    model.model.layers[:1]  # what the decoders do at every forward: a fresh ModuleList registers the layers
    model(input_ids=torch.randint(0, VOCAB, (1, 4)))
    assert layer.__dict__["_unsloth_kept"]["parameter dicts"] is kept  # not rebuilt
    replaced = torch.nn.Parameter(torch.zeros_like(layer.mlp.up_proj.weight))
    layer.mlp.up_proj.weight = replaced  # the same parameter dict, read per call
    assert any(p is replaced for p in _trainable_parameters(layer))
    layer.mlp.extra = torch.nn.Linear(2, 2)  # a new module's dict: the registration has the list rebuilt
    assert any(p is layer.mlp.extra.weight for p in _trainable_parameters(layer))


def test_a_compiled_forward_after_training_does_not_recompile_at_every_call(monkeypatch):
    """The registration hook runs inside the traced forward (the decoder slices its layers there). If
    what it touches moved with every forward, dynamo would recompile the step at every token and fall
    back to eager: one graph for all calls of the same shape."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model = _trained_once(tiny_llama()).eval()
    ids = torch.randint(0, VOCAB, (1, 4))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for _ in range(4):
            torch.testing.assert_close(compiled(input_ids=ids).logits, expected)
    assert counters["stats"]["unique_graphs"] == 1
