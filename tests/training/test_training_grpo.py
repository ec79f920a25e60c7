"""GRPO end to end on a tiny model with a toy reward; chunked log-probs against full logits."""

from __future__ import annotations

import pytest
import torch

from tiny_setup import write_tiny_model
from unsloth.training.grpo import completion_logprobs, grpo_trainer


@pytest.mark.slow
def test_grpo_trains_with_a_toy_reward(tmp_path, monkeypatch):
    from datasets import Dataset

    from unsloth import FastLanguageModel

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # the kernels are covered in tests/models; this is the loop
    model, tokenizer = FastLanguageModel.from_pretrained(write_tiny_model(tmp_path / "model"), max_seq_length=64,
                                                         dtype="float32", load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=True)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is the capital of {c}?"}]}
                                 for c in ("France", "Japan", "Peru", "Kenya")])
    seen = []

    def short_answers(prompts, completions, **_):  # reward: shorter completions score higher
        seen.extend(completions)
        return [-float(len(c[0]["content"])) for c in completions]

    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = grpo_trainer(model, tokenizer, dataset, reward_funcs=[short_answers], output_dir=str(tmp_path / "out"),
                           max_steps=2, per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=8, learning_rate=1e-2, save_strategy="no", seed=0)
    assert trainer.args.use_vllm is False  # no GPU here: generation goes through transformers
    trainer.train()
    assert len(seen) >= 8  # two steps of 4 completions were generated and scored
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert len(rewards) == 2
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "GRPO updated no LoRA weight"
    # the rollouts went through the fast path (its static caches exist only where it generated) ...
    caches = model.get_base_model()._unsloth_fast_generation
    assert [rows for rows, _ in caches] == [4]
    # ... which decodes with the LoRA weights just trained, not a copy taken before
    ids = tokenizer(["What is the capital of Peru?"], return_tensors="pt")
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    fast = model.generate(**ids, **options)
    FastLanguageModel.for_training(model)
    assert torch.equal(fast, model.generate(**ids, **options))


@pytest.mark.slow
def test_trls_own_grpo_trainer_rolls_out_through_the_fast_path(tmp_path):
    from datasets import Dataset

    from unsloth import FastLanguageModel
    from unsloth.models import generation

    model, tokenizer = FastLanguageModel.from_pretrained(write_tiny_model(tmp_path / "model"), max_seq_length=64,
                                                         dtype="float32", load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16)
    from trl import GRPOConfig, GRPOTrainer  # as notebooks import them, after unsloth

    assert not generation.enabled(model)
    GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                args=GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                                num_generations=2, report_to="none", use_vllm=False),
                train_dataset=Dataset.from_list([{"prompt": "t5 t6"}] * 2), processing_class=tokenizer)
    assert generation.enabled(model)


def test_completion_logprobs_match_full_logits_without_building_them(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "model"))
    ids = torch.randint(0, 250, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    keep = 4
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1:-1].float() / 0.7
    expected = logits.log_softmax(-1).gather(-1, ids[:, -keep:, None]).squeeze(-1)
    expected.sum().backward()
    expected_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    actual = completion_logprobs(model, ids, mask, keep, temperature=0.7, chunk_tokens=5)  # chunks split rows
    torch.testing.assert_close(actual, expected.detach(), rtol=1e-5, atol=1e-5)
    actual.sum().backward()
    torch.testing.assert_close(model.lm_head.weight.grad, expected_grad, rtol=1e-4, atol=1e-6)
