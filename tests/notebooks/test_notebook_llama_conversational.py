"""The Llama 3.2 conversational notebook's cells, in order, with its keywords, on a tiny random Llama.

load -> LoRA -> llama-3.1 template -> standardize_sharegpt -> formatting map -> SFTTrainer(tokenizer=,
dataset_text_field=, max_seq_length=, data_collator=DataCollatorForSeq2Seq, packing=, args=SFTConfig)
-> train_on_responses_only(trainer) -> train -> inference with a TextStreamer -> save adapters ->
save merged -> GGUF.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # the Triton interpreter runs our kernels on the CPU: minutes, not seconds
import torch

from tiny_notebook_models import losses_of, sharegpt_rows, write_model


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    from datasets import Dataset

    root = tmp_path_factory.mktemp("llama_conv")
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=write_model(root / "Llama-3.2-3B-Instruct", "llama"), max_seq_length=128, dtype=None,
        load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(
        model, r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=16, lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth", random_state=3407,
        use_rslora=False, loftq_config=None)

    from unsloth.chat_templates import get_chat_template, standardize_sharegpt

    tokenizer = get_chat_template(tokenizer, chat_template="llama-3.1")

    def formatting_prompts_func(examples):
        convos = examples["conversations"]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False) for c in convos]
        return {"text": texts}

    dataset = standardize_sharegpt(Dataset.from_list(sharegpt_rows()))
    dataset = dataset.map(formatting_prompts_func, batched=True)

    from transformers import DataCollatorForSeq2Seq
    from trl import SFTConfig, SFTTrainer

    trainer = SFTTrainer(
        model=model, tokenizer=tokenizer, train_dataset=dataset, dataset_text_field="text", max_seq_length=128,
        data_collator=DataCollatorForSeq2Seq(tokenizer=tokenizer), packing=False,
        args=SFTConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, warmup_steps=1, max_steps=4,
                       learning_rate=2e-2, logging_steps=1, optim="adamw_torch", weight_decay=0.001,
                       lr_scheduler_type="linear", seed=3407, output_dir=str(root / "outputs"), report_to="none"))
    from unsloth.chat_templates import train_on_responses_only

    trainer = train_on_responses_only(trainer)
    return root, model, tokenizer, dataset, trainer


def test_the_template_renders_llama_31s_own_text(notebook):
    _, _, tokenizer, dataset, _ = notebook
    text = dataset[0]["text"]
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>")
    assert "<|start_header_id|>user<|end_header_id|>\n\nName the capital of France.<|eot_id|>" in text
    assert dataset[0]["conversations"][0] == {"role": "user", "content": "Name the capital of France."}


def test_one_bos_and_the_mask_is_in_the_dataset(notebook):
    _, _, tokenizer, _, trainer = notebook
    row = trainer.train_dataset[0]
    assert row["input_ids"].count(tokenizer.bos_token_id) == 1 and row["input_ids"][0] == tokenizer.bos_token_id
    kept = tokenizer.decode([x for x in row["labels"] if x != -100])
    assert kept == "Paris.<|eot_id|>"  # only the reply (and its end of turn) is trained


def test_trains_with_our_fused_loss_and_generates_with_a_streamer(notebook, monkeypatch):
    import unsloth_kernels.cross_entropy as ce

    _, model, tokenizer, _, trainer = notebook
    calls = []
    real = ce.fused_linear_cross_entropy
    monkeypatch.setattr(ce, "fused_linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert trainer.args.bf16 is False and trainer.args.fp16 is False  # the CPU starts
    stats = trainer.train()
    losses = losses_of(trainer)
    assert len(calls) == 4 * 2, "SFTTrainer did not run our fused cross-entropy"
    assert losses[-1] < losses[0]
    assert stats.metrics["train_runtime"] > 0

    from transformers import TextStreamer

    from unsloth import FastLanguageModel

    FastLanguageModel.for_inference(model)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Name the capital of France."}],
                                           tokenize=True, add_generation_prompt=True, return_tensors="pt")
    streamed = []

    class Capture(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            streamed.append(text)

    # apply_chat_template(tokenize=True, return_tensors="pt") is the ids tensor, as on transformers 4, on 5
    # too (our tokenizers' return_dict default); the notebook passes it as input_ids
    prompt = inputs
    assert torch.is_tensor(prompt) and prompt.dim() == 2
    out = model.generate(input_ids=inputs, streamer=Capture(tokenizer, skip_prompt=True), max_new_tokens=6,
                         do_sample=False, use_cache=True)
    assert out.shape[1] > prompt.shape[1] and torch.equal(out[:, :prompt.shape[1]], prompt)
    assert "".join(streamed).strip()


def test_saves_adapters_merged_and_gguf(notebook):
    from transformers import AutoModelForCausalLM

    root, model, tokenizer, _, _ = notebook
    model.save_pretrained(root / "lora_model")
    tokenizer.save_pretrained(root / "lora_model")
    assert (root / "lora_model" / "adapter_model.safetensors").is_file()
    model.save_pretrained_merged(str(root / "merged"), tokenizer, save_method="merged_16bit")
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)
    ids = torch.tensor([tokenizer("Name the capital of France.")["input_ids"]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()
        actual = merged(input_ids=ids).logits
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)
