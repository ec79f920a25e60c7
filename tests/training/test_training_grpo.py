"""GRPO end to end on a tiny model with a toy reward; chunked log-probs against full logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # tiny_families

from tiny_families import compile_decode_as_on_a_gpu  # noqa: E402
from tiny_setup import write_tiny_model  # noqa: E402
from unsloth.training.grpo import completion_logprobs, grpo_trainer  # noqa: E402


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

    from unsloth.models import generation

    rollout_weights = []  # per rollout: where the LoRA weights generate reads live
    fast_generate = generation.fast_generate

    def recording(backbone, plain, *args, **kwargs):
        rollout_weights.append({p.data_ptr() for n, p in backbone.named_parameters() if "lora_" in n})
        return fast_generate(backbone, plain, *args, **kwargs)

    monkeypatch.setattr(generation, "fast_generate", recording)
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
    # the rollouts went through the fast path (its static caches exist only where it generated), once a step,
    # reading the very tensors the optimizer updates: no copy, no merge
    caches = model.get_base_model()._unsloth_fast_generation
    assert [rows for rows, _ in caches] == [4]
    trained = {p.data_ptr() for group in trainer.optimizer.param_groups for p in group["params"]}
    assert len(rollout_weights) == 2 and all(seen == trained for seen in rollout_weights)
    # ... which decodes with the LoRA weights just trained, not a copy taken before
    ids = tokenizer(["What is the capital of Peru?"], return_tensors="pt")
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    fast = model.generate(**ids, **options)
    FastLanguageModel.for_training(model)
    assert torch.equal(fast, model.generate(**ids, **options))


@pytest.mark.slow
def test_grpo_steps_reuse_the_compiled_decode_step(tmp_path, monkeypatch):
    """Rollouts, a training step, rollouts...: the decode step is compiled (dynamo's eager backend here, as
    on a GPU otherwise) once, not again at every step or token, nor after the first training step (dynamo
    guards on the number of global registration hooks: ours are installed at load)."""
    from datasets import Dataset
    from torch._dynamo.utils import counters

    from unsloth import FastLanguageModel
    from unsloth.models import module_tree

    for hook in module_tree._hooks:  # as in a fresh process: none installed before this model's
        hook.remove()
    module_tree._hooks.clear()
    compile_decode_as_on_a_gpu(monkeypatch)
    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model, tokenizer = FastLanguageModel.from_pretrained(write_tiny_model(tmp_path / "model"), max_seq_length=64,
                                                         dtype="float32", load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=True)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is the capital of {c}?"}]}
                                 for c in ("France", "Japan", "Peru", "Kenya")])
    torch._dynamo.reset()
    counters.clear()
    trainer = grpo_trainer(model, tokenizer, dataset, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                           output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                           num_generations=4, max_completion_length=8, save_strategy="no", seed=0)
    trainer.train()
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_trls_own_grpo_trainer_rolls_out_through_the_fast_path(tmp_path, caplog):
    """fast_inference=True without vLLM: said once, at load; TRL's GRPOTrainer then takes our path."""
    from datasets import Dataset

    from unsloth import FastLanguageModel
    from unsloth.models import generation

    with caplog.at_level("INFO", logger="unsloth"):
        model, tokenizer = FastLanguageModel.from_pretrained(write_tiny_model(tmp_path / "model"), max_seq_length=64,
                                                             dtype="float32", load_in_4bit=False, fast_inference=True)
        model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16)
        from trl import GRPOConfig, GRPOTrainer  # as notebooks import them, after unsloth

        assert not generation.enabled(model)
        trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                              args=GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none",
                                              per_device_train_batch_size=2, num_generations=2),
                              train_dataset=Dataset.from_list([{"prompt": "t5 t6"}] * 2), processing_class=tokenizer)
        assert trainer.args.use_vllm is False and generation.enabled(model)
    said = [r.getMessage() for r in caplog.records if "vLLM is not" in r.getMessage()]
    assert len(said) == 1 and "unsloth's static-cache path" in said[0], said
    assert "`unsloth install --with vllm`" in said[0]  # how to get it, where its wheels exist


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


LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def _same_lora_weights(ours, plain) -> None:
    """Seeded non-zero LoRA weights (B too, so the adapters change the rollouts), the same in both."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        weights = dict(ours.named_parameters())
        for name, p in plain.named_parameters():
            if "lora_" in name:
                p.copy_(weights[name])


@pytest.mark.slow
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_grpo_rollouts_rewards_and_losses_equal_trl_on_transformers(tmp_path, greedy):
    """Our GRPOTrainer on our model (kernels on, rollouts through the fast path) against TRL's own
    GRPOTrainer on transformers + peft with the same weights and seed: two steps give the same
    completions token for token, the same rewards and the same losses (the second step after an update)."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from unsloth import FastLanguageModel
    from unsloth.models import generation

    folder = write_tiny_model(tmp_path / "model")
    ours, tokenizer = FastLanguageModel.from_pretrained(folder, max_seq_length=64, dtype="float32",
                                                        load_in_4bit=False)
    ours = FastLanguageModel.get_peft_model(ours, **LORA, use_gradient_checkpointing=False, random_state=0)
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                           LoraConfig(**LORA, task_type="CAUSAL_LM"))
    _same_lora_weights(ours, plain)
    dataset = Dataset.from_list([{"prompt": p} for p in ("What is the capital of France?",
                                                         "Name a colour of the sky.")])
    # after `import unsloth`'s notebook facade, trl's names are our compat subclasses; TRL's own are their bases
    ours_classes = trl.GRPOConfig, trl.GRPOTrainer
    trl_classes = ours_classes[0].__mro__[1], ours_classes[1].__mro__[1]
    assert trl_classes[1].__module__.startswith("trl.")
    configs = [config_cls(output_dir=str(tmp_path / side), max_steps=2, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=6, learning_rate=5e-2, beta=0.04,
                          logging_steps=1, seed=0, use_vllm=False, report_to="none", save_strategy="no",
                          use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                          generation_kwargs={"do_sample": False} if greedy else None)
               for side, config_cls in (("ours", ours_classes[0]), ("trl", trl_classes[0]))]
    runs = {}
    for side, model, trainer_cls, config in (("trl", plain, trl_classes[1], configs[1]),
                                             ("ours", ours, ours_classes[1], configs[0])):
        completions = []

        def even_tokens(completion_ids, **_):  # varies within a group: advantages, and so the loss, are not zero
            completions.extend(completion_ids)
            return [float(sum(t % 2 == 0 for t in ids)) for ids in completion_ids]

        trainer = trainer_cls(model=model, reward_funcs=[even_tokens], args=config, train_dataset=dataset,
                              processing_class=tokenizer)
        trainer.train()
        logs = [log for log in trainer.state.log_history if "reward" in log]
        runs[side] = completions, [log["reward"] for log in logs], [log["loss"] for log in logs]
    assert generation.enabled(ours) and not generation.enabled(plain)  # ours rolled out through the fast path
    (completions, rewards, losses), (expected_completions, expected_rewards, expected_losses) = runs["ours"], runs["trl"]
    assert len(completions) == 8 and completions == expected_completions  # token for token
    assert rewards == expected_rewards and len(rewards) == 2
    if not greedy:
        assert any(abs(loss) > 1e-6 for loss in expected_losses)  # a loss that says something
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-4, atol=1e-6)
