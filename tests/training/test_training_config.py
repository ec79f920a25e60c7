"""`unsloth train` configs: TOML and YAML read the same, overrides apply, mistakes get clear errors."""

from __future__ import annotations

import pytest

from unsloth.training.config import ConfigError, apply_override, from_dict, load_config

TOML = """
output_dir = "out"
[model]
name = "org/model"
max_seq_length = 1024
load_in_4bit = true
[dataset]
name = "data/train.jsonl"
[lora]
r = 32
alpha = 64
[training]
learning_rate = 1e-4
max_steps = 50
"""

YAML = """
output_dir: out
model: {name: org/model, max_seq_length: 1024, load_in_4bit: true}
dataset: {name: data/train.jsonl}
lora: {r: 32, alpha: 64}
training: {learning_rate: 1.0e-4, max_steps: 50}
"""


def test_toml_and_yaml_give_the_same_config(tmp_path):
    (tmp_path / "c.toml").write_text(TOML)
    (tmp_path / "c.yaml").write_text(YAML)
    toml, yaml = load_config(tmp_path / "c.toml"), load_config(tmp_path / "c.yaml")
    assert toml == yaml
    assert toml.model.load_in_4bit and toml.lora.r == 32 and toml.lora.dropout == 0.0
    assert toml.training == {"learning_rate": 1e-4, "max_steps": 50}
    assert toml.gradient_checkpointing == "unsloth"


def test_overrides_win_over_the_file(tmp_path):
    (tmp_path / "c.toml").write_text(TOML)
    config = load_config(tmp_path / "c.toml", ["training.max_steps=7", "lora.r=8", "model.name=other/model",
                                               "lora.target_modules=[q_proj, v_proj]", "packing=true"])
    assert config.training["max_steps"] == 7 and config.lora.r == 8 and config.model.name == "other/model"
    assert config.lora.target_modules == ["q_proj", "v_proj"] and config.packing is True


@pytest.mark.parametrize("text, value", [
    ("2e-4", 2e-4), ("1e-05", 1e-5), ("0.5", 0.5), ("10", 10), ("true", True), ('"7"', "7"),
    ("[q_proj, v_proj]", ["q_proj", "v_proj"]), ('["a", "b"]', ["a", "b"]), ("out/checkpoint-2", "out/checkpoint-2"),
])
def test_command_line_values_read_as_written(text, value):
    from unsloth.training.config import parse_value

    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_yaml_reads_exponent_numbers_as_toml_does(tmp_path):
    (tmp_path / "c.yaml").write_text("model: {name: m}\ndataset: {name: d}\n"
                                     "training: {learning_rate: 2e-4, weight_decay: 1.0e-2, max_steps: 10}\n")
    (tmp_path / "c.toml").write_text('model = {name = "m"}\ndataset = {name = "d"}\n'
                                     "training = {learning_rate = 2e-4, weight_decay = 1.0e-2, max_steps = 10}\n")
    assert load_config(tmp_path / "c.yaml").training == load_config(tmp_path / "c.toml").training == {
        "learning_rate": 2e-4, "weight_decay": 1e-2, "max_steps": 10}


def test_the_learning_rate_flag_reaches_the_trainer_as_a_number(tmp_path):
    # --learning-rate 1e-5 becomes the override text "training.learning_rate=1e-05" (no decimal point).
    from unsloth.training.sft import sft_arguments

    (tmp_path / "c.toml").write_text(TOML)
    config = load_config(tmp_path / "c.toml", [f"training.learning_rate={1e-5}"])
    assert sft_arguments(config, bf16=False, fp16=False).learning_rate == 1e-5


@pytest.mark.parametrize("raw, message", [
    ({"dataset": {"name": "d.jsonl"}}, "model: required"),
    ({"model": {"name": "m"}}, "dataset: required"),
    ({"model": {"nme": "m"}, "dataset": {"name": "d"}}, "model.nme: unknown key (did you mean 'name'?)"),
    ({"model": {"name": "m", "max_seq_length": "long"}, "dataset": {"name": "d"}},
     "model.max_seq_length: expected a whole number, got 'long'"),
    ({"model": {"name": "m", "load_in_4bit": "yes"}, "dataset": {"name": "d"}},
     "model.load_in_4bit: expected true or false"),
    ({"model": {"name": "m", "load_in_4bit": True, "load_in_8bit": True}, "dataset": {"name": "d"}},
     "choose one"),
    ({"model": {"name": "m"}, "dataset": {"name": "d"}, "lora": None}, "lora: missing"),
    ({"model": {"name": "m"}, "dataset": {"name": "d"}, "gradient_checkpointing": "sometimes"},
     "gradient_checkpointing: 'sometimes' is not one of"),
    ({"model": {"name": "m"}, "dataset": {"name": "d"}, "lora": {"target_modules": "q_proj"}},
     "lora.target_modules: expected a list"),
    ({"model": {"name": "m"}, "dataset": {"name": "d"}, "distributed": "fsdp2"},
     "distributed = 'fsdp2': not a way to train on several GPUs (did you mean 'fsdp'?)"),
    ({"model": {"name": "m"}, "dataset": {"name": "d"}, "distributed": "fsdp", "method": "dpo"},
     "method = 'dpo' is not sharded yet"),
    ({"model": {"name": "m", "load_in_8bit": True}, "dataset": {"name": "d"}, "distributed": "fsdp"},
     "8-bit weights (load_in_8bit) cannot be sharded"),
])
def test_mistakes_are_named(raw, message):
    with pytest.raises(ConfigError, match=None) as error:
        from_dict(raw)
    assert message in str(error.value)


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_distributed_reads_both_ways_and_defaults_to_ddp(distributed):
    raw = {"model": {"name": "m", "load_in_4bit": True}, "dataset": {"name": "d"}}
    assert from_dict(raw).distributed == "ddp"
    assert from_dict({**raw, "distributed": distributed}).distributed == distributed


def test_file_problems_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "c.ini").write_text("x")
    with pytest.raises(ConfigError, match=r"\.toml, \.yaml or \.yml"):
        load_config(tmp_path / "c.ini")
    (tmp_path / "bad.toml").write_text("[model\nname = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_override({}, "training.max_steps")


def test_training_keys_are_checked_against_trl(tmp_path):
    from unsloth.training.sft import sft_arguments

    config = from_dict({"model": {"name": "m"}, "dataset": {"name": "d"}, "output_dir": str(tmp_path),
                        "training": {"learning_rat": 1e-4}})
    with pytest.raises(ConfigError, match="training.learning_rat: not a training argument .did you mean 'learning_rate'"):
        sft_arguments(config, bf16=False, fp16=False)
    config.training = {"max_steps": "abc"}
    with pytest.raises(ConfigError, match="training.max_steps: expected a whole number, got 'abc'"):
        sft_arguments(config, bf16=False, fp16=False)
    config.training = {"lr_scheduler_type": "wobbly"}
    with pytest.raises(ConfigError, match="training: TRL's SFTConfig refuses these settings: wobbly"):
        sft_arguments(config, bf16=False, fp16=False)
    config.training = {"learning_rate": 3e-4, "max_steps": 5}
    args = sft_arguments(config, bf16=False, fp16=False)
    assert args.learning_rate == 3e-4 and args.max_steps == 5 and args.max_length == 2048


def test_dataset_problems_are_named(tmp_path):
    from unsloth.training.config import DatasetConfig
    from unsloth.training.sft import load_dataset_from

    with pytest.raises(ConfigError, match="does not exist"):
        load_dataset_from(DatasetConfig(name=str(tmp_path / "nope.jsonl")))
    (tmp_path / "odd.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(ConfigError, match="none of the shapes SFT reads"):
        load_dataset_from(DatasetConfig(name=str(tmp_path / "odd.jsonl")))
    (tmp_path / "t.csv").write_text("body\nhello\nworld\n")
    data = load_dataset_from(DatasetConfig(name=str(tmp_path / "t.csv"), text_field="body", limit=1))
    assert data.column_names == ["text"] and len(data) == 1


def test_cli_reports_config_errors_with_exit_code_2(tmp_path, capsys):
    from unsloth.cli import main

    (tmp_path / "c.toml").write_text('[model]\nname = "m"\n')
    assert main(["train", str(tmp_path / "c.toml")]) == 2
    assert "dataset: required" in capsys.readouterr().err
    assert main(["train"]) == 2
    assert "unsloth train --demo" in capsys.readouterr().err


def test_resume_problems_are_named_before_loading(tmp_path):
    from unsloth.training.sft import check_before_loading

    config = from_dict({"model": {"name": "m"}, "dataset": {"name": "d"}, "output_dir": str(tmp_path),
                        "resume": True})
    with pytest.raises(ConfigError, match="no complete checkpoint-\\* folder"):
        check_before_loading(config)
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "adapter_model.safetensors").write_bytes(b"weights")
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2, "log_hi')  # cut short
    with pytest.raises(ConfigError, match="no complete checkpoint.*cut off while being written"):
        check_before_loading(config)
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    check_before_loading(config)
    config.resume = str(tmp_path / "checkpoint-9")
    with pytest.raises(ConfigError, match="checkpoint-9 is not a checkpoint folder.*checkpoint-2"):
        check_before_loading(config)
    config.resume = str(tmp_path / "checkpoint-2")
    check_before_loading(config)


def test_cli_names_a_model_that_cannot_be_loaded(tmp_path, capsys):
    from unsloth.cli import main

    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "c.toml").write_text(f'[model]\nname = "{tmp_path / "no-model"}"\n'
                                     f'[dataset]\nname = "{tmp_path / "d.jsonl"}"\n')
    assert main(["train", str(tmp_path / "c.toml"), "--output-dir", str(tmp_path / "out")]) == 2
    assert "model.name: could not load" in capsys.readouterr().err
