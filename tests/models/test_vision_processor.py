"""Processors without torchvision: the family's processor over its PIL image processor, saved and loaded."""

from __future__ import annotations

import pytest

from tiny_vision import VISION_FAMILIES, build_processor, images

pytest.importorskip("PIL")


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_processor_saves_and_loads_back(family, tmp_path):
    from unsloth.models.vision import load_processor

    processor = build_processor(family)
    processor.save_pretrained(tmp_path)
    loaded = load_processor(str(tmp_path))
    assert type(loaded).__name__ == type(processor).__name__
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    ours = loaded(text=[text], images=images(1), return_tensors="pt", add_special_tokens=False)
    theirs = processor(text=[text], images=images(1), return_tensors="pt", add_special_tokens=False)
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert (ours["pixel_values"] == theirs["pixel_values"]).all()
    assert set(loaded.tokenizer.all_special_tokens) == set(processor.tokenizer.all_special_tokens)
    loaded.save_pretrained(tmp_path / "again")  # a second round trip loses none either
    assert set(load_processor(str(tmp_path / "again")).tokenizer.all_special_tokens) == set(
        processor.tokenizer.all_special_tokens)
