"""Sesame CSM (tiny, random): our kernels in its Llama-shaped backbone and depth decoder, none in its
Mimi codec, with the stock model's loss and LoRA gradients (plain and checkpointed)."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_csm import tiny_csm, training_batch
from tiny_families import DECODER_TARGETS
from unsloth.models.checkpointing import apply_gradient_checkpointing
from unsloth.models.patches import patch_model, patch_peft_model
from unsloth.models.speech import CODEC_MODULES, codec_of, outside_codec


def _with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=DECODER_TARGETS,
                                             exclude_modules=CODEC_MODULES))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # nonzero B, so every LoRA A gets a gradient too
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_the_codec_is_found_and_left_out():
    model, _ = tiny_csm()
    assert codec_of(model) is model.codec_model
    assert codec_of(_with_lora(copy.deepcopy(model))) is not None  # under peft too
    parts = outside_codec(model)
    assert model.backbone_model in parts and model.depth_decoder in parts and model.codec_model not in parts


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, "unsloth"], ids=["plain", "checkpointed"])
def test_csm_takes_our_kernels_in_backbone_and_depth_decoder_with_the_stock_loss_and_gradients(checkpointing):
    reference, processor = tiny_csm()
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    # 2 layers x (2 norms, RoPE, MLP) + a final norm, in each of the backbone and the depth decoder
    assert report.skipped is None and report.generic_only is None
    assert (report.rms_norm, report.rope, report.mlp) == (10, 4, 4)
    # its loss adds the depth decoder's to the backbone's: the fused causal-LM loss does not give it,
    # so the probe leaves the loss stock
    assert not report.loss
    codec = patched.codec_model
    assert not any(getattr(m, "_unsloth_rope", False) or hasattr(m, "_unsloth_act") for m in codec.modules())
    assert {type(m).__name__ for m in codec.modules()} == {type(m).__name__ for m in reference.codec_model.modules()}

    batch = training_batch(processor)
    with torch.no_grad():
        torch.testing.assert_close(patched(**batch).loss, reference(**batch).loss, rtol=1e-5, atol=1e-5)

    reference, patched = _with_lora(reference), _with_lora(patched)
    assert not any("lora_" in name for name, _ in patched.get_base_model().codec_model.named_parameters())
    assert {k: n for k, n in patch_peft_model(patched).lora.items() if n} == {"MLP": 4, "linear": 16}
    if checkpointing:  # the backbone's and depth decoder's layers; the codec's run under no_grad
        assert apply_gradient_checkpointing(patched.get_base_model(), checkpointing) == 4
    for model in (reference, patched):
        model.train()
        model.zero_grad()
    ref_loss, fast_loss = reference(**batch).loss, patched(**batch).loss
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-5, atol=1e-5)
    ref_loss.backward()
    fast_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    fast_grads = {n: p.grad for n, p in patched.named_parameters() if p.requires_grad}
    assert ref_grads.keys() == fast_grads.keys() and len(ref_grads) == 2 * (16 + 12)
    for name, grad in ref_grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_text_to_speech_checkpoint_that_is_no_causal_lm_gets_its_class(tmp_path):
    from transformers import CsmForConditionalGeneration

    from tiny_csm import save_tiny_csm
    from tiny_families import save_tiny
    from unsloth.models.speech import speech_model_class

    assert speech_model_class(save_tiny_csm(tmp_path / "csm")) is CsmForConditionalGeneration
    assert speech_model_class(str(save_tiny("llama", tmp_path / "llama"))) is None  # FastLanguageModel's
    assert speech_model_class(str(tmp_path / "missing")) is None  # the loader says what is wrong


def test_audio_codes_audio_round_trip_through_the_models_own_codec():
    from tiny_csm import CODEBOOK_SIZE, CODEBOOKS, SAMPLES_PER_FRAME, clip

    model, processor = tiny_csm()
    audio = processor.feature_extractor(clip(0.2), sampling_rate=24000, return_tensors="pt")["input_values"]
    with torch.no_grad():
        codes = model.codec_model.encode(audio).audio_codes  # 4800 samples: 3 frames (the last one partial)
        assert codes.shape == (1, CODEBOOKS, 3) and 0 <= int(codes.min()) and int(codes.max()) < CODEBOOK_SIZE
        wave = model.codec_model.decode(codes).audio_values
    assert wave.shape == (1, 1, 3 * SAMPLES_PER_FRAME) and torch.isfinite(wave).all()


def _forced(module, codes_by_call):
    """A forward hook making `module`'s logits pick codes_by_call[i] (a code, or None: free) at its i-th call."""
    calls = []

    def hook(_, __, logits):
        code = codes_by_call[min(len(calls), len(codes_by_call) - 1)]
        calls.append(code)
        if code is None:
            return logits
        forced = torch.full_like(logits, -1e4)
        forced[..., code] = 0.0
        return forced

    return module.register_forward_hook(hook)


def _codec_codes_only(module, codebook_size):
    return module.register_forward_hook(lambda _, __, logits: logits.index_fill(
        -1, torch.arange(codebook_size, logits.shape[-1]), -1e4))


@pytest.mark.slow
def test_csm_audio_from_frames_the_codec_cannot_decode_is_a_clear_result(tmp_path, caplog, monkeypatch):
    """transformers' CSM decoding crashes where the first frame is end-of-audio (a convolution over no
    frames) and where a generated code is past the codec's codebooks (csm-1b: 2051 codes against 2048).
    Through FastModel: an empty waveform for the first, and for the second the frames before the bad one,
    with a warning naming it."""
    from transformers import CsmForConditionalGeneration

    from tiny_csm import CODEBOOK_SIZE, SAMPLES_PER_FRAME, save_tiny_csm
    from unsloth import FastModel

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # the decoding is checked here; the kernels above
    model, processor = FastModel.from_pretrained(save_tiny_csm(tmp_path / "csm", codes=CODEBOOK_SIZE + 3),
                                                 auto_model=CsmForConditionalGeneration, load_in_4bit=False,
                                                 dtype=torch.float32)
    FastModel.for_inference(model)
    inputs = processor("[0]the cat sat", add_special_tokens=True)
    greedy = dict(max_new_tokens=4, do_sample=False, depth_decoder_do_sample=False)
    heads = model.depth_decoder.codebooks_head

    hooks = [_forced(model.lm_head, [0]), _forced(heads, [0])]  # every code the end code: audio ends at once
    with caplog.at_level("WARNING", logger="unsloth"):
        [audio] = model.generate(**inputs, output_audio=True, **greedy)
    [h.remove() for h in hooks]
    assert audio.shape == (0,) and "ends at its first frame" in caplog.text

    caplog.clear()
    past = CODEBOOK_SIZE + 1  # a code the model's heads have and the codec's codebooks do not
    hooks = [_forced(model.lm_head, [1, 1, past, None]), _codec_codes_only(heads, CODEBOOK_SIZE)]
    with caplog.at_level("WARNING", logger="unsloth"):
        out = model.generate(**inputs, output_audio=True, return_dict_in_generate=True, **greedy)
    [h.remove() for h in hooks]
    assert out.sequences[0, 2, 0] == past  # it was generated, and the two frames before it decode
    assert out.audio[0].shape == (2 * SAMPLES_PER_FRAME,) and torch.isfinite(out.audio[0]).all()
    assert f"frame 2 holds code {past}, outside the codec's {CODEBOOK_SIZE}-entry codebooks" in caplog.text

    codes = model.generate(**inputs, **greedy)  # without output_audio: the codes, as transformers gives them
    assert isinstance(codes, torch.Tensor) and codes.dim() == 3
