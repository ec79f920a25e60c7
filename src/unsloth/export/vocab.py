"""The tokenizer in GGUF: llama.cpp's "gpt2" (byte-level BPE) model with merges, special ids, chat template.

llama.cpp re-implements each pre-tokenizer by name ("tokenizer.ggml.pre"), so the tokenizer's
split rule must be one it knows; an unknown one is refused rather than exported to tokenize
differently. SentencePiece tokenizers (Llama 2, Mistral v0.1-v0.3, Gemma) are not written here:
llama.cpp's own converter reads their tokenizer.model (see ``is_sentencepiece``).
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import gguf

from unsloth.export.errors import ExportError

# Split regexes from tokenizer.json -> llama.cpp's pre-tokenizer name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (  # Qwen 2's, with combining marks (\p{M}) kept inside words
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2", _QWEN35_SPLIT: "qwen35"}

_UNSUPPORTED_FIX = (
    "use a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen 2 or Qwen 3.5 style), or a SentencePiece tokenizer "
    "loaded with its tokenizer.model (Llama 2, Mistral v0.1-v0.3, Gemma)"
)


def is_sentencepiece(tokenizer_json: dict[str, Any]) -> bool:
    """A SentencePiece-style tokenizer.json: Unigram, or BPE over "▁"-marked words with byte fallback."""
    model = tokenizer_json.get("model") or {}
    return model.get("type") == "Unigram" or (model.get("type") == "BPE" and bool(model.get("byte_fallback")))


def uses_sentencepiece(tokenizer: Any) -> bool:
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and is_sentencepiece(json.loads(backend.to_str()))


def pre_tokenizer_name(tokenizer_json: dict[str, Any]) -> str:
    """The llama.cpp pre-tokenizer that splits text exactly as this tokenizer.json does."""
    model = tokenizer_json.get("model") or {}
    decoder = tokenizer_json.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise ExportError("the tokenizer is not a byte-level BPE tokenizer; nothing was written", fix=_UNSUPPORTED_FIX)
    normalizer = tokenizer_json.get("normalizer")
    if normalizer and normalizer.get("type") != "NFC":
        raise ExportError(f"the tokenizer's {normalizer.get('type')} normalizer has no llama.cpp equivalent", fix=_UNSUPPORTED_FIX)

    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    kinds = [step.get("type") for step in steps]
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in _SPLIT_PRE:
            return _SPLIT_PRE[regex]
    raise ExportError(
        f"the tokenizer's pre-tokenizer ({json.dumps(pre)[:200]}) is not one llama.cpp implements; nothing was written",
        fix=_UNSUPPORTED_FIX,
    )


def token_table(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id and their GGUF types; ids the tokenizer does not use become [PADn] (unused)."""
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    if by_id and max(by_id) >= vocab_size:
        raise ExportError(
            f"the tokenizer has ids up to {max(by_id)} but the model's embedding has only {vocab_size} rows",
            fix="resize the model's embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer)))",
        )
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _adds_special(tokenizer: Any) -> tuple[bool, bool]:
    """Whether encoding adds BOS / EOS, read from what the tokenizer actually does."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    adds_bos = bos is not None and len(full) > len(plain) and full[0] == bos
    adds_eos = eos is not None and len(full) > len(plain) and full[-1] == eos
    return adds_bos, adds_eos


def write_vocab(tokenizer: Any, vocab_size: int, writer: gguf.GGUFWriter) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise ExportError("the tokenizer is a slow (Python) tokenizer", fix="load it with AutoTokenizer (use_fast=True)")
    tokenizer_json = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = pre_tokenizer_name(tokenizer_json)
    tokens, types = token_table(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)

    # SpecialVocab reads merges, special ids and the chat template from the saved files, the same
    # files llama.cpp's own converter reads.
    with tempfile.TemporaryDirectory(prefix="unsloth-tokenizer-") as saved:
        tokenizer.save_pretrained(saved)
        special = gguf.SpecialVocab(saved, load_merges=True, n_vocab=vocab_size)
    adds_bos, adds_eos = _adds_special(tokenizer)
    special.add_special_token.update(bos=adds_bos, eos=adds_eos)
    if isinstance(tokenizer.chat_template, str):
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(writer, quiet=True)
