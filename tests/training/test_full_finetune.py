"""Full fine-tuning: every weight trains through our kernels, with 8-bit optimizers and offloaded checkpointing."""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # tiny_families

from tiny_families import VOCAB, tiny_model  # noqa: E402
from tiny_setup import write_dataset, write_tiny_model  # noqa: E402
from unsloth.models.checkpointing import apply_gradient_checkpointing  # noqa: E402
from unsloth.models.patches import patch_model  # noqa: E402
from unsloth.training import optimizers  # noqa: E402
from unsloth.training.config import from_dict  # noqa: E402
from unsloth.training.sft import train  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, "unsloth"], ids=["plain", "offloaded"])
@pytest.mark.parametrize("family", ["llama", "gemma"])  # gemma: (1 + w) norms, GELU gate, a tied LM head
def test_every_weight_gets_the_unpatched_gradient(family, checkpointing, monkeypatch):
    """The fused norms, RoPE, MLP and loss (and our checkpoint's recompute) give the base weights, the
    embedding and the LM head the same gradients as transformers' own modules. The MLPs run our
    trained-weights MLP; inside the checkpoint's recompute it skips their output."""
    import unsloth_kernels.gated_mlp as gated_mlp

    calls = []
    real = gated_mlp.dense_gated_mlp
    monkeypatch.setattr(gated_mlp, "dense_gated_mlp", lambda *a, **k: calls.append(k["output_needed"]) or real(*a, **k))
    reference = tiny_model(family)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert report.rms_norm and report.rope and report.mlp and report.loss
    if checkpointing:
        assert apply_gradient_checkpointing(patched, checkpointing) == reference.config.num_hidden_layers
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    losses = []
    for model in (reference, patched):
        model.train()
        model.requires_grad_(True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    layers = reference.config.num_hidden_layers
    # without checkpointing, each MLP once with its output; with it, once more in the recompute, without
    assert calls == ([True] * layers if not checkpointing else [False] * layers)
    fast = dict(patched.named_parameters())
    names = [name for name, _ in reference.named_parameters()]
    assert names == list(fast) and any("norm" in n for n in names) and any("embed" in n for n in names)
    for name, p in reference.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert fast[name].grad is not None, name
        torch.testing.assert_close(fast[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-full")
    return write_tiny_model(root / "model"), write_dataset(root / "data.jsonl")


def full_config(tiny, output_dir, **training):
    model, data = tiny
    return from_dict({
        "model": {"name": model, "max_seq_length": 32, "dtype": "float32", "full_finetuning": True},
        "dataset": {"name": data},
        "output_dir": str(output_dir),
        "gradient_checkpointing": "unsloth",
        "training": {"max_steps": 3, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                     "learning_rate": 3e-3, "logging_steps": 1, "save_strategy": "no", "seed": 0, **training},
    })


@pytest.mark.slow
def test_full_finetuning_with_adamw_8bit_trains_every_weight_and_saves(tiny, tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    if optimizers.bitsandbytes_optimizer_problem("cpu"):
        pytest.skip(optimizers.bitsandbytes_optimizer_problem("cpu"))
    before = AutoModelForCausalLM.from_pretrained(tiny[0]).state_dict()
    result = train(full_config(tiny, tmp_path, optim="adamw_8bit"), echo=lambda _: None)
    model = result.model
    report = model._unsloth_patches
    assert report.rms_norm and report.mlp and report.loss and report.checkpointed == 2
    assert not hasattr(model, "peft_config")  # no adapters: the model itself trains
    optimizer = result.trainer.optimizer
    states = [s for s in optimizer.state.values() if "state1" in s]
    assert type(optimizer.optimizer).__module__.startswith("bitsandbytes")
    assert any(s["state1"].dtype == torch.uint8 for s in states)  # the large weights' states in 8 bits
    assert len(result.losses) == 3 and result.losses[-1] < result.losses[0]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert saved.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], saved[k])]
    assert set(changed) == set(before)  # every weight moved: norms, embedding and LM head included


def test_an_8bit_optimizer_that_cannot_run_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(optimizers, "bitsandbytes_optimizer_problem",
                        lambda device: "bitsandbytes 0.0 cannot step an 8-bit optimizer on cpu (no kernel)")
    monkeypatch.setattr(optimizers, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="unsloth"):
        assert optimizers.usable_optimizer("adamw_8bit", "training.optim", "cpu") == "adamw_torch"
        assert optimizers.usable_optimizer("paged_adamw_8bit", "SFTConfig", "cpu") == "adamw_torch"
        assert optimizers.usable_optimizer("adamw_torch_fused", "SFTConfig", "cpu") == "adamw_torch_fused"
    text = caplog.text
    assert "optim='adamw_8bit' cannot run here" in text and "no kernel" in text and "'adamw_torch' instead" in text
    assert text.count("cannot run here") == 2  # once per name


def test_the_notebook_config_falls_back_too(monkeypatch):
    from trl import SFTConfig

    from unsloth.training import trl_compat

    trl_compat.install()
    import trl

    monkeypatch.setattr(optimizers, "bitsandbytes_optimizer_problem", lambda device: "no 8-bit kernels here")
    args = trl.SFTConfig(output_dir="unused", optim="adamw_8bit", max_steps=1)
    assert isinstance(args, SFTConfig) and str(getattr(args.optim, "value", args.optim)) == "adamw_torch"


def test_the_probe_runs_bitsandbytes_on_this_machine():
    pytest.importorskip("bitsandbytes")
    optimizers.bitsandbytes_optimizer_problem.cache_clear()
    problem = optimizers.bitsandbytes_optimizer_problem("cpu")
    import bitsandbytes

    # bitsandbytes >= 0.45 has CPU kernels for its 8-bit optimizers; older ones must be named as the problem
    assert problem is None or bitsandbytes.__version__ in problem


def test_bitsandbytes_optimizer_names():
    for name in ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "paged_lion_8bit"):
        assert optimizers.is_bitsandbytes_optimizer(name), name
    for name in ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor", None):
        assert not optimizers.is_bitsandbytes_optimizer(name), name


@pytest.mark.slow
def test_a_notebook_trainer_checks_the_memory_before_its_first_step(tiny, tmp_path, monkeypatch):
    from datasets import Dataset

    from unsloth import FastLanguageModel  # installs the notebook trainers
    from unsloth.training import memory

    import trl

    asked = []

    def refuse(model, **settings):
        asked.append(settings)
        raise memory.NotEnoughMemory("this run needs about 9.00 GiB more GPU memory, and 1.00 GiB is free")

    monkeypatch.setattr(memory, "check_before_training", refuse)
    model, tokenizer = FastLanguageModel.from_pretrained(tiny[0], max_seq_length=32, dtype="float32",
                                                         full_finetuning=True)
    trainer = trl.SFTTrainer(model=model, tokenizer=tokenizer,
                             train_dataset=Dataset.from_dict({"text": ["one two three four"] * 4}),
                             args=trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                                max_seq_length=32, optim="adamw_torch"))
    with pytest.raises(memory.NotEnoughMemory):
        trainer.train()
    assert trainer.state.global_step == 0
    assert asked == [{"batch": 2, "seq": 32, "optim": trainer.args.optim, "checkpointing": "unsloth",
                      "full_finetuning": True, "load_in_4bit": False, "echo": asked[0]["echo"]}]
