"""A tokenizer's files in a saved model folder, SentencePiece model included.

transformers 5 saves every tokenizer as tokenizer.json (+ tokenizer_config.json) and no longer
writes a SentencePiece tokenizer's ``tokenizer.model``, although it loaded from it (Llama 2,
Mistral v0.1-v0.3, Gemma). llama.cpp's converter reads that file for those vocabularies, and
Unsloth's saved folders have it, so our saves copy it from where the tokenizer was loaded.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

SENTENCEPIECE_MODEL = "tokenizer.model"


def sentencepiece_model(tokenizer: Any) -> Path | None:
    """The SentencePiece model file ``tokenizer`` was loaded from, if it still exists."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer
    init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    for candidate in (getattr(tokenizer, "vocab_file", None), init_kwargs.get("vocab_file")):
        if isinstance(candidate, str | os.PathLike) and str(candidate).endswith(".model") and os.path.isfile(candidate):
            return Path(candidate)
    return None


def save_tokenizer(tokenizer: Any, directory: str | os.PathLike[str]) -> None:
    """``tokenizer.save_pretrained(directory)``, plus its SentencePiece model file where it has one."""
    tokenizer.save_pretrained(str(directory))
    source = sentencepiece_model(tokenizer)
    target = Path(directory) / SENTENCEPIECE_MODEL
    if source is not None and source.resolve() != target.resolve():
        shutil.copyfile(source, target)
