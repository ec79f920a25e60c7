"""The Gemma 3, Mistral conversational and Qwen3 notebooks' cells, in order, with their keywords, on tiny
random models; Gemma 3 and Mistral with SentencePiece tokenizers (tokenizer.model), as released.

Gemma 3: FastModel -> get_peft_model(finetune_*_layers/modules) -> get_chat_template("gemma-3") ->
standardize_data_formats -> text without its <bos> -> SFTTrainer(args=SFTConfig(dataset_text_field=))
-> train_on_responses_only(instruction_part=, response_part=).
Mistral: FastLanguageModel -> get_chat_template("mistral", mapping=ShareGPT keys) -> map ->
SFTTrainer(tokenizer=, dataset_text_field=, max_seq_length=, args=TrainingArguments).
Qwen3: FastLanguageModel -> get_chat_template("qwen3") -> reasoning and plain rows -> SFTTrainer.
Then each: train (loss falls) -> generate with a TextStreamer -> save adapters -> save merged (same
logits) -> save GGUF (f16: its greedy tokens and tokenization validated against transformers).
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow  # training, then a GGUF export validated through llama.cpp
import torch

from tiny_notebook_models import QA, losses_of, sharegpt_rows, write_model

NOTEBOOKS = ("gemma3", "mistral", "qwen3")


def _rows_for(notebook: str, tokenizer):
    from datasets import Dataset

    if notebook == "gemma3":
        from unsloth.chat_templates import standardize_data_formats

        dataset = standardize_data_formats(Dataset.from_list(sharegpt_rows()))

        def formatting_prompts_func(examples):
            texts = [tokenizer.apply_chat_template(c, tokenize=False).removeprefix("<bos>")
                     for c in examples["conversations"]]
            return {"text": texts}

        return dataset.map(formatting_prompts_func, batched=True)
    if notebook == "mistral":
        dataset = Dataset.from_list(sharegpt_rows())  # from/value turns: the template's mapping reads them

        def formatting_prompts_func(examples):
            return {"text": [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False)
                             for c in examples["conversations"]]}

        return dataset.map(formatting_prompts_func, batched=True)
    reasoning = [[{"role": "user", "content": q}, {"role": "assistant", "content": f"<think>\nShort.\n</think>\n\n{a}"}]
                 for q, a in QA]
    plain = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QA]
    texts = tokenizer.apply_chat_template(reasoning + plain, tokenize=False)
    return Dataset.from_dict({"text": list(texts)})


@pytest.fixture(scope="module", params=NOTEBOOKS)
def notebook(request, tmp_path_factory):
    os.environ["UNSLOTH_KERNELS"] = "0"  # the cells are under test here; the kernels are covered elsewhere
    name = request.param
    root = tmp_path_factory.mktemp(name)
    from unsloth import FastLanguageModel, FastModel
    from unsloth.chat_templates import get_chat_template

    if name == "gemma3":
        folder = write_model(root / "gemma-3-4b-it", "gemma3_text", sentencepiece=True, query_pre_attn_scalar=16)
        model, tokenizer = FastModel.from_pretrained(model_name=folder, max_seq_length=128, load_in_4bit=False,
                                                     load_in_8bit=False, full_finetuning=False)
        model = FastModel.get_peft_model(model, finetune_vision_layers=False, finetune_language_layers=True,
                                         finetune_attention_modules=True, finetune_mlp_modules=True, r=8,
                                         lora_alpha=8, lora_dropout=0, bias="none", random_state=3407)
        tokenizer = get_chat_template(tokenizer, chat_template="gemma-3")
    else:
        family, hub_name = {"mistral": ("mistral", "mistral-7b-v0.3"), "qwen3": ("qwen3", "Qwen3-14B")}[name]
        folder = write_model(root / hub_name, family, sentencepiece=name == "mistral")
        model, tokenizer = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=128, dtype=None,
                                                             load_in_4bit=False)
        model = FastLanguageModel.get_peft_model(
            model, r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            lora_alpha=16, lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth", random_state=3407)
        if name == "mistral":
            tokenizer = get_chat_template(tokenizer, chat_template="mistral", map_eos_token=True,
                                          mapping={"role": "from", "content": "value", "user": "human",
                                                   "assistant": "gpt"})
        else:
            tokenizer = get_chat_template(tokenizer, chat_template="qwen3")
    dataset = _rows_for(name, tokenizer)

    from transformers import TrainingArguments
    from trl import SFTConfig, SFTTrainer

    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, warmup_steps=1, max_steps=8,
                  learning_rate=2e-2, logging_steps=1, optim="adamw_torch", weight_decay=0.01,
                  lr_scheduler_type="linear", seed=3407, output_dir=str(root / "outputs"), report_to="none")
    if name == "gemma3":
        trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset, eval_dataset=None,
                             args=SFTConfig(dataset_text_field="text", **common))
        from unsloth.chat_templates import train_on_responses_only

        trainer = train_on_responses_only(trainer, instruction_part="<start_of_turn>user\n",
                                          response_part="<start_of_turn>model\n")
    elif name == "mistral":
        trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset, dataset_text_field="text",
                             max_seq_length=128, dataset_num_proc=1, packing=False, args=TrainingArguments(**common))
    else:
        trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset, eval_dataset=None,
                             args=SFTConfig(dataset_text_field="text", **common))
    trainer.train()
    yield name, root, model, tokenizer, trainer
    os.environ.pop("UNSLOTH_KERNELS", None)


def test_one_bos_loss_falls_and_the_mask_is_in_the_dataset(notebook):
    name, _, _, tokenizer, trainer = notebook
    losses = losses_of(trainer)
    assert losses[-1] < losses[0], losses
    row = trainer.train_dataset[0]
    if tokenizer.bos_token_id is not None:
        assert row["input_ids"].count(tokenizer.bos_token_id) == 1 and row["input_ids"][0] == tokenizer.bos_token_id
    if name == "gemma3":  # only the reply (and its end of turn) is trained
        kept = tokenizer.decode([x for x in row["labels"] if x != -100])
        assert kept.startswith(QA[0][1]) and "<start_of_turn>user" not in kept


def test_generates_with_a_streamer(notebook):
    from transformers import TextStreamer

    from unsloth import FastLanguageModel

    _, _, model, tokenizer, _ = notebook
    FastLanguageModel.for_inference(model)
    messages = [{"role": "user", "content": QA[0][0]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    streamed = []

    class Capture(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            streamed.append(text)

    out = model.generate(**inputs, streamer=Capture(tokenizer, skip_prompt=True), max_new_tokens=6, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1] and "".join(streamed)


def test_saves_adapters_merged_and_gguf(notebook):
    from transformers import AutoModelForCausalLM

    name, root, model, tokenizer, _ = notebook
    model.save_pretrained(root / "lora_model")
    tokenizer.save_pretrained(root / "lora_model")
    assert (root / "lora_model" / "adapter_model.safetensors").is_file()
    model.save_pretrained_merged(str(root / "merged"), tokenizer, save_method="merged_16bit")
    assert (root / "merged" / "tokenizer.model").is_file() == (name != "qwen3")  # SentencePiece families
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)
    ids = torch.tensor([tokenizer(QA[0][0])["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits.float(),
                                   atol=2e-2, rtol=2e-2)
    result = model.save_pretrained_gguf(str(root / "gguf"), tokenizer, quantization_method="f16")
    report = result.validations["f16"]
    assert report.passed and report.tokenizer_mismatches == [], report.summary()
    assert (root / "gguf" / "Modelfile").is_file()
