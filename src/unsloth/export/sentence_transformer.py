"""Save an embedding model in the sentence-transformers layout with its LoRA adapters merged.

sentence-transformers writes its own layout (modules.json, the pooling module's config,
sentence_bert_config.json, the tokenizer); the encoder's folder then gets the merged 16-bit weights
(``unsloth.export.merged``, the one merge) in place of peft's adapter files, so plain
``SentenceTransformer(folder)`` loads it with no peft and no unsloth.
"""

from __future__ import annotations

import json
from pathlib import Path

from unsloth.export.merged import save_pretrained_merged
from unsloth.models.sentence_encoder import encoder

_ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_config.json")


def save_sentence_transformer_merged(st_model, save_directory: str, tokenizer=None,
                                     save_method: str = "merged_16bit", **kwargs) -> str:
    """`model.save_pretrained_merged(dir)` for a SentenceTransformer: merged 16-bit in its layout;
    save_method="lora" keeps the adapters (sentence-transformers reloads those through peft)."""
    if save_method not in ("merged_16bit", "lora"):
        raise ValueError(f"save_method for an embedding model is 'merged_16bit' or 'lora', got {save_method!r}")
    folder = Path(save_directory)
    st_model.save_pretrained(str(folder))
    inner = encoder(st_model)
    if save_method == "merged_16bit" and hasattr(inner, "get_base_model"):
        encoder_folder = folder / _first_module_path(folder)
        for name in _ADAPTER_FILES:
            (encoder_folder / name).unlink(missing_ok=True)
        save_pretrained_merged(inner, str(encoder_folder), **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder / _first_module_path(folder)))
    return str(folder)


def _first_module_path(folder: Path) -> str:
    """Where sentence-transformers put its first (encoder) module: modules.json's first entry."""
    modules = json.loads((folder / "modules.json").read_text())
    return modules[0].get("path", "") if modules else ""
