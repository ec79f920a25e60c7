"""UnslothVisionDataCollator on each vision-language family's processor: shapes, masks, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny vision families

from tiny_vision import VISION_FAMILIES, build_processor, images, vision_config  # noqa: E402

pytest.importorskip("PIL")


class _Model:  # the collator reads only the config (image token ids) and max_seq_length
    def __init__(self, family, processor):
        self.config = vision_config(family, processor.tokenizer)
        self.max_seq_length = 512


def _collator(family, **options):
    from unsloth import UnslothVisionDataCollator

    processor = build_processor(family)
    return UnslothVisionDataCollator(_Model(family, processor), processor, **options), processor


def _examples():
    first, second = images(2)
    return [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "t5 t6"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "t7 t8"}]}]},
        {"messages": [{"role": "system", "content": "t40"},
                      {"role": "user", "content": [{"type": "text", "text": "t9"}, {"type": "image"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "t10 t11 t12 t13"}]}],
         "images": [second]},
    ]


def _learnt(processor, batch, row):
    tokens = processor.tokenizer.convert_ids_to_tokens(batch["input_ids"][row])
    return [t for t, label in zip(tokens, batch["labels"][row].tolist()) if label != -100]


@pytest.mark.slow
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_labels_are_the_replies_only(family):
    collator, processor = _collator(family)
    batch = collator(_examples())
    eos = processor.tokenizer.eos_token
    assert batch["labels"].shape == batch["input_ids"].shape
    assert batch["input_ids"].shape[0] == 2 and "pixel_values" in batch
    assert _learnt(processor, batch, 0) == ["t7", "t8", eos]
    assert _learnt(processor, batch, 1) == ["t10", "t11", "t12", "t13", eos]
    # the shorter row is padded, and padding is never learnt
    pad = batch["attention_mask"] == 0
    assert pad.any() and (batch["labels"][pad] == -100).all()


@pytest.mark.slow
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_all_tokens_but_images_and_padding_when_asked(family):
    collator, processor = _collator(family, train_on_responses_only=False)
    batch = collator(_examples())
    learnt = set(_learnt(processor, batch, 0)) | set(_learnt(processor, batch, 1))
    image_tokens = {processor.tokenizer.convert_ids_to_tokens(i) for i in collator.image_ids}
    assert {"t5", "t6", "t7", "t9", "t40"} <= learnt
    assert not learnt & image_tokens
    image_ids = torch.tensor(sorted(collator.image_ids))
    assert torch.isin(batch["input_ids"], image_ids).any()  # the images are in the sequence, just not learnt


def test_every_reply_of_a_multi_turn_chat_is_learnt():
    collator, processor = _collator("qwen2_5_vl")
    chat = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": images(1)[0]}, {"type": "text", "text": "t5"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "t20"}]},
        {"role": "user", "content": [{"type": "text", "text": "t6"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "t21 t22"}]},
    ]}
    assert _learnt(processor, collator([chat]), 0) == ["t20", "<|im_end|>", "t21", "t22", "<|im_end|>"]


def test_datasets_image_dicts_and_paths_are_images(tmp_path):
    import io

    collator, _ = _collator("qwen2_5_vl")
    image = images(1)[0]
    image.save(tmp_path / "a.png")
    png = io.BytesIO()
    image.save(png, format="PNG")
    chats = []
    for value in (image, str(tmp_path / "a.png"), {"bytes": png.getvalue(), "path": None}):
        chat = _examples()[0]
        chat["messages"][0]["content"][0]["image"] = value
        chats.append(chat)
    batch = collator(chats)
    pixels = batch["pixel_values"].reshape(3, -1)
    assert torch.equal(pixels[0], pixels[1]) and torch.equal(pixels[0], pixels[2])


def test_bad_examples_say_what_is_wrong():
    collator, _ = _collator("qwen2_5_vl")
    with pytest.raises(ValueError, match="no image for it"):
        collator([{"messages": [{"role": "user", "content": [{"type": "image"}]},
                                {"role": "assistant", "content": "t7"}]}])
    with pytest.raises(ValueError, match="'messages'"):
        collator([{"text": "t5"}])
    with pytest.raises(ValueError, match="mixes examples with and without images"):
        collator([_examples()[0], {"messages": [{"role": "user", "content": "t5"},
                                                {"role": "assistant", "content": "t6"}]}])


def test_long_text_is_cut_but_images_are_kept():
    collator, processor = _collator("qwen2_5_vl", max_seq_length=20)
    long = _examples()[0]
    long["messages"][1]["content"][0]["text"] = " ".join(f"t{i}" for i in range(50, 80))
    batch = collator([long])
    assert batch["input_ids"].shape[1] == 20 == batch["labels"].shape[1]
    collator.max_seq_length = 4
    with pytest.raises(ValueError, match="max_seq_length=4"):
        collator([long])


def test_rows_from_a_datasets_table_render_one_image_each(tmp_path):
    """A `datasets` table gives every content item every key ("image": None on text items); Qwen's
    template reads `'image' in item` as an image, so those keys must not reach it."""
    from datasets import Dataset

    qwen_style = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                  "{% if c['type'] == 'image' or 'image' in c %}<|vision_start|><|image_pad|><|vision_end|>"
                  "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}")
    collator, processor = _collator("qwen2_5_vl")
    processor.chat_template = qwen_style
    images(1)[0].save(tmp_path / "a.png")
    rows = [{"messages": [{"role": "user", "content": [image, {"type": "text", "text": "t5"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "t7"}]}],
             "images": [str(tmp_path / "a.png")] * (image.get("image") is None)}
            for image in ({"type": "image", "image": str(tmp_path / "a.png")}, {"type": "image"})]
    table = Dataset.from_list(rows)
    assert table[0]["messages"][1]["content"][0] == {"type": "text", "text": "t7", "image": None}
    batch = collator([table[0], table[1]])
    starts = (batch["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")).sum(dim=1)
    assert starts.tolist() == [1, 1] and "t7" in _learnt(processor, batch, 1)
