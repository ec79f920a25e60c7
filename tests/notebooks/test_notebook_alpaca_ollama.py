"""The Llama 3.1 Alpaca and Llama 3 Ollama notebooks' cells on a tiny random Llama saved in bfloat16.

Alpaca prompt + EOS -> SFTTrainer(tokenizer=, dataset_text_field=, max_seq_length=, packing=,
args=TrainingArguments(fp16=not is_bfloat16_supported(), ...)) -> train -> generate with a
BatchEncoding and a streamer -> save_pretrained_merged (the checkpoint's dtype) -> three GGUF
exports into one folder (q8_0, f16, q4_k_m) -> the Modelfile and tokenizer._ollama_modelfile.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # training, then three GGUF exports validated through llama.cpp
import torch

from tiny_notebook_models import alpaca_rows, losses_of, write_model

ALPACA = """Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.

### Instruction:
{}

### Input:
{}

### Response:
{}"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import os

    from datasets import Dataset

    os.environ["UNSLOTH_KERNELS"] = "0"  # the loop is under test here; the kernels are covered elsewhere
    root = tmp_path_factory.mktemp("alpaca")
    from unsloth import FastLanguageModel, is_bfloat16_supported

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=write_model(root / "llama-3-8b-bnb-4bit", "llama", dtype="bfloat16"), max_seq_length=128,
        dtype=None, load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, lora_dropout=0, bias="none",
                                             use_gradient_checkpointing="unsloth", random_state=3407)
    EOS_TOKEN = tokenizer.eos_token

    def formatting_prompts_func(examples):
        texts = [ALPACA.format(i, x, o) + EOS_TOKEN
                 for i, x, o in zip(examples["instruction"], examples["input"], examples["output"])]
        return {"text": texts}

    dataset = Dataset.from_list(alpaca_rows()).map(formatting_prompts_func, batched=True)
    from transformers import TrainingArguments
    from trl import SFTTrainer

    trainer = SFTTrainer(
        model=model, tokenizer=tokenizer, train_dataset=dataset, dataset_text_field="text", max_seq_length=128,
        dataset_num_proc=1, packing=False,
        args=TrainingArguments(per_device_train_batch_size=2, gradient_accumulation_steps=2, warmup_steps=1,
                               max_steps=8, learning_rate=2e-2, fp16=not is_bfloat16_supported(),
                               bf16=is_bfloat16_supported(), logging_steps=1, optim="adamw_torch",
                               weight_decay=0.01, lr_scheduler_type="linear", seed=3407,
                               output_dir=str(root / "outputs"), report_to="none"))
    trainer.train()
    yield root, model, tokenizer, trainer
    os.environ.pop("UNSLOTH_KERNELS", None)


def test_trainer_took_the_notebook_arguments(trained):
    from trl import SFTConfig

    _, _, tokenizer, trainer = trained
    assert isinstance(trainer.args, SFTConfig) and trainer.args.max_length == 128
    assert trainer.args.fp16 is False  # fp16=True asked on a CPU: float32 instead, with a warning
    assert trainer.args.gradient_checkpointing is False  # ours is on already
    losses = losses_of(trainer)
    assert len(losses) == 8 and losses[-1] < losses[0]
    row = trainer.train_dataset[0]["input_ids"]
    assert row.count(tokenizer.bos_token_id) == 1 and row[-1] == tokenizer.eos_token_id  # EOS not doubled


def test_generate_takes_a_batch_encoding_positionally(trained):
    from transformers import TextStreamer

    from unsloth import FastLanguageModel

    _, model, tokenizer, _ = trained
    FastLanguageModel.for_inference(model)
    inputs = tokenizer([ALPACA.format("Name the capital of France.", "", "")], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, use_cache=True)
    again = model.generate(inputs, streamer=TextStreamer(tokenizer), max_new_tokens=4, do_sample=False,
                           pad_token_id=tokenizer.eos_token_id)
    assert torch.equal(out, again)


def test_merged_16bit_keeps_the_checkpoints_dtype(trained):
    from safetensors import safe_open

    root, model, tokenizer, _ = trained
    assert next(model.parameters()).dtype == torch.float32  # dtype=None on a CPU computes in float32
    model.save_pretrained_merged(str(root / "merged"), tokenizer, save_method="merged_16bit")
    with safe_open(str(root / "merged" / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {torch.bfloat16}


def test_three_gguf_exports_into_one_folder_keep_each_others_files(trained):
    pytest.importorskip("llama_cpp")
    root, model, tokenizer, _ = trained
    out = root / "model"
    model.save_pretrained_gguf(str(out), tokenizer, quantization_method="q8_0")
    model.save_pretrained_gguf(str(out), tokenizer, quantization_method="f16")
    result = model.save_pretrained_gguf(str(out), tokenizer, quantization_method="q4_k_m")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["Modelfile", "model.F16.gguf", "model.Q4_K_M.gguf", "model.Q8_0.gguf"], names
    assert result.validations["f16"].passed  # the reference reproduces the model's greedy tokens
    assert tokenizer._ollama_modelfile == (out / "Modelfile").read_text()
    assert tokenizer._ollama_modelfile.startswith("FROM ./model.Q4_K_M.gguf")


def test_push_to_hub_offline_is_a_clear_error_and_writes_nothing(trained, monkeypatch, tmp_path):
    from unsloth.notebook.hub import HubError

    _, model, tokenizer, _ = trained
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HubError, match="HF_HUB_OFFLINE"):
        model.push_to_hub_merged("me/model", tokenizer, save_method="merged_16bit", token="x")
    with pytest.raises(HubError, match="nothing was written"):
        model.push_to_hub_gguf("me/model", tokenizer, quantization_method=["q4_k_m", "q8_0"], token="x")
    assert list(tmp_path.iterdir()) == []
