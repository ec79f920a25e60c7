"""Saved checkpoints for the CLI: a model or adapter directory -> (model, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from unsloth.export.errors import ExportError
from unsloth.models.folder import ADAPTER_WEIGHTS, model_folder_problem, parameter_count, weights_problem

BASE_FIX = "export the merged/ folder, or make the adapter's base model (base_model_name_or_path) available locally"
FOLDER_FIX = ("pass the directory written by `unsloth train` (or its merged/ or lora/ folder) or by save_pretrained, "
              "with its config.json and weights")


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """A model or adapter directory; a training output directory means its merged/ (else lora/) model."""
    path = Path(path)
    for candidate in (path, path / "merged", path / "lora"):
        if _is_checkpoint(candidate):
            return candidate
    raise ExportError(
        f"{path} is not a model or adapter directory (no config.json or adapter_config.json)",
        fix="pass the directory written by `unsloth train` (or its merged/ or lora/ folder) or by save_pretrained",
    )


def adapter_base(path: Path) -> str | None:
    """The base model an adapter directory names (None for a full model directory)."""
    adapter = path / "adapter_config.json"
    if not adapter.is_file():
        return None
    try:
        config = json.loads(adapter.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{adapter} is not readable JSON ({exc})", fix=FOLDER_FIX) from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base:
        raise ExportError(f"{adapter} names no base model", fix="set base_model_name_or_path to the base model's directory")
    return base


def check_checkpoint(path: Path) -> None:
    """config.json with a known model_type and whole weights (or an adapter's weights and a whole local
    base), before minutes of loading."""
    base = adapter_base(path)
    if base is None:
        problem = model_folder_problem(path)
    elif Path(base).is_absolute() and not Path(base).exists():
        raise ExportError(f"could not load {path}: its base model {base} does not exist",
                          fix=BASE_FIX, kept="nothing was written")
    else:
        problem = model_folder_problem(Path(base)) if Path(base).is_dir() else None
        problem = problem or weights_problem(path, ADAPTER_WEIGHTS, ())
    if problem:
        raise ExportError(problem, fix=FOLDER_FIX, kept="nothing was written")


def checkpoint_parameters(path: Path) -> int:
    """How many weights the merged model has (the base's, for an adapter), from the files' headers."""
    base = adapter_base(path)
    return parameter_count(Path(base) if base and Path(base).is_dir() else path)


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """A merged model directory or a LoRA adapter directory -> (model, tokenizer), on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_checkpoint(path)
    base = adapter_base(path)
    tokenizer_dir = path if (path / "tokenizer_config.json").is_file() or not base else base
    auto_class, load_tokenizer = AutoModelForCausalLM, AutoTokenizer.from_pretrained
    if _is_vision_language(base or path):  # its processor too: the export writes the projector file from it
        from transformers import AutoModelForImageTextToText

        from unsloth.models.vision import load_processor

        auto_class, load_tokenizer = AutoModelForImageTextToText, load_processor
    try:
        model = auto_class.from_pretrained(base or path, dtype=dtype or "auto")
        if base:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, path)
        tokenizer = load_tokenizer(str(tokenizer_dir))
    except OSError as exc:  # a missing base model or tokenizer, offline hub lookups
        raise ExportError(f"could not load {path}: {exc}", fix=BASE_FIX) from exc
    return model.eval(), tokenizer


def _is_vision_language(path) -> bool:
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
    except (OSError, ValueError):  # unreadable here: from_pretrained says why
        return False
