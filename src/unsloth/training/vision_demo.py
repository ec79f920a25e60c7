"""The vision demo: teach a tiny vision-language model, built here, to caption 12 shipped pictures.

`unsloth train --demo vision` runs anywhere, CPU included, in a few minutes: a byte-level BPE tokenizer
and a small Qwen2.5-VL-architecture model with random weights (both towers), its PIL image processor,
LoRA on both towers through FastVisionModel's path (the vision collator, TRL's SFTTrainer), then each
picture captioned by the trained model. The merged model and its processor are saved as an ordinary
transformers folder.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from unsloth.training.demo import DemoResult

CAPTIONS = "captions.jsonl"
DEFAULT_OUTPUT = "unsloth-vision-demo"
QUESTION = "What is in this picture?"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_SIZE = 32
PATCH = 8


def _data_dir() -> Path:
    return Path(str(resources.files("unsloth.training") / "data"))


def load_pictures() -> list[tuple[object, str]]:
    """(PIL image, caption) pairs of the shipped pictures."""
    from PIL import Image

    rows = [json.loads(line) for line in (_data_dir() / CAPTIONS).read_text().splitlines() if line.strip()]
    return [(Image.open(_data_dir() / r["image"]).convert("RGB"), r["caption"]) for r in rows]


def build_processor(captions: list[str]):
    """A Qwen2.5-VL processor: a byte-level BPE trained on the demo's text, the PIL image processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    from unsloth.models.vision import without_video

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*captions, QUESTION, "user assistant system\n"], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=CHAT_TEMPLATE, padding_side="right")
    pixels = IMAGE_SIZE * IMAGE_SIZE
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": pixels, "longest_edge": pixels}, patch_size=PATCH,
                                      merge_size=2, temporal_patch_size=2)
    return without_video(Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tokenizer, video_processor=None,
                                              chat_template=CHAT_TEMPLATE)


def build_base_model(directory: str | os.PathLike, seed: int = 0) -> str:
    """Write a small random-weight Qwen2.5-VL model and its processor to `directory`; returns the path."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    processor = build_processor([caption for _, caption in load_pictures()])
    tokenizer = processor.tokenizer
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6]},
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                           patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2, window_size=IMAGE_SIZE,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # a wider head, as in the text demo: a frozen std-0.02 head caps the logits
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return str(directory)


def _chat(image, caption: str | None = None) -> list[dict]:
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]
    if caption is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": caption}]})
    return messages


def caption(model, processor, image, max_new_tokens: int = 8) -> str:
    """The model's greedy caption of one image."""
    import torch

    text = processor.apply_chat_template(_chat(image), tokenize=False, add_generation_prompt=True)
    inputs = processor(images=[image], text=[text], add_special_tokens=False, return_tensors="pt")
    inputs = inputs.to(next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=processor.tokenizer.eos_token_id,
                             pad_token_id=processor.tokenizer.pad_token_id)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def run_vision_demo(output_dir: str = DEFAULT_OUTPUT, max_steps: int = 40, show: int = 12, echo=print) -> DemoResult:
    """Build, train, check and save the vision demo model; returns the loss log and the captions."""
    import torch

    from unsloth.export.merged import save_pretrained_merged
    from unsloth.models.loader import add_lora, model_config
    from unsloth.models.vision import load_vision_pretrained, lora_target_regex
    from unsloth.training import trl_compat
    from unsloth.training.vision import UnslothVisionDataCollator

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # tiny matrices: more threads only spin against other work
    output = Path(output_dir)
    base_dir = build_base_model(output / "base")
    pictures = load_pictures()
    echo(f"unsloth demo: a 4-layer Qwen2.5-VL-architecture model (random weights, both towers) learns to caption "
         f"{len(pictures)} pictures ({max_steps} steps)")
    model, processor = load_vision_pretrained(base_dir, load_in_4bit=False, dtype="float32", max_seq_length=64,
                                              use_gradient_checkpointing=False)
    targets = lora_target_regex(model, vision=True, language=True, attention=True, mlp=True)
    model = add_lora(model, r=16, lora_alpha=32, target_modules=targets, use_gradient_checkpointing=False,
                     random_state=0)
    compat = trl_compat.install()
    data = [{"messages": _chat(image, text)} for image, text in pictures]
    trainer = compat["SFTTrainer"](
        model=model, processing_class=processor, data_collator=UnslothVisionDataCollator(model, processor),
        train_dataset=data,
        args=compat["SFTConfig"](
            output_dir=str(output / "checkpoints"), max_steps=max_steps, per_device_train_batch_size=len(data),
            learning_rate=5e-3, lr_scheduler_type="cosine", warmup_steps=5, weight_decay=0.0, seed=0,
            logging_steps=max(1, min(10, max_steps // 10)), save_strategy="no", report_to="none",
            remove_unused_columns=False, dataset_text_field="", dataset_kwargs={"skip_prepare_dataset": True},
            max_length=64, use_cpu=not torch.cuda.is_available(), disable_tqdm=True),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    model.eval()
    model_config(model).use_cache = True
    answers = [(QUESTION, text, caption(model, processor, image)) for image, text in pictures[:show]]
    merged_dir = str(output / "merged")
    save_pretrained_merged(model, merged_dir, processor, save_method="merged_16bit")
    demo = DemoResult(losses, answers, merged_dir)
    for (_, expected, got), (_, name) in zip(answers, pictures):
        echo(f"  [{'ok ' if got == expected else 'MISS'}] picture of {name} -> {got}")
    echo(f"loss {losses[0]:.2f} -> {losses[-1]:.2f}; {demo.correct}/{len(answers)} captions right; "
         f"merged model + processor saved to {merged_dir}")
    return demo
