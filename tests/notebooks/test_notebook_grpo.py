"""The Qwen2.5 GRPO notebook's cells on a tiny random Qwen2: GRPOConfig with its arguments (warmup_ratio,
max_prompt_length, batch 1 with num_generations 4), GRPOTrainer, then fast_generate without and with
the saved LoRA (save_lora / load_lora)."""

from __future__ import annotations

import pytest
import torch

from tiny_notebook_models import write_model

pytestmark = pytest.mark.slow  # generation and a GRPO step on the CPU


def test_grpo_notebook(tmp_path, monkeypatch):
    from datasets import Dataset

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    from unsloth import FastLanguageModel
    from unsloth.chat_templates import get_chat_template

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=write_model(tmp_path / "Qwen2.5-3B-Instruct", "qwen2"), max_seq_length=128, load_in_4bit=False,
        fast_inference=True, max_lora_rank=8, gpu_memory_utilization=0.9)
    tokenizer = get_chat_template(tokenizer, chat_template="qwen-2.5")
    model = FastLanguageModel.get_peft_model(
        model, r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=8, use_gradient_checkpointing="unsloth", random_state=3407)
    dataset = Dataset.from_list([{"prompt": [{"role": "system", "content": "Answer briefly."},
                                             {"role": "user", "content": q}], "answer": a}
                                 for q, a in [("What is 2 + 2?", "4"), ("What is 3 + 4?", "7")] * 2])

    def correctness_reward_func(prompts, completions, answer, **kwargs):
        return [float(a in c[0]["content"]) for c, a in zip(completions, answer)]

    def length_reward_func(completions, **kwargs):
        return [-len(c[0]["content"]) / 100 for c in completions]

    from trl import GRPOConfig, GRPOTrainer

    training_args = GRPOConfig(
        use_vllm=False, learning_rate=5e-3, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1, warmup_ratio=0.1,
        lr_scheduler_type="cosine", optim="adamw_torch", logging_steps=1, per_device_train_batch_size=1,
        gradient_accumulation_steps=1, num_generations=4, max_prompt_length=64, max_completion_length=6,
        max_steps=2, save_steps=250, max_grad_norm=0.1, report_to="none", output_dir=str(tmp_path / "outputs"))
    # warmup_ratio: kept on transformers 4, a fractional warmup_steps on 5; a tenth of the run either way
    assert training_args.generation_batch_size == 4 and training_args.get_warmup_steps(100) == 10
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = GRPOTrainer(model=model, processing_class=tokenizer,
                          reward_funcs=[length_reward_func, correctness_reward_func], args=training_args,
                          train_dataset=dataset)
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)

    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False,
                                         add_generation_prompt=True)
    greedy = {"temperature": 0, "max_tokens": 5}
    base = model.fast_generate([text], sampling_params=greedy, lora_request=None)[0].outputs[0].text
    model.save_lora(str(tmp_path / "grpo_saved_lora"))
    assert (tmp_path / "grpo_saved_lora" / "adapter_model.safetensors").is_file()
    lora = model.load_lora(str(tmp_path / "grpo_saved_lora"))
    tuned = model.fast_generate(text, sampling_params=greedy, lora_request=lora)[0].outputs[0]
    with torch.no_grad():  # the LoRA answer is the trained model's own greedy answer
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        direct = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tuned.token_ids == direct[0, ids["input_ids"].shape[1]:].tolist()
    assert isinstance(base, str)
