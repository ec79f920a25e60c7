"""What the Trainer asks of the model at every micro-batch (train(), num_parameters(), parameters()) is kept
per module tree, and rebuilt when the tree changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tiny_families import VOCAB, tiny_llama, with_lora
from unsloth.models.module_tree import cheap_trainer_calls


@pytest.fixture
def torch_train_calls(monkeypatch):
    """How often torch's own Module.train runs (once per module it visits)."""
    calls = []
    plain = nn.Module.train

    def counted(self, mode=True):
        calls.append(self)
        return plain(self, mode)

    monkeypatch.setattr(nn.Module, "train", counted)
    return calls


def _lora_model():
    model = with_lora(tiny_llama())
    cheap_trainer_calls(model)
    return model


def test_train_that_would_change_nothing_walks_nothing(torch_train_calls):
    model = _lora_model()
    model.train()
    assert torch_train_calls, "the first train() must set the flags"
    torch_train_calls.clear()
    model.train()
    assert torch_train_calls == []
    model.eval()
    assert torch_train_calls and not any(m.training for m in model.modules())


def test_train_still_reaches_a_module_whose_flag_was_set_by_hand():
    model = _lora_model()
    model.train()
    deep = model.get_base_model().model.layers[1].mlp.up_proj
    deep.training = False
    model.train()
    assert deep.training


def test_train_reaches_modules_added_after_it_was_kept():
    model = _lora_model()
    model.eval()
    added = nn.Linear(2, 2)  # a fresh module is in training mode
    model.get_base_model().model.layers[0].mlp.extra = added
    model.eval()
    assert not added.training


def test_train_is_not_skipped_where_a_module_overrides_it():
    class Switch(nn.Module):
        def __init__(self):
            super().__init__()
            self.switched = 0

        def train(self, mode=True):
            self.switched += 1
            return super().train(mode)

    model = _lora_model()
    model.get_base_model().model.layers[0].switch = switch = Switch()
    model.train()
    model.train()
    assert switch.switched == 2


def test_num_parameters_is_counted_once_per_tree_and_follows_a_new_weight(monkeypatch):
    model = _lora_model()
    inner = model.get_base_model()
    counts = []
    walk = type(inner).num_parameters

    def counted(self, *args, **kwargs):
        counts.append(kwargs)
        return walk(self, *args, **kwargs)

    monkeypatch.setattr(type(inner), "num_parameters", counted)
    first = model.num_parameters(exclude_embeddings=True)
    assert first == walk(inner, exclude_embeddings=True)
    assert model.num_parameters(exclude_embeddings=True) == first and len(counts) == 1
    assert model.num_parameters() == walk(inner)  # its own entry
    inner.model.layers[0].mlp.extra = nn.Linear(4, 4)
    assert model.num_parameters(exclude_embeddings=True) == first + 20
    # trainable counts follow requires_grad, which no registration announces
    trainable = model.num_parameters(only_trainable=True)
    inner.model.layers[0].self_attn.q_proj.lora_A["default"].weight.requires_grad_(False)
    assert model.num_parameters(only_trainable=True) < trainable


def test_slicing_the_layer_list_keeps_what_is_kept(torch_train_calls):
    """transformers' decoders slice their layer list at every forward, registering the layers into a fresh
    ModuleList: that is no change of the tree."""
    model = _lora_model()
    model.train()
    model(input_ids=torch.randint(0, VOCAB, (1, 4)))
    torch_train_calls.clear()
    model.train()
    assert torch_train_calls == []


def test_train_switches_transformers_hub_kernels_even_where_every_flag_is_set():
    kernels = pytest.importorskip("kernels")
    from transformers.utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("transformers does not see the kernels package")
    model = _lora_model()
    model.train()
    inner = model.get_base_model()
    inner._use_kernels = True  # as from_pretrained(use_kernels=True) leaves it, without fetching kernels
    inner.kernels_mode = kernels.Mode.INFERENCE
    model.train()
    assert inner.kernels_mode == kernels.Mode.TRAINING


def test_a_deep_copy_keeps_its_own_answers():
    """TRL copies a model for its reference: the copy's kept answers are about the copy's modules."""
    import copy

    model = _lora_model()
    model.eval()
    before = model.num_parameters()
    twin = copy.deepcopy(model)
    twin.train()
    assert all(m.training for m in twin.modules()) and not any(m.training for m in model.modules())
    twin.get_base_model().model.layers[0].mlp.extra = nn.Linear(4, 4)
    assert twin.num_parameters() == before + 20 and model.num_parameters() == before


def test_the_kept_methods_pickle_by_their_names():
    """pickle stores a bound method as getattr(obj, name): loading a saved model (torch.save(model)) asks the
    model for that name again, which must exist."""
    model = _lora_model()
    inner = model.get_base_model()
    for method in (model.train, model.parameters, inner.num_parameters):
        rebuild, (obj, name) = method.__reduce__()
        assert rebuild(obj, name) == method


def test_parameters_are_torchs_without_a_walk_and_follow_the_tree(monkeypatch):
    model = _lora_model()
    plain = list(nn.Module.parameters(model))
    assert list(model.parameters()) == plain  # same objects, same order, tied ones once
    walks = []
    walk = nn.Module.modules
    monkeypatch.setattr(nn.Module, "modules", lambda self: walks.append(self) or walk(self))
    assert list(model.parameters()) == plain and walks == []
    assert list(model.parameters(recurse=False)) == list(nn.Module.parameters(model, recurse=False))
    monkeypatch.undo()
    mlp = model.get_base_model().model.layers[0].mlp
    mlp.extra = nn.Linear(4, 4)  # a new module: its parameters are found
    assert [p for p in model.parameters() if p is mlp.extra.weight]
    # a parameter swapped into its module's dict without a registration (FSDP2 does this) is read there
    swapped = nn.Parameter(mlp.extra.weight.detach().clone())
    mlp.extra._parameters["weight"] = swapped
    assert [p for p in model.parameters() if p is swapped]
    model.zero_grad()  # torch's zero_grad reads them through parameters()


def test_parameters_are_read_as_they_are_iterated_as_torchs_are():
    """transformers' `model.device` and `model.dtype` take `next(model.parameters())`, several times per
    generated token: the iterator reads the dicts as it goes (as torch's does), not all of them up front."""
    model = _lora_model()
    down = model.get_base_model().model.layers[-1].mlp.down_proj.base_layer
    ours, torchs = model.parameters(), nn.Module.parameters(model)
    first = next(ours)
    assert first is next(torchs)
    swapped = nn.Parameter(down.weight.detach().clone())
    down._parameters["weight"] = swapped  # after the iterators were made, before they reach it
    rest, torch_rest = list(ours), list(torchs)
    assert [p for p in rest if p is swapped] and [p for p in torch_rest if p is swapped]
    assert rest == torch_rest
