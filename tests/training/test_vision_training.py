"""A few SFT steps on images + captions through SFTTrainer, as the vision notebooks write them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny vision families

from tiny_vision import VISION_FAMILIES, images, save_tiny_vision  # noqa: E402

pytest.importorskip("PIL")


@pytest.mark.slow
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_a_few_steps_lower_the_loss(family, tmp_path, monkeypatch):
    from unsloth import FastVisionModel  # first, as in the notebooks: TRL's trainers then take their keywords
    from unsloth.trainer import UnslothVisionDataCollator
    from trl import SFTConfig, SFTTrainer

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # the kernels are checked in tests/models; this is the loop
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = FastVisionModel.from_pretrained(save_tiny_vision(family, tmp_path / "base"),
                                                           load_in_4bit=False, dtype="float32")
        model = FastVisionModel.get_peft_model(model, finetune_vision_layers=True, finetune_language_layers=True,
                                               r=8, lora_alpha=16, lora_dropout=0, bias="none", random_state=3407)
        pictures = images(4)
        data = [{"messages": [
            {"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "image", "image": pictures[i]}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"t{20 + i} t{30 + i}"}]}]} for i in range(4)]
        FastVisionModel.for_training(model)
        trainer = SFTTrainer(
            model=model, tokenizer=tokenizer, data_collator=UnslothVisionDataCollator(model, tokenizer),
            train_dataset=data,
            args=SFTConfig(per_device_train_batch_size=2, max_steps=10, learning_rate=1e-2, logging_steps=1,
                           report_to="none", output_dir=str(tmp_path / "out"), remove_unused_columns=False,
                           dataset_text_field="", dataset_kwargs={"skip_prepare_dataset": True},
                           max_length=512, save_strategy="no", seed=0, bf16=False, fp16=False))
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
