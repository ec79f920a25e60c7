"""The tokenizer in GGUF: which pre-tokenizers llama.cpp can reproduce, token types, padding."""

from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import pre_tokenizers

from export_models import make_model, make_tokenizer, qwen35_split, split_then_bytes
from unsloth.export import ExportError
from unsloth.export.vocab import _LLAMA3_SPLIT, _QWEN2_SPLIT, pre_tokenizer_name, token_table

pytestmark = pytest.mark.slow  # exports and runs models through llama.cpp


@pytest.mark.parametrize(("pre", "name"), [
    (None, "gpt-2"),
    (split_then_bytes(_LLAMA3_SPLIT), "llama-bpe"),
    (split_then_bytes(_QWEN2_SPLIT), "qwen2"),
    (split_then_bytes(qwen35_split()), "qwen35"),  # the regex transformers' Qwen3_5Tokenizer sets
])
def test_known_pre_tokenizers_round_trip_through_llama_cpp(tmp_path, pre, name):
    from unsloth.export.gguf import save_pretrained_gguf

    tokenizer = make_tokenizer(pre_tokenizer=pre)
    assert pre_tokenizer_name(json.loads(tokenizer.backend_tokenizer.to_str())) == name
    # validation includes the tokenizer comparison (awkward whitespace, digits, CJK, emoji, code)
    result = save_pretrained_gguf(make_model("llama"), tmp_path, tokenizer, "f16")
    report = result.validations["f16"]
    assert report.tokenizer_mismatches == [] and report.passed, report.summary()


@pytest.mark.parametrize("pre", [
    pre_tokenizers.ByteLevel(add_prefix_space=True),
    pre_tokenizers.Metaspace(),
    split_then_bytes(r"\w+|\s+"),
])
def test_unknown_pre_tokenizers_are_refused(pre):
    tokenizer = make_tokenizer(pre_tokenizer=pre)
    with pytest.raises(ExportError, match="not one llama.cpp implements") as info:
        pre_tokenizer_name(json.loads(tokenizer.backend_tokenizer.to_str()))
    assert "SentencePiece" in info.value.fix


def test_byte_fallback_bpe_is_refused():
    data = json.loads(make_tokenizer().backend_tokenizer.to_str())
    data["model"]["byte_fallback"] = True
    with pytest.raises(ExportError, match="not a byte-level BPE tokenizer"):
        pre_tokenizer_name(data)


def test_token_table_types_and_padding():
    from tokenizers import AddedToken

    tokenizer = make_tokenizer()
    tokenizer.add_tokens([AddedToken("<tool>", special=False)])
    size = len(tokenizer) + 3  # embedding rows beyond the tokenizer (padded vocab)
    tokens, types = token_table(tokenizer, size)
    assert len(tokens) == len(types) == size
    assert types[tokenizer.convert_tokens_to_ids("<|im_end|>")] == gguf.TokenType.CONTROL
    assert types[tokenizer.convert_tokens_to_ids("<tool>")] == gguf.TokenType.USER_DEFINED
    assert types[tokenizer.convert_tokens_to_ids("Ġthe")] == gguf.TokenType.NORMAL
    assert tokens[-3:] == [f"[PAD{i}]" for i in range(size - 3, size)] and types[-1] == gguf.TokenType.UNUSED


def test_tokenizer_larger_than_the_embedding_is_refused():
    with pytest.raises(ExportError, match="resize_token_embeddings"):
        token_table(make_tokenizer(), 100)
