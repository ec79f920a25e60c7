"""Notebook helpers: named chat templates, ShareGPT rows, loss on the assistant's replies only."""

from __future__ import annotations

import pytest

from unsloth.training.chat_templates import get_chat_template, response_only_labels, standardize_sharegpt


def _tokenizer():
    from unsloth.training.demo import build_tokenizer

    return build_tokenizer(["<|im_start|>user hello<|im_end|> <|im_start|>assistant hi"], vocab_size=300)


def test_named_templates_render_the_family_format():
    # map_eos_token=False: this vocabulary has no <|im_end|> token, which would otherwise become EOS
    tok = get_chat_template(_tokenizer(), "chatml", map_eos_token=False)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    tok = get_chat_template(tok, "llama-3.1", map_eos_token=False)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text.endswith("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
    with pytest.raises(ValueError, match="unknown chat template 'llama-9'"):
        get_chat_template(tok, "llama-9")


def test_sharegpt_turns_become_role_content_in_the_same_column():
    from datasets import Dataset

    data = Dataset.from_list([{"id": 7, "conversations": [{"from": "human", "value": "Hi"},
                                                          {"from": "gpt", "value": "Yo"}]}])
    row = standardize_sharegpt(data)[0]
    assert row["conversations"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert row["id"] == 7


def test_only_reply_tokens_keep_labels():
    ins, res = [1, 2], [3, 4]
    ids = [9, 1, 2, 5, 5, 3, 4, 6, 7, 1, 2, 5, 3, 4, 8]
    assert response_only_labels(ids, ins, res) == [-100] * 7 + [6, 7] + [-100] * 5 + [8]
