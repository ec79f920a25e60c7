"""`method = "dpo" | "orpo" | "kto" | "simpo"` in `unsloth train` configs: checked, with clear errors."""

from __future__ import annotations

import json

import pytest

from unsloth.training.config import ConfigError, from_dict

BASE = {"model": {"name": "org/model"}, "dataset": {"name": "data.jsonl"}}


def config(**top):
    return from_dict({**BASE, **top})


def test_method_defaults_to_sft_and_takes_the_preference_methods():
    assert config().method == "sft"
    for method in ("dpo", "orpo", "kto", "simpo"):
        assert config(method=method).method == method


def test_a_misspelt_method_gets_did_you_mean():
    with pytest.raises(ConfigError, match=r"method = 'dop'.*did you mean 'dpo'"):
        config(method="dop")


def test_packing_is_refused_for_preference_methods():
    with pytest.raises(ConfigError, match="packing"):
        config(method="dpo", packing=True)


@pytest.mark.slow  # imports TRL
@pytest.mark.parametrize("method, option, trl_class", [
    ("dpo", "beta", "DPOConfig"), ("orpo", "beta", "ORPOConfig"), ("kto", "desirable_weight", "KTOConfig"),
    ("simpo", "simpo_gamma", "CPOConfig")])
def test_options_are_checked_against_the_methods_trl_config(method, option, trl_class):
    from unsloth.training.sft import sft_arguments

    args = sft_arguments(config(method=method, training={option: 0.5}), bf16=False, fp16=False)
    assert type(args).__name__ == trl_class and getattr(args, option) == 0.5
    if method == "simpo":
        assert args.loss_type == "simpo" and args.cpo_alpha == 0.0  # SimPO, not CPO, unless told
    with pytest.raises(ConfigError, match=rf"training.{option}x: not a training argument of method '{method}' "
                                          rf"\(did you mean '{option}'\?\)"):
        sft_arguments(config(method=method, training={option + "x": 0.5}), bf16=False, fp16=False)
    with pytest.raises(ConfigError, match=f"training.{option}"):
        sft_arguments(config(method=method, training={option: "high"}), bf16=False, fp16=False)


@pytest.mark.parametrize("method, row, missing", [
    ("dpo", {"prompt": "q", "chosen": "a"}, "'rejected'"),
    ("kto", {"prompt": "q", "chosen": "a", "rejected": "b"}, "'completion', 'label'"),
])
def test_missing_dataset_columns_are_named(method, row, missing, tmp_path):
    from unsloth.training.preference import METHODS
    from unsloth.training.sft import load_dataset_from

    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(row) + "\n")
    dataset = config(method=method, dataset={"name": str(data)}).dataset
    with pytest.raises(ConfigError, match=f"missing column\\(s\\) {missing}.*needs {', '.join(METHODS[method][2])}"):
        load_dataset_from(dataset, METHODS[method][2])
