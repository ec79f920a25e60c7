"""GRPO's loss types on our path behave as TRL's own: the same batch gives the same loss and the same
LoRA gradients through our GRPOConfig / GRPOTrainer and our patched model as through TRL's classes
on a plain transformers + peft model with the same weights."""

from __future__ import annotations

import pytest
import torch

from tiny_setup import write_tiny_model

pytestmark = pytest.mark.slow  # two tiny models, forward and backward per loss type

B, PROMPT, COMPLETION = 4, 5, 6
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
# loss type, importance sampling level, beta (0: no reference model)
CASES = [("grpo", "token", 0.0), ("grpo", "token", 0.04), ("bnpo", "token", 0.0), ("dr_grpo", "token", 0.04),
         ("dapo", "token", 0.0), ("grpo", "sequence", 0.0), ("grpo", "sequence", 0.04)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Ours (FastLanguageModel + get_peft_model, kernels on) and TRL's reference (transformers + peft),
    with the same LoRA weights (B non-zero, so the adapters take part)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from unsloth import FastLanguageModel

    folder = write_tiny_model(tmp_path_factory.mktemp("grpo") / "model")
    ours, tokenizer = FastLanguageModel.from_pretrained(folder, max_seq_length=64, dtype="float32",
                                                        load_in_4bit=False)
    ours = FastLanguageModel.get_peft_model(ours, **LORA, use_gradient_checkpointing=False, random_state=0)
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                           LoraConfig(**LORA, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
        weights = dict(ours.named_parameters())
        for name, p in plain.named_parameters():
            if "lora_" in name:
                p.copy_(weights[name])
    return ours, plain, tokenizer


def _batch(vocab: int) -> dict:
    """One generation batch as GRPOTrainer hands it to compute_loss: left-padded prompts, completions
    cut at different lengths, advantages, and old / reference log-probs off the current policy."""
    g = torch.Generator().manual_seed(1)
    prompt_mask = torch.ones(B, PROMPT, dtype=torch.long)
    prompt_mask[0, :2] = 0
    completion_mask = torch.ones(B, COMPLETION, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[2, 2:] = 0
    return {"prompt_ids": torch.randint(3, vocab, (B, PROMPT), generator=g), "prompt_mask": prompt_mask,
            "completion_ids": torch.randint(3, vocab, (B, COMPLETION), generator=g),
            "completion_mask": completion_mask, "advantages": torch.randn(B, generator=g),
            "num_items_in_batch": completion_mask.sum(),
            "_noise": torch.randn(2, B, COMPLETION, generator=g) * 0.3}


def _config(config_cls, tmp_path, loss_type="grpo", level="token", beta=0.04):
    return config_cls(output_dir=str(tmp_path), loss_type=loss_type, importance_sampling_level=level, beta=beta,
                      per_device_train_batch_size=B, num_generations=B, max_completion_length=COMPLETION,
                      use_vllm=False, report_to="none", use_cpu=True, bf16=False, fp16=False,
                      gradient_checkpointing=False, epsilon=0.1)


@pytest.fixture(scope="module")
def trainers(models, tmp_path_factory):
    """Our GRPOTrainer on our model and TRL's own on the plain one, built once (beta > 0, so both hold
    their reference adapters); each case then sets the loss options as a trainer's __init__ reads them."""
    import trl
    from datasets import Dataset

    ours, plain, tokenizer = models
    # after `import unsloth`'s notebook facade, trl's names are our compat subclasses; TRL's own are their bases
    ours_classes = trl.GRPOConfig, trl.GRPOTrainer
    trl_classes = ours_classes[0].__mro__[1], ours_classes[1].__mro__[1]
    assert ours_classes[1] is not trl_classes[1] and trl_classes[1].__module__.startswith("trl.")
    # every case's configs first: TrainingArguments refuses to be built once a trainer set up accelerate
    configs = {case: (_config(ours_classes[0], tmp_path_factory.mktemp("c"), *case),
                      _config(trl_classes[0], tmp_path_factory.mktemp("c"), *case)) for case in CASES}
    built = {"configs": configs}
    for side, model, (config_cls, trainer_cls) in (("ours", ours, ours_classes), ("trl", plain, trl_classes)):
        trainer = trainer_cls(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                              args=_config(config_cls, tmp_path_factory.mktemp(side)),
                              train_dataset=Dataset.from_list([{"prompt": "a b"}] * B), processing_class=tokenizer)
        trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before compute_loss
        assert trainer.ref_model is None  # peft: the reference is the adapters switched off
        built[side] = (trainer, model, config_cls)
    return built


def _configure(trainer, config) -> None:
    trainer.args = config
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = (
        config.loss_type, config.importance_sampling_level, config.beta)


def _loss_and_grads(trainer, model, batch: dict):
    inputs = {k: v for k, v in batch.items() if not k.startswith("_")}
    with torch.no_grad():  # old and reference log-probs a little off the current policy: ratios and KL are not trivial
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logps = trainer._get_per_token_logps_and_entropies(model, ids, mask, COMPLETION)[0]
    inputs["old_per_token_logps"] = logps + batch["_noise"][0]
    if trainer.beta:
        inputs["ref_per_token_logps"] = logps + batch["_noise"][1]
    model.train()
    model.zero_grad()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("loss_type,level,beta", CASES)
def test_a_steps_loss_and_gradients_equal_trls_own(models, trainers, loss_type, level, beta):
    ours_t, ours, _ = trainers["ours"]
    trl_t, plain, _ = trainers["trl"]
    config, trl_config = trainers["configs"][(loss_type, level, beta)]
    # our GRPOConfig passes them through unchanged
    assert (config.loss_type, config.importance_sampling_level, config.beta) == (loss_type, level, beta)
    _configure(ours_t, config)
    _configure(trl_t, trl_config)
    batch = _batch(len(models[2]))
    loss, grads = _loss_and_grads(ours_t, ours, batch)
    expected, expected_grads = _loss_and_grads(trl_t, plain, batch)
    assert loss.abs() > 1e-4  # a loss that says something
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    assert grads.keys() == expected_grads.keys() and len(grads) == 2 * 7 * 2  # every LoRA A and B of 2 layers
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-3, atol=1e-6, msg=name)
    if beta:
        torch.testing.assert_close(torch.tensor(ours_t._metrics["train"]["kl"][-1]),
                                   torch.tensor(trl_t._metrics["train"]["kl"][-1]), rtol=1e-4, atol=1e-7)
