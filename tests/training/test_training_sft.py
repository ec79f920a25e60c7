"""SFT end to end on a tiny model on the CPU: LoRA, 4-bit QLoRA (bitsandbytes' CPU path), resume."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_setup import write_dataset, write_tiny_model
from unsloth.training.config import from_dict
from unsloth.training.sft import train


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return write_tiny_model(root / "model"), write_dataset(root / "data.jsonl")


def _config(tiny, output_dir, checkpointing=False, **training):
    model, data = tiny
    return from_dict({
        "model": {"name": model, "max_seq_length": 32, "dtype": "float32"},
        "dataset": {"name": data},
        "lora": {"r": 8, "alpha": 16},
        "output_dir": str(output_dir),
        "gradient_checkpointing": checkpointing,
        "training": {"max_steps": 3, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                     "learning_rate": 1e-2, "logging_steps": 1, "save_strategy": "no", "seed": 0, **training},
    })


@pytest.mark.slow
def test_lora_sft_trains_patched_and_saves(tiny, tmp_path):
    # The Triton kernels run here (a GPU, or the interpreter on the CPU, which is slow: few small steps).
    result = train(_config(tiny, tmp_path, checkpointing=True), echo=lambda _: None)
    report = result.model.get_base_model()._unsloth_patches
    assert report.skipped is None and report.rms_norm and report.lora["MLP"] == 2
    assert len(result.losses) == 3 and result.losses[-1] < result.losses[0]
    log = [json.loads(line) for line in (tmp_path / "loss_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log if "loss" in r] == pytest.approx(result.losses)
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_qlora_sft_through_bitsandbytes_cpu(tiny, tmp_path):
    pytest.importorskip("bitsandbytes")
    config = _config(tiny, tmp_path, gradient_accumulation_steps=1)
    config.model.load_in_4bit = True
    config.save_merged = True
    result = train(config, echo=lambda _: None)
    base = result.model.get_base_model()
    assert type(base.model.layers[0].mlp.gate_proj.base_layer).__name__ == "Linear4bit"
    assert result.losses[-1] < result.losses[0]
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(result.merged_dir)  # plain 16/32-bit weights
    assert not hasattr(merged.config, "quantization_config")
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        expected = result.model(input_ids=ids).logits
        # The 4-bit model runs bitsandbytes' CPU 4-bit matmul, which differs from the exactly
        # dequantized weights the merge writes (a few 1e-4 here): hence 1e-3, not fp32's.
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_resume_from_checkpoint_gives_the_same_losses(tiny, tmp_path, monkeypatch):
    from transformers import TrainerCallback

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # the Trainer's checkpoints are under test, not the kernels

    class StopAt(TrainerCallback):  # an interruption right after the step-3 checkpoint
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                control.should_training_stop = True

    steps = {"save_strategy": "steps", "save_steps": 3, "max_steps": 6}
    whole = train(_config(tiny, tmp_path / "whole", **steps), echo=lambda _: None)
    train(_config(tiny, tmp_path / "split", **steps), echo=lambda _: None, callbacks=[StopAt()])
    resumed_config = _config(tiny, tmp_path / "split", **steps)
    resumed_config.resume = True
    resumed = train(resumed_config, echo=lambda _: None)
    assert len(resumed.losses) == 3
    assert resumed.losses == pytest.approx(whole.losses[3:], rel=1e-4)


@pytest.mark.slow
def test_padding_free_packing_trains_without_pad_tokens(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # TRL's packing and the attention masks are under test
    config = _config(tiny, tmp_path)
    config.packing = True
    config.model.max_seq_length = 96  # room for several ~20-token examples per row
    result = train(config, echo=lambda _: None)
    rows = result.trainer.train_dataset
    assert len(rows) < 24  # the 24 short examples share rows
    batch = result.trainer.data_collator([rows[0], rows[1]])
    assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch  # one flat row, positions restart
    assert (batch["position_ids"][0] == 0).sum() > 2
    assert result.losses[-1] < result.losses[0]


def test_adapters_name_a_local_base_model_by_its_absolute_path(tiny, tmp_path, monkeypatch):
    # Export reads the base model from adapter_config.json, from whatever directory it runs in.
    from pathlib import Path

    from unsloth.notebook.fast_model import FastLanguageModel

    model_dir = Path(tiny[0])
    monkeypatch.chdir(model_dir.parent)
    model, _ = FastLanguageModel.from_pretrained(model_dir.name, max_seq_length=32, dtype="float32",
                                                 load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    model.save_pretrained(str(tmp_path / "lora"))
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir.resolve())


def test_loss_log_restarts_with_a_fresh_run_and_continues_a_resumed_one(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from unsloth.training.sft import _callbacks

    log = tmp_path / "loss_log.jsonl"
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", disable_tqdm=True)
    progress = _callbacks(str(tmp_path), echo=lambda _: None, losses=[])()
    for step, loss in ((1, 3.0), (2, 2.0), (3, 1.0)):
        progress.on_log(args, TrainerState(global_step=step, max_steps=3), TrainerControl(), logs={"loss": loss})
    progress.on_train_begin(args, TrainerState(global_step=2, max_steps=3), TrainerControl())  # resumed at 2
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    progress.on_train_begin(args, TrainerState(global_step=0, max_steps=3), TrainerControl())  # a new run
    assert log.read_text() == ""
