"""Preference training on our models: DPO, ORPO, KTO, SimPO end to end on a tiny Llama; the fused
per-token log-probabilities against full logits; the reference model as the frozen base."""

from __future__ import annotations

import pytest
import torch

from tiny_setup import write_tiny_model
from unsloth.models.patches.loss import IGNORE_INDEX
from unsloth.training.demo import load_examples
from unsloth.training.preference import patch_log_probs


def pairs(n: int = 8) -> list[dict]:
    """prompt / chosen / rejected: the right capital against another country's."""
    examples = load_examples()[::3][:n]
    answers = [a for _, a in examples]
    return [{"prompt": q, "chosen": " " + a, "rejected": " " + answers[(i + 1) % len(answers)]}
            for i, (q, a) in enumerate(examples)]


def unpaired(n: int = 8) -> list[dict]:
    return [row for pair in pairs(n) for row in ({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
                                                {"prompt": pair["prompt"], "completion": pair["rejected"],
                                                 "label": False})]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("preference") / "model")


def lora_model(folder, monkeypatch):
    from unsloth import FastLanguageModel

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # the kernels are covered in tests/kernels; this is the loop
    model, tokenizer = FastLanguageModel.from_pretrained(folder, max_seq_length=64, dtype="float32",
                                                         load_in_4bit=False)
    return FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16), tokenizer


def full_logit_log_probs(model, ids, labels):
    logits = model(input_ids=ids).logits[:, :-1].float()
    shifted = labels[:, 1:]
    picked = logits.log_softmax(-1).gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * (shifted != IGNORE_INDEX)


def batch(vocab: int):
    ids = torch.randint(0, vocab, (3, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # the prompt
    labels[2, 9:] = IGNORE_INDEX  # padding
    return ids, labels


def test_fused_log_probs_and_their_gradients_equal_full_logits(tiny_folder, monkeypatch):
    model, _ = lora_model(tiny_folder, monkeypatch)
    base = model.get_base_model()
    assert patch_log_probs(base)
    with torch.no_grad():  # LoRA B starts at zero: move it so the adapters change the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids, labels = batch(base.config.vocab_size)
    weights = torch.randn(3, 11, generator=torch.Generator().manual_seed(2))
    trainable = [p for p in model.parameters() if p.requires_grad]

    ours = model(input_ids=ids, labels=labels, fused_lm_head=True)
    (ours.log_probs * weights).sum().backward()
    ours_grads = [p.grad.clone() for p in trainable]
    model.zero_grad()
    expected = full_logit_log_probs(model, ids, labels)
    (expected * weights).sum().backward()

    torch.testing.assert_close(ours.log_probs, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.label_mask, labels[:, 1:] != IGNORE_INDEX)
    assert not ours.log_probs[~ours.label_mask].any()
    for got, want in zip(ours_grads, (p.grad for p in trainable)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # Without fused_lm_head the model is unchanged: logits, as before.
    assert model(input_ids=ids).logits.shape == (3, 12, base.config.vocab_size)


def trainer_for(method, model, tokenizer, tmp_path, steps=4):
    from datasets import Dataset

    common = dict(output_dir=str(tmp_path / method), max_steps=steps, per_device_train_batch_size=4,
                  learning_rate=5e-3, logging_steps=1, save_strategy="no", seed=0, report_to="none")
    if method == "dpo":
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer(model=model, ref_model=None, args=DPOConfig(beta=0.1, **common),
                          train_dataset=Dataset.from_list(pairs()), tokenizer=tokenizer)
    if method == "kto":
        from trl import KTOConfig, KTOTrainer

        # One batch of all 8 rows each step: KTO's KL estimate makes the loss of changing batches noisy.
        common["per_device_train_batch_size"] = 8
        return KTOTrainer(model=model, ref_model=None, args=KTOConfig(beta=0.1, **common),
                          train_dataset=Dataset.from_list(unpaired(4)), tokenizer=tokenizer)
    if method == "orpo":
        from trl import ORPOConfig, ORPOTrainer

        return ORPOTrainer(model=model, args=ORPOConfig(beta=0.1, **common), train_dataset=Dataset.from_list(pairs()),
                           tokenizer=tokenizer)
    from trl import CPOConfig, CPOTrainer

    return CPOTrainer(model=model, args=CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=2.0, **common),
                      train_dataset=Dataset.from_list(pairs()), tokenizer=tokenizer)


def losses_of(trainer) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "orpo", "kto", "simpo"])
def test_each_method_trains_on_the_fused_log_probs(method, tiny_folder, tmp_path, monkeypatch):
    model, tokenizer = lora_model(tiny_folder, monkeypatch)
    trainer = trainer_for(method, model, tokenizer, tmp_path)
    assert trainer._unsloth_fused_log_probs  # the probe adopted our head
    assert getattr(trainer, "ref_model", None) is None  # DPO / KTO: the reference is the adapter-disabled base
    trainer.train()
    losses = losses_of(trainer)
    assert len(losses) == 4 and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_reference_log_probs_are_the_frozen_base(tiny_folder, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model, tokenizer = lora_model(tiny_folder, monkeypatch)
    trainer = trainer_for("dpo", model, tokenizer, tmp_path, steps=2)
    trainer.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.model, inputs)

    plain = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()  # a separate copy
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX)
    with torch.no_grad():
        expected = full_logit_log_probs(plain, inputs["input_ids"], labels).sum(-1)
        policy = model(input_ids=inputs["input_ids"], labels=labels, fused_lm_head=True).log_probs.sum(-1)
    torch.testing.assert_close(torch.cat([ref_chosen, ref_rejected]), expected, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(policy, expected, atol=1e-3)  # the trained adapters do move the policy


@pytest.mark.slow
@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_full_logit_trainers_get_the_same_results_without_logits(method, tiny_folder, tmp_path, monkeypatch):
    model, tokenizer = lora_model(tiny_folder, monkeypatch)
    trainer = trainer_for(method, model, tokenizer, tmp_path)
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ours = trainer.concatenated_forward(trainer.model, inputs)
    trainer._unsloth_fused_log_probs = False  # TRL's own: full logits, gathered
    theirs = trainer.concatenated_forward(trainer.model, inputs)
    for got, want in ((ours[0], theirs[0]), (ours[1], theirs[1]), (ours[4], theirs[4])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_patch_dpo_trainer_is_importable_and_harmless():
    from unsloth import PatchDPOTrainer, PatchKTOTrainer

    assert PatchDPOTrainer() is None and PatchKTOTrainer() is None
    import trl

    assert trl.DPOTrainer.__module__ == "unsloth.training.trl_compat"
    assert trl.CPOTrainer.__module__ == "unsloth.training.trl_compat"
