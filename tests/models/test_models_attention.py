"""attn_implementation: a model is never forced onto an attention it does not support."""

from __future__ import annotations

import pytest

from tiny_families import save_tiny
from unsloth.models.loader import choose_attention


def test_an_unsupported_attention_falls_back_to_what_the_model_has():
    from transformers import GptOssForCausalLM, LlamaForCausalLM

    assert choose_attention(LlamaForCausalLM, "sdpa") == ("sdpa", None)
    choice, why = choose_attention(GptOssForCausalLM, "sdpa")
    assert choice == "eager" and "GptOssForCausalLM does not support attn_implementation='sdpa'" in why
    assert choose_attention(GptOssForCausalLM, "eager") == ("eager", None)
    assert choose_attention(None, "sdpa") == ("sdpa", None)  # remote code: transformers decides


@pytest.mark.slow
def test_gpt_oss_loads_with_the_default_attention_and_says_so(tmp_path, caplog):
    from unsloth.models.loader import load_pretrained

    path = save_tiny("gpt_oss", tmp_path)
    with caplog.at_level("WARNING", logger="unsloth"):
        model, _ = load_pretrained(str(path), load_in_4bit=False, dtype="float32")
    assert model.config._attn_implementation == "eager"
    assert "does not support attn_implementation='sdpa', so it loads with 'eager'" in caplog.text
