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


def _write_vision_data(folder: Path, rows: int = 4) -> Path:
    """A jsonl of image + text conversations with the images as PNG files beside it (relative paths),
    half inline, half as placeholders with an `images` list."""
    import json

    (folder / "pictures").mkdir(parents=True)
    lines = []
    for i, picture in enumerate(images(rows)):
        picture.save(folder / "pictures" / f"{i}.png")
        image = {"type": "image", "image": f"pictures/{i}.png"} if i % 2 else {"type": "image"}
        row = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "t5"}]},
                            {"role": "assistant", "content": [{"type": "text", "text": f"t{20 + i} t{30 + i}"}]}]}
        if not i % 2:
            row["images"] = [f"pictures/{i}.png"]
        lines.append(json.dumps(row))
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "train.jsonl"


def _vision_config(tmp_path: Path, family: str = "qwen2_5_vl", **lora) -> Path:
    model = save_tiny_vision(family, tmp_path / "base")
    data = _write_vision_data(tmp_path / "data")
    lora_lines = "".join(f"{k} = {str(v).lower()}\n" for k, v in lora.items())
    config = tmp_path / "vision.toml"
    config.write_text(f'''output_dir = "{tmp_path / 'out'}"
gradient_checkpointing = false
save_merged = true
[model]
name = "{model}"
max_seq_length = 256
dtype = "float32"
[dataset]
name = "{data}"
[lora]
r = 8
alpha = 16
{lora_lines}[training]
max_steps = 10
learning_rate = 1e-2
per_device_train_batch_size = 2
gradient_accumulation_steps = 1
seed = 0
''')
    return config


@pytest.mark.slow
def test_unsloth_train_config_fine_tunes_a_vision_model(tmp_path, monkeypatch):
    """`unsloth train CONFIG` on a vision-language model and a jsonl of image + text chats with local
    image paths: FastVisionModel's loader and the vision collator, falling loss, adapters on both
    towers, and a merged model that reloads with its processor."""
    from transformers import AutoModelForImageTextToText

    from unsloth.cli import main
    from unsloth.models.vision import load_processor

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    monkeypatch.chdir(tmp_path)  # the image paths resolve against the dataset's folder, not here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", str(_vision_config(tmp_path))]) == 0
    finally:
        torch.set_num_threads(threads)
    import json

    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "loss_log.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    adapter = json.loads((tmp_path / "out" / "lora" / "adapter_config.json").read_text())
    assert "visual" in adapter["target_modules"] and "language_model" in adapter["target_modules"]
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "out" / "merged")
    assert merged.config.model_type == "qwen2_5_vl"
    assert load_processor(str(tmp_path / "out" / "merged")).image_processor is not None


def test_vision_switches_choose_the_towers_in_a_config(tmp_path, monkeypatch):
    from unsloth.training.config import load_config
    from unsloth.training.sft import is_vision_config, load_model

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    config = load_config(_vision_config(tmp_path, finetune_vision_layers=False))
    assert is_vision_config(config)
    model, processor = load_model(config, vision=True)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and not any("visual" in n for n in trained) and processor.image_processor is not None


def test_vision_configs_are_checked_before_loading(tmp_path):
    """A missing image, settings that cannot go with a vision model, and vision switches on a text
    model: each a ConfigError naming the problem, before the model loads."""
    from tiny_setup import write_dataset, write_tiny_model

    from unsloth.training.config import ConfigError, load_config
    from unsloth.training.sft import is_vision_config, train

    path = _vision_config(tmp_path)
    (tmp_path / "data" / "pictures" / "1.png").unlink()
    with pytest.raises(ConfigError, match=r"row 2: image 'pictures/1.png' not found"):
        train(load_config(path))
    with pytest.raises(ConfigError, match="packing"):
        is_vision_config(load_config(path, ["packing=true"]))
    with pytest.raises(ConfigError, match="sft"):
        is_vision_config(load_config(path, ["method=dpo"]))
    with pytest.raises(ConfigError, match="both false"):
        load_config(path, ["lora.finetune_vision_layers=false", "lora.finetune_language_layers=false"])
    text = load_config(path, [f"model.name={write_tiny_model(tmp_path / 'text')}",
                              f"dataset.name={write_dataset(tmp_path / 'text.jsonl')}",
                              "lora.finetune_vision_layers=true"])
    with pytest.raises(ConfigError, match="not a vision-language model"):
        is_vision_config(text)
