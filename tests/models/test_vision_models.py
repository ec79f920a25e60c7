"""FastVisionModel on tiny random models of each vision-language family, loaded from local folders."""

from __future__ import annotations

import pytest
import torch

from tiny_vision import VISION_FAMILIES, images, save_tiny_vision, tiny_vision_model
from unsloth.models.vision import is_vision_module

pytest.importorskip("PIL")


def _chat(i: int = 0, answer: str = "t7 t8"):
    return {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"t{5 + i} t6"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "images": images(1, seed=i)}


def _load(family, tmp_path, **options):
    from unsloth import FastVisionModel

    folder = save_tiny_vision(family, tmp_path / family)
    return FastVisionModel.from_pretrained(folder, load_in_4bit=False, dtype="float32", **options)


@pytest.mark.slow
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_our_kernels_in_the_language_model_keep_the_loss_and_gradients(family, tmp_path, one_thread):
    """With our kernels in its language model (and LoRA on both towers), a batch with images gives
    the stock model's loss, and gradients reach the vision tower's adapters."""
    from unsloth import FastVisionModel, UnslothVisionDataCollator
    from unsloth.models.vision import is_vision_module

    model, processor = _load(family, tmp_path)
    report = model._unsloth_patches
    assert report.loss and report.rms_norm and report.mlp, report.summary()
    stock, _ = tiny_vision_model(family)
    batch = UnslothVisionDataCollator(model, processor)([_chat(0), _chat(1, "t9 t10 t11")])
    with torch.no_grad():
        expected = stock(**batch).loss
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True)
    FastVisionModel.for_training(model)
    loss = model(**batch).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-4, atol=1e-4)
    vision = [p.grad for n, p in model.named_parameters() if "lora_B" in n and is_vision_module(n)]  # A gets none while B is 0
    # (a tower's last block can feed nothing the language model reads: most, not all, get a gradient)
    reached = [g is not None and bool(g.abs().sum() > 0) for g in vision]
    assert vision and sum(reached) >= len(reached) / 2, reached


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma4"])
def test_patched_towers_give_the_stock_gradients(family, tmp_path, one_thread):
    """Every adapter (both towers) gets the stock model's gradient through our checkpointed, patched model:
    the vision tower's norms and gated MLPs where it has them (Qwen2.5-VL's MLPs as LoRA MLP kernels,
    Gemma 4's), and the recompute that skips an MLP's output where MLP_FEEDS_RESIDUAL says it is unread."""
    from peft import LoraConfig, get_peft_model

    from unsloth import FastVisionModel, UnslothVisionDataCollator
    from unsloth.models.patches import MLP_FEEDS_RESIDUAL

    model, processor = _load(family, tmp_path)
    report = model._unsloth_patches
    assert bool(report.vision_rms_norm and report.vision_mlp) == (family != "qwen3_vl"), report.summary()
    batch = UnslothVisionDataCollator(model, processor)([_chat(0), _chat(1, "t9 t10 t11")])
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True)
    FastVisionModel.for_training(model)
    if family == "qwen2_5_vl":
        assert report.lora["MLP"] == report.mlp + report.vision_mlp, report.summary()
    skips = [m._unsloth_mlp_feeds_residual for m in model.modules() if hasattr(m, "_unsloth_mlp_feeds_residual")]
    assert skips and all(skip == (family in MLP_FEEDS_RESIDUAL) for skip in skips)
    targets = model.peft_config["default"].target_modules
    stock = get_peft_model(tiny_vision_model(family)[0], LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if "lora_" in name:
                if "lora_B" in name:
                    ours[name].normal_(0.0, 0.2)  # non-zero, so the A matrices get gradients too
                p.copy_(ours[name])
    stock.train()
    for net in (model, stock):
        net(**batch).loss.backward()
    grads = {n: p.grad for n, p in stock.named_parameters() if "lora_" in n and p.grad is not None}
    assert grads and any(is_vision_module(n) for n in grads) and not all(is_vision_module(n) for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(ours[name].grad, grad, rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_finetune_switches_pick_the_towers_and_module_kinds(family):
    from unsloth.models.vision import is_vision_module

    model, _ = tiny_vision_model(family)

    def adapted(**switches):
        import re

        from unsloth.models.vision import lora_target_regex

        pattern = re.compile(lora_target_regex(model, **switches))
        return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and pattern.fullmatch(n)]

    both = adapted(vision=True, language=True, attention=True, mlp=True)
    text = adapted(vision=False, language=True, attention=True, mlp=True)
    vision_only = adapted(vision=True, language=False, attention=True, mlp=True)
    attention = adapted(vision=False, language=True, attention=True, mlp=False)
    assert text and vision_only and set(both) == set(text) | set(vision_only)
    assert not any(is_vision_module(n) for n in text) and all(is_vision_module(n) for n in vision_only)
    assert attention and all("attn" in n for n in attention) and "lm_head" not in " ".join(both)
    with pytest.raises(ValueError, match="select no linear layers"):
        adapted(vision=False, language=False, attention=True, mlp=True)


def test_vision_tower_frozen_when_not_finetuned(tmp_path, monkeypatch, one_thread):
    from unsloth import FastVisionModel

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model, _ = _load("qwen2_5_vl", tmp_path)
    model = FastVisionModel.get_peft_model(model, r=4, finetune_vision_layers=False, target_modules="all-linear")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and not any("visual" in n for n in trainable)
    model = FastVisionModel.get_peft_model(_load("qwen2_5_vl", tmp_path / "again")[0], r=4,
                                           finetune_language_layers=False, target_modules=["qkv", "q_proj"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("visual" in n and "qkv" in n for n in trainable)


@pytest.mark.slow
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_inference_with_an_image_answers_as_the_stock_model(family, tmp_path, monkeypatch, one_thread):
    """for_inference + generate on processor(image, text): the same greedy tokens as the stock model."""
    from unsloth import FastVisionModel

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model, processor = _load(family, tmp_path)
    FastVisionModel.for_inference(model)
    stock, _ = tiny_vision_model(family)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5 t6"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images(1)[0], text, add_special_tokens=False, return_tensors="pt")
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
    ours = model.generate(**inputs, **options)
    theirs = stock.generate(**inputs, **options)
    assert ours.shape[1] > inputs["input_ids"].shape[1]
    assert torch.equal(ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_merged_16bit_save_reloads_with_the_same_logits(family, tmp_path, monkeypatch, one_thread):
    from transformers import AutoModelForImageTextToText

    from unsloth import FastVisionModel, UnslothVisionDataCollator
    from unsloth.models.vision import load_processor

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    model, processor = _load(family, tmp_path)
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, init_lora_weights=False)
    batch = UnslothVisionDataCollator(model, processor)([_chat(0)])
    batch.pop("labels")
    FastVisionModel.for_inference(model)
    with torch.no_grad():
        expected = model(**batch).logits
    model.save_pretrained_merged(str(tmp_path / "merged"), processor, save_method="merged_16bit")
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        got = reloaded(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert load_processor(str(tmp_path / "merged")).apply_chat_template(_chat(0)["messages"], tokenize=False)


def test_a_sub_model_without_the_requested_attention_gets_its_fallback():
    """Gemma 4 E2B / E4B have an audio tower with no SDPA path: asked for SDPA, transformers refuses to
    load the whole model. It gets eager alone; a model whose parts all have SDPA gets the plain string."""
    from transformers import Gemma4AudioConfig

    from tiny_vision import build_processor, vision_config
    from unsloth.models.loader import sub_model_attention

    tokenizer = build_processor("gemma4").tokenizer
    config = vision_config("gemma4", tokenizer)
    assert sub_model_attention(config, "sdpa") == "sdpa"
    config.audio_config = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    chosen = sub_model_attention(config, "sdpa")
    assert chosen["audio_config"] == "eager" and chosen["text_config"] == chosen[""] == "sdpa"
    assert sub_model_attention(vision_config("qwen2_5_vl", build_processor("qwen2_5_vl").tokenizer), "sdpa") == "sdpa"


def test_the_audio_tower_is_adapted_only_when_asked(tmp_path, monkeypatch):
    """Gemma 4 E2B / E4B: FastVisionModel loads it (its audio tower with eager attention), and
    finetune_audio_layers (off by default, as in Unsloth) alone puts LoRA into the audio tower."""
    from transformers import AutoModelForImageTextToText

    from tiny_vision import add_audio_tower, build_processor, vision_config
    from unsloth import FastVisionModel

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    processor = build_processor("gemma4")
    config = add_audio_tower(vision_config("gemma4", processor.tokenizer), processor.tokenizer)
    AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path / "gemma4")
    processor.save_pretrained(tmp_path / "gemma4")

    def adapted(**switches):
        model, _ = FastVisionModel.from_pretrained(str(tmp_path / "gemma4"), load_in_4bit=False, dtype="float32")
        model = FastVisionModel.get_peft_model(model, r=4, **switches)
        return {n.split(".")[3] for n, p in model.named_parameters() if p.requires_grad}  # base_model.model.model.*

    assert adapted() == {"language_model", "vision_tower", "embed_vision"}
    assert adapted(finetune_audio_layers=True, finetune_vision_layers=False) == {"language_model", "audio_tower",
                                                                                   "embed_audio"}
