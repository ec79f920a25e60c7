"""The vision data collator: chat messages with images -> a padded batch with labels.

Each example is a conversation (`messages`, or `conversations`) whose content items may be images
(`{"type": "image", "image": PIL image | path | {"bytes": ...}}`), or placeholders (`{"type":
"image"}`) with the images in the example's `images` list. The processor's chat template renders
it, the processor tokenizes it and turns the images into pixel values; the labels are the tokens
with padding and image tokens masked, and (by default) everything but the assistant's replies.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping, Sequence

import torch

log = logging.getLogger("unsloth")

IGNORE_INDEX = -100
# processor / config attributes naming the tokens that stand for images (never predicted)
_IMAGE_TOKEN_ATTRIBUTES = ("image_token", "boi_token", "eoi_token", "video_token")
_IMAGE_ID_ATTRIBUTES = ("image_token_id", "image_token_index", "video_token_id", "boi_token_id",
                        "boi_token_index", "eoi_token_id", "eoi_token_index", "vision_start_token_id",
                        "vision_end_token_id")


def _as_image(value):
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, str):
        return Image.open(value).convert("RGB")
    if isinstance(value, Mapping) and value.get("bytes") is not None:
        return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
    if isinstance(value, Mapping) and value.get("path"):
        return Image.open(value["path"]).convert("RGB")
    raise TypeError(f"an image must be a PIL image, a path or a datasets Image dict, not {type(value).__name__}")


def conversation(example) -> list[dict]:
    messages = example.get("messages", example.get("conversations")) if isinstance(example, Mapping) else example
    if not isinstance(messages, Sequence) or not messages:
        keys = ", ".join(example) if isinstance(example, Mapping) else type(example).__name__
        raise ValueError(f"a vision example is a conversation under 'messages' (or 'conversations'); got {keys}")
    return list(messages)


def message_images(messages: list[dict], extra=()) -> list:
    """The images of `messages` in order: inline ones, else the example's `images` list for placeholders."""
    extra = list(extra or ())
    found = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            continue
        for item in content or ():
            if isinstance(item, Mapping) and item.get("type") == "image":
                inline = item.get("image")
                if inline is None:
                    if not extra:
                        raise ValueError("a message has an image placeholder but the example has no image for it; "
                                         "put the image in the item ({'type': 'image', 'image': ...}) or in 'images'")
                    inline = extra.pop(0)
                found.append(_as_image(inline))
    return found


def _for_template(messages: list[dict]) -> list[dict]:
    """Messages with inline images replaced by placeholders (chat templates render the placeholder), and
    the empty keys a `datasets` table gives every item dropped (Qwen's template takes a text item with
    an "image": None key for an image)."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            content = [{"type": "image"} if isinstance(c, Mapping) and c.get("type") == "image"
                       else {k: v for k, v in c.items() if v is not None} if isinstance(c, Mapping) else c
                       for c in content or ()]
        out.append({**message, "content": content})
    return out


class UnslothVisionDataCollator:
    """`data_collator=UnslothVisionDataCollator(model, processor)` for SFTTrainer on image + text chats.

    `train_on_responses_only` (default True): only the assistant's replies are learnt; False learns
    every token except padding and images. `max_seq_length` (default: the model's) cuts text after
    the last image; a sequence whose images do not fit is an error. `resize`: an int (longest side) or
    a (width, height) to resize images to first; "min" / None leave them to the processor. The
    remaining Unsloth options (instruction_part, response_part, ...) are accepted: the turns are found
    through the chat template, not by matching text.
    """

    def __init__(self, model, processor, max_seq_length: int | None = None, formatting_func=None,
                 resize="min", ignore_index: int = IGNORE_INDEX, train_on_responses_only: bool = True,
                 instruction_part=None, response_part=None, force_match: bool = True, num_proc=None,
                 completion_only_loss: bool = True, pad_to_multiple_of: int | None = None, **unused):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.max_seq_length = max_seq_length or getattr(model, "max_seq_length", None)
        self.formatting_func = formatting_func
        self.resize = resize
        self.ignore_index = ignore_index
        self.responses_only = train_on_responses_only
        self.pad_to_multiple_of = pad_to_multiple_of
        self.image_ids = self._image_token_ids(model)
        # The processor decides how many tokens an image takes; its own extra outputs (grids, masks)
        # are passed through to the model as they are.
        self.padding_side = "right"

    def _image_token_ids(self, model) -> set[int]:
        ids = set()
        config = getattr(model, "config", None)
        for owner in (self.processor, config):
            for name in _IMAGE_ID_ATTRIBUTES:
                value = getattr(owner, name, None)
                if isinstance(value, int):
                    ids.add(value)
        for name in _IMAGE_TOKEN_ATTRIBUTES:
            token = getattr(self.processor, name, None) or getattr(self.tokenizer, name, None)
            if isinstance(token, str):
                token_id = self.tokenizer.convert_tokens_to_ids(token)
                if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id:
                    ids.add(token_id)
        return ids

    def _resized(self, image):
        if isinstance(self.resize, int):
            scale = self.resize / max(image.size)
            return image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
        if isinstance(self.resize, (tuple, list)):
            return image.resize(tuple(self.resize))
        return image

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(_for_template(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _length(self, messages, images, add_generation_prompt: bool) -> int:
        """Tokens of a conversation prefix, its images expanded as in the full sequence."""
        text = self._render(messages, add_generation_prompt)
        batch = self.processor(text=[text], images=[images] if images else None, add_special_tokens=False)
        return len(batch["input_ids"][0])

    def _trained_spans(self, messages, images) -> list[tuple[int, int]]:
        """(start, end) token spans of the assistant's replies."""
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = self._length(messages[:i], images[: _images_in(messages[:i])], add_generation_prompt=True)
            last = i == len(messages) - 1
            end = None if last else self._length(messages[: i + 1], images[: _images_in(messages[: i + 1])],
                                                 add_generation_prompt=False)
            spans.append((start, end))
        return spans

    def __call__(self, examples):
        if self.formatting_func is not None:
            examples = [self.formatting_func(e) for e in examples]
        conversations, all_images = [], []
        for example in examples:
            messages = conversation(example)
            extra = example.get("images") or ([example["image"]] if example.get("image") is not None else [])
            all_images.append([self._resized(im) for im in message_images(messages, extra)])
            conversations.append(messages)
        texts = [self._render(m, add_generation_prompt=False) for m in conversations]
        has_images = any(all_images)
        if has_images and not all(all_images):
            raise ValueError("a batch mixes examples with and without images; give every example an image, "
                             "or batch them apart (per_device_train_batch_size=1)")
        batch = self.processor(text=texts, images=all_images if has_images else None, padding=True,
                               return_tensors="pt", add_special_tokens=False,
                               pad_to_multiple_of=self.pad_to_multiple_of)
        batch = dict(batch)
        labels = batch["input_ids"].clone()
        if "attention_mask" in batch:
            labels[batch["attention_mask"] == 0] = self.ignore_index
        for token_id in self.image_ids:
            labels[labels == token_id] = self.ignore_index
        if self.responses_only:
            for row, (messages, images) in enumerate(zip(conversations, all_images)):
                keep = torch.zeros(labels.shape[1], dtype=torch.bool)
                for start, end in self._trained_spans(messages, images):
                    keep[start:end] = True
                labels[row, ~keep] = self.ignore_index
        batch["labels"] = labels
        return self._truncated(batch)

    def _truncated(self, batch: dict) -> dict:
        limit = self.max_seq_length
        length = batch["input_ids"].shape[1]
        if not limit or length <= limit:
            return batch
        cut = batch["input_ids"][:, limit:]
        if any((cut == token_id).any() for token_id in self.image_ids):
            raise ValueError(f"an example's images end past max_seq_length={limit} tokens; raise max_seq_length "
                             "or make the images smaller (resize=...)")
        log.warning("unsloth: vision collator: sequences of %d tokens cut to max_seq_length=%d", length, limit)
        for key in ("input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids"):
            if key in batch and batch[key].dim() >= 2 and batch[key].shape[1] == length:
                batch[key] = batch[key][:, :limit]
        if "cross_attention_mask" in batch:
            batch["cross_attention_mask"] = batch["cross_attention_mask"][:, :limit]
        return batch


def _images_in(messages) -> int:
    return sum(1 for m in messages if not isinstance(m.get("content"), str)
               for c in m.get("content") or () if isinstance(c, Mapping) and c.get("type") == "image")


DATASET_SHAPE = ('one JSON object per line: {"messages": [{"role": "user", "content": [{"type": "image", "image": '
                 '"pictures/cat.png"}, {"type": "text", "text": "What is this?"}]}, {"role": "assistant", "content": '
                 '[{"type": "text", "text": "A cat."}]}]}; or {"type": "image"} placeholders with the paths in an '
                 '"images" list. Paths are relative to the dataset file\'s folder')


def vision_dataset(dataset, folder, batch_size: int):
    """A vision SFT dataset checked row by row before the model loads, with its image paths made
    absolute against `folder` (the local dataset file's; None for a hub dataset).

    Each row is a conversation whose images (inline items, or placeholders filled from `images`) all
    exist; rows with and without images are not mixed in batches of more than one."""
    from pathlib import Path

    from unsloth.training.config import ConfigError

    kept = "nothing was trained or written"

    def located(value, row: int):
        if not isinstance(value, str):
            return value  # a PIL image or a `datasets` Image dict: checked when opened
        path = Path(value).expanduser()
        if not path.is_absolute() and folder is not None:
            path = Path(folder) / path
        if not path.is_file():
            raise ConfigError(f"dataset row {row + 1}: image {value!r} not found (looked for {path})",
                              "image paths are relative to the dataset file's folder (or absolute); "
                              "correct the path or add the file", kept=kept)
        return str(path)

    def resolved(example, row: int):
        try:
            messages = conversation(example)
        except ValueError as exc:
            raise ConfigError(f"dataset row {row + 1}: {exc}", DATASET_SHAPE, kept=kept) from None
        extra = [located(v, row) for v in example.get("images") or ()]
        placeholders = 0
        fixed = []
        for message in messages:
            content = message.get("content")
            if not isinstance(content, str):
                content = [dict(c) for c in content or ()]
                for item in content:
                    if item.get("type") == "image":
                        if item.get("image") is None:
                            placeholders += 1
                        else:
                            item["image"] = located(item["image"], row)
            fixed.append({**message, "content": content})
        if placeholders > len(extra):
            raise ConfigError(f"dataset row {row + 1}: {placeholders} image placeholder(s) but "
                              f"{len(extra)} image(s) in its 'images' list", DATASET_SHAPE, kept=kept)
        out = {"messages": fixed}
        if "images" in example:
            out["images"] = extra
        return out

    with_images = []
    for row, example in enumerate(dataset):
        resolved(example, row)  # every row checked, so a bad one is named before minutes of loading
        with_images.append(_images_in(conversation(example)) > 0)
    if batch_size > 1 and any(with_images) and not all(with_images):
        row = with_images.index(False) if with_images[0] else with_images.index(True)
        raise ConfigError(f"dataset row {row + 1}: some rows have images and some do not, and a batch of "
                          f"{batch_size} cannot mix them", "give every row an image, or set "
                          "training.per_device_train_batch_size = 1", kept=kept)
    if folder is None:
        return dataset
    return dataset.map(resolved, with_indices=True, desc="image paths")
