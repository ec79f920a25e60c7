"""The Trainer's per-micro-batch calls kept per module tree: the same answers as transformers' and
torch's, also after the tree or a module's mode changes."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from tiny_families import tiny_llama
from unsloth.models.module_tree import cheap_trainer_calls


def _lora(model):
    cheap_trainer_calls(model)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    cheap_trainer_calls(peft)
    return peft


def test_train_and_eval_leave_every_module_in_the_asked_mode():
    model = _lora(tiny_llama())
    layer = model.get_base_model().model.layers[1]
    for first, inner, second in ((True, False, True), (False, True, False), (True, True, False)):
        model.train(first)
        layer.train(inner)  # a module's mode changed behind the model's back
        model.train(second)
        assert all(m.training == second for m in model.modules())
    assert model.eval() is model and not any(m.training for m in model.modules())


def test_a_module_whose_train_does_more_is_still_called():
    calls = []

    class Counting(nn.Linear):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    model = tiny_llama()
    model.model.layers[0].mlp.extra = Counting(2, 2)
    peft = _lora(model)
    peft.train()
    peft.train()
    assert calls == [True, True]


def test_num_parameters_follows_the_tree_and_the_trainable_flags():
    model = tiny_llama()
    cheap_trainer_calls(model)
    stock = type(model).num_parameters
    assert model.num_parameters(exclude_embeddings=True) == stock(model, exclude_embeddings=True)
    peft = _lora(model)
    assert peft.num_parameters() == stock(model) > stock(tiny_llama())  # the adapters count: the tree moved
    trainable = peft.num_parameters(only_trainable=True)
    next(p for n, p in peft.named_parameters() if "lora_A" in n).requires_grad_(False)
    assert peft.num_parameters(only_trainable=True) < trainable


def test_the_trainer_s_flops_count_reads_the_kept_number(monkeypatch, tmp_path):
    from transformers import Trainer, TrainingArguments

    peft = _lora(tiny_llama())
    walks = []
    original = type(peft.get_base_model()).num_parameters
    monkeypatch.setattr(type(peft.get_base_model()), "num_parameters",
                        lambda self, *a, **k: walks.append(1) or original(self, *a, **k))
    trainer = Trainer(model=peft, args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True))
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    flops = [trainer.floating_point_ops(batch) for _ in range(3)]
    assert flops[0] == flops[1] == flops[2] == 6 * 16 * original(peft.get_base_model(), exclude_embeddings=True)
    assert len(walks) == 1  # counted once, then kept


def test_a_forward_keeps_what_is_kept():
    """transformers' decoders slice their layer list at every forward, registering the layers into a new
    ModuleList: that is not a change of the model's tree."""
    from unsloth.models.module_tree import tree_version

    model = _lora(tiny_llama())
    model.train()
    version = tree_version()
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert tree_version() == version
    model.get_base_model().model.layers[0].mlp.extra = nn.Linear(2, 2)  # a real change of the tree
    assert tree_version() > version


def test_hub_kernels_follow_train_and_eval(tmp_path):
    """Where transformers runs hub kernels, train()/eval() still switch their mode (the skip needs it set)."""
    import pytest
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_kernels_available

    tiny_llama().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # from_pretrained turns hub kernels on by default
    if not (is_kernels_available() and model.use_kernels):
        pytest.skip("transformers runs no hub kernels here")
    from kernels import Mode

    peft = _lora(model)
    peft.eval()
    assert model.kernels_mode == Mode.INFERENCE
    for m in peft.modules():  # every flag already set to training, the kernels still in inference mode
        m.training = True
    peft.train()
    assert model.kernels_mode == Mode.TRAINING and all(m.training for m in peft.modules())
