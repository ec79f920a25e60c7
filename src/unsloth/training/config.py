"""`unsloth train` configuration: a TOML or YAML file, checked, with command-line overrides.

    [model]    name, max_seq_length, dtype, load_in_4bit, load_in_8bit, full_finetuning, ...
    [dataset]  name (a hub dataset, or a local .jsonl / .json / .parquet / .csv), split, ...
    [lora]     r, alpha, dropout, target_modules, ...; for a vision-language model also
               finetune_vision_layers, finetune_language_layers, finetune_attention_modules,
               finetune_mlp_modules (which towers and module kinds get adapters)
    [training] any field of the method's TRL config (SFTConfig, DPOConfig, ...: learning_rate, max_steps,
               per_device_train_batch_size, beta, loss_type, ...)
    method, output_dir, gradient_checkpointing, packing, resume, save_merged, distributed   (top level)

`method` is "sft" (the default), or a preference method: "dpo", "orpo", "kto", "simpo", whose
dataset has prompt / chosen / rejected columns (KTO: prompt / completion / label).

`distributed` is how a job of several processes (`--gpus N`, torchrun) shares the work: "ddp" (the
default: every rank holds the whole model) or "fsdp" (FSDP2: each rank holds a shard of every weight,
its gradients and optimizer states; for models that do not fit one GPU). One process ignores it.

Every error names the key, what was wrong and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


from unsloth.errors import ExitCode, UnslothError


class ConfigError(UnslothError, ValueError):
    """A config problem, worded for the user: where, what, and the fix. Found before training starts."""

    exit_code = ExitCode.USAGE


@dataclass
class ModelConfig:
    name: str
    max_seq_length: int = 2048
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    full_finetuning: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    chat_template: str | None = None  # a Jinja template for tokenizers without one


@dataclass
class DatasetConfig:
    name: str
    split: str = "train"
    subset: str | None = None
    text_field: str | None = None  # for plain-text datasets whose column is not called "text"
    limit: int | None = None  # use only the first N rows


@dataclass
class LoraSettings:
    r: int = 16
    alpha: int = 16
    dropout: float = 0.0
    # None: q/k/v/o/gate/up/down for a text model; every linear layer of the parts the finetune_*
    # switches pick for a vision-language one (a list narrows those to the names given)
    target_modules: list[str] | None = None
    bias: str = "none"
    use_rslora: bool = False
    # vision-language models only (None: true), as FastVisionModel.get_peft_model takes them
    finetune_vision_layers: bool | None = None
    finetune_language_layers: bool | None = None
    finetune_attention_modules: bool | None = None
    finetune_mlp_modules: bool | None = None

    def switches(self) -> dict[str, bool]:
        """The finetune_* switches as FastVisionModel takes them (unset: true)."""
        return {name: getattr(self, name) is not False for name in FINETUNE_SWITCHES}

    def switches_set(self) -> list[str]:
        return [name for name in FINETUNE_SWITCHES if getattr(self, name) is not None]


FINETUNE_SWITCHES = ("finetune_vision_layers", "finetune_language_layers", "finetune_attention_modules",
                     "finetune_mlp_modules")


# `unsloth train` methods: supervised fine-tuning, and the preference methods (training/preference.py).
METHODS = ("sft", "dpo", "orpo", "kto", "simpo")
# How several processes share the training (a job of one process ignores it).
DISTRIBUTED = ("ddp", "fsdp")


@dataclass
class TrainConfig:
    model: ModelConfig
    dataset: DatasetConfig
    lora: LoraSettings | None = field(default_factory=LoraSettings)
    training: dict[str, Any] = field(default_factory=dict)  # checked against the method's TRL config class
    method: str = "sft"  # one of METHODS
    output_dir: str = "outputs"
    gradient_checkpointing: Union[bool, str] = "unsloth"  # true | false | "unsloth" (offloaded)
    packing: bool = False  # padding-free packing: several sequences per row, no pad tokens
    resume: Union[bool, str] = False  # true = the latest checkpoint in output_dir, or a checkpoint path
    save_merged: bool = False  # also write 16-bit merged weights to output_dir/merged
    distributed: str = "ddp"  # one of DISTRIBUTED
    seed: int = 3407


def load_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """Read a TOML or YAML config, apply `key.path=value` overrides, and check it."""
    raw = read_file(path)
    for item in overrides:
        apply_override(raw, item)
    return from_dict(raw)


def read_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file", "write one (docs/training.md), or try `unsloth train --demo`")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = _yaml_load(text) or {}
        else:
            raise ConfigError(f"{path}: config files are .toml, .yaml or .yml", "rename it, e.g. train.toml")
    except ConfigError:
        raise
    except Exception as exc:  # tomllib / yaml syntax errors carry line and column
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}",
                          "correct the file at the line and column named") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table of settings", "start with [model] name = \"...\"")
    return data


def parse_value(text: str) -> Any:
    """A command-line value: a TOML literal (numbers, 2e-4, true/false, quoted strings, lists), else a
    YAML one (bare-word lists such as [q_proj, v_proj]), else the text itself."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return _yaml_load(text)
    except Exception:
        return text


def _yaml_load(text: str) -> Any:
    """yaml.safe_load, but 2e-4 is a number, as in YAML 1.2 and TOML (YAML 1.1 wants 2.0e-4)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    exponent_float = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent_float, list("-+0123456789"))
    return yaml.load(text, Loader=Loader)


def apply_override(raw: dict, item: str) -> None:
    """Set `a.b.c=value` in a raw config mapping."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} has no value", "write it as key.path=value, e.g. training.learning_rate=1e-4")
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a table", f"set {part} itself: --set {part}=...")
    node[leaf] = parse_value(value)


def from_dict(raw: dict) -> TrainConfig:
    """Build and check a TrainConfig from a mapping (as read from TOML/YAML)."""
    config = _build(TrainConfig, raw, "")
    if config.method not in METHODS:
        close = difflib.get_close_matches(config.method, METHODS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"method = {config.method!r}: not a training method{hint}",
                          f"set method to one of {', '.join(repr(m) for m in METHODS)}")
    if config.method != "sft" and config.packing:
        raise ConfigError(f"packing: method = {config.method!r} trains on prompt / answer pairs, which are not packed",
                          "remove packing (or set packing = false)")
    check_distributed(config)
    if config.lora is None and not config.model.full_finetuning:
        raise ConfigError("lora: missing; add a [lora] table, or set model.full_finetuning = true")
    if config.model.load_in_4bit and config.model.load_in_8bit:
        raise ConfigError("model: load_in_4bit and load_in_8bit are both true; choose one")
    if config.gradient_checkpointing not in (True, False, "unsloth"):
        raise ConfigError(f"gradient_checkpointing: {config.gradient_checkpointing!r} is not one of "
                          "true, false, \"unsloth\"")
    if config.model.max_seq_length <= 0:
        raise ConfigError(f"model.max_seq_length = {config.model.max_seq_length}: must be a positive number of tokens",
                          "set model.max_seq_length = 2048 (the longest example you train on, in tokens)")
    check_ranges(config)
    return config


def check_distributed(config: TrainConfig) -> None:
    if config.distributed not in DISTRIBUTED:
        close = difflib.get_close_matches(config.distributed, DISTRIBUTED, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"distributed = {config.distributed!r}: not a way to train on several GPUs{hint}",
                          "set distributed = \"ddp\" (each GPU holds the model) or \"fsdp\" (the model sharded)")
    if config.distributed != "fsdp":
        return
    # What sharding has not been made to carry (each is refused here, not minutes into a run).
    if config.method != "sft":
        raise ConfigError(f"distributed = \"fsdp\": method = {config.method!r} is not sharded yet (its reference "
                          "pass is untested under FSDP2)", "set distributed = \"ddp\" for preference methods")
    if config.model.load_in_8bit:
        raise ConfigError("distributed = \"fsdp\": 8-bit weights (load_in_8bit) cannot be sharded by FSDP2",
                          "use load_in_4bit = true (QLoRA, which shards) or distributed = \"ddp\"")


# key -> (does a value work, the rule in words, a good value). Values of the wrong type are left to
# the type checks (check_value); these are the right type with a value that cannot work.
_TRAINING_RANGES = {
    "max_steps": (lambda v: v >= 1 or v == -1, "1 or more, or -1 to train for num_train_epochs", "max_steps = 60"),
    "num_train_epochs": (lambda v: v > 0, "above 0", "num_train_epochs = 1"),
    "learning_rate": (lambda v: 0 < v <= 1, "above 0 and at most 1", "learning_rate = 2e-4"),
    "per_device_train_batch_size": (lambda v: v >= 1, "1 or more", "per_device_train_batch_size = 2"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "1 or more", "gradient_accumulation_steps = 4"),
    "warmup_steps": (lambda v: v >= 0, "0 or more", "warmup_steps = 5"),
    "warmup_ratio": (lambda v: 0 <= v <= 1, "between 0 and 1", "warmup_ratio = 0.03"),
    "logging_steps": (lambda v: v > 0, "above 0", "logging_steps = 1"),
    "save_steps": (lambda v: v > 0, "above 0", "save_steps = 100"),
    "weight_decay": (lambda v: v >= 0, "0 or more", "weight_decay = 0.01"),
    "max_grad_norm": (lambda v: v >= 0, "0 or more", "max_grad_norm = 1.0"),
}


def check_ranges(config: TrainConfig) -> None:
    """Numbers of the right type that cannot work (lora.r = -4, max_steps = 0), named before any work."""
    lora = config.lora
    if lora is not None:
        if lora.r < 1:
            raise ConfigError(f"lora.r = {lora.r}: the LoRA rank must be 1 or more", "set lora.r = 16 (8 to 64 is usual)")
        if lora.alpha <= 0:
            raise ConfigError(f"lora.alpha = {lora.alpha}: must be above 0", "set lora.alpha = 16 (often equal to r)")
        if not 0 <= lora.dropout < 1:
            raise ConfigError(f"lora.dropout = {lora.dropout}: must be at least 0 and below 1", "set lora.dropout = 0")
        switches = lora.switches()
        if not (switches["finetune_vision_layers"] or switches["finetune_language_layers"]):
            raise ConfigError("lora: finetune_vision_layers and finetune_language_layers are both false, so no "
                              "layer would be trained", "set one of them to true")
        if not (switches["finetune_attention_modules"] or switches["finetune_mlp_modules"]):
            raise ConfigError("lora: finetune_attention_modules and finetune_mlp_modules are both false, so no "
                              "layer would be trained", "set one of them to true")
    if config.dataset.limit is not None and config.dataset.limit < 1:
        raise ConfigError(f"dataset.limit = {config.dataset.limit}: must be 1 or more", "remove it to use every row")
    for key, (works, rule, example) in _TRAINING_RANGES.items():
        value = config.training.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not works(value):
            nothing = "; 0 steps would train nothing" if key == "max_steps" and value == 0 else ""
            raise ConfigError(f"training.{key} = {value}: must be {rule}{nothing}", f"set training.{example}")
    output = Path(config.output_dir).expanduser()
    if output.exists() and not output.is_dir():
        raise ConfigError(f"output_dir: {output} is a file, not a folder", "choose another output_dir (--output-dir DIR)")


def _build(cls, raw: Any, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a table of settings, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"{_join(where, key)}: unknown key{hint}",
                              f"rename it to {close[0]!r}" if close else "remove it")
    values = {}
    for name, f in fields.items():
        path = _join(where, name)
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{path}: required (e.g. {_example(path)})")
            continue
        values[name] = check_value(hints[name], raw[name], path)
    return cls(**values)


def check_value(hint, value, path: str):
    """`value` checked against the type hint `hint` (ints widen to float); a ConfigError names `path`."""
    try:
        return _check_value(hint, value, path)
    except ConfigError as exc:
        exc.fix = exc.fix or f"correct {path} in the config (or --set {path}=VALUE); {_example(path)}"
        raise


def _check_value(hint, value, path: str):
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(option, value, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} does not fit {_name(hint)}")
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_check_value(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is str and value is not None and not isinstance(value, str):
        raise ConfigError(f"{path}: expected text, got {value!r} (quote it)")
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{path}: expected a whole number, got {value!r}")
    if hint is float and not isinstance(value, float):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    return value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _name(hint) -> str:
    return " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(hint) if a is not type(None))


def _example(path: str) -> str:
    return {"model": '[model] name = "unsloth/Llama-3.2-1B-Instruct"',
            "model.name": 'name = "unsloth/Llama-3.2-1B-Instruct"',
            "dataset": '[dataset] name = "data/train.jsonl"',
            "dataset.name": 'name = "data/train.jsonl"'}.get(path, f"{path} = ...")
