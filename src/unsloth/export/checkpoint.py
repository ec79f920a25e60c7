"""Saved checkpoints for the CLI: a model or adapter directory -> (model, tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from unsloth.export.errors import ExportError


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


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """A merged model directory or a LoRA adapter directory -> (model, tokenizer), on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_checkpoint(path)
    adapter = path / "adapter_config.json"
    base = json.loads(adapter.read_text()).get("base_model_name_or_path") if adapter.is_file() else None
    if adapter.is_file() and not base:
        raise ExportError(f"{adapter} names no base model", fix="set base_model_name_or_path to the base model's directory")
    tokenizer_dir = path if (path / "tokenizer_config.json").is_file() or not base else base
    try:
        model = AutoModelForCausalLM.from_pretrained(base or path, dtype=dtype or "auto")
        if base:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, path)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except OSError as exc:  # a missing base model or tokenizer, offline hub lookups
        raise ExportError(
            f"could not load {path}: {exc}",
            fix="export the merged/ folder, or make the adapter's base model (base_model_name_or_path) available locally",
        ) from exc
    return model.eval(), tokenizer
