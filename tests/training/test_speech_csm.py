"""Sesame CSM as the Unsloth notebook runs it, on a tiny random CSM with a tiny Mimi codec: FastModel
with auto_model, LoRA on the backbone and depth decoder, a few Trainer steps on (text, audio) rows
prepared by the processor, audio generated and decoded to a .wav, LoRA and merged saves reloaded."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny CSM

from tiny_csm import CODEBOOK_SIZE, CODEBOOKS, SAMPLES_PER_FRAME, TEXTS, clip, save_tiny_csm  # noqa: E402

soundfile = pytest.importorskip("soundfile")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _notebook_dataset(processor):
    """The notebook's preprocessing: one conversation turn (speaker, text, audio) per row, padded alike."""
    from datasets import Dataset

    rows = Dataset.from_list([{"text": text, "source": str(i % 2),
                               "audio": {"array": clip(0.15 + 0.05 * i, seed=i), "sampling_rate": 24000}}
                              for i, text in enumerate(TEXTS)])

    def preprocess(example):
        conversation = [{"role": str(example["source"]), "content": [
            {"type": "text", "text": example["text"]},
            {"type": "audio", "path": np.asarray(example["audio"]["array"], dtype=np.float32)}]}]
        inputs = processor.apply_chat_template(
            conversation, tokenize=True, return_dict=True, output_labels=True,
            text_kwargs={"padding": "max_length", "max_length": 24, "pad_to_multiple_of": 8, "padding_side": "right"},
            audio_kwargs={"sampling_rate": 24000, "max_length": 8000, "padding": "max_length"},
            common_kwargs={"return_tensors": "pt"})
        return {key: inputs[key][0] for key in
                ("input_ids", "attention_mask", "labels", "input_values", "input_values_cutoffs")}

    return rows.map(preprocess, remove_columns=rows.column_names)


def _loss(model, batch) -> float:
    model.eval()
    with torch.no_grad():
        return model(**batch).loss.item()


@pytest.mark.slow
def test_tiny_csm_trains_speaks_and_saves_as_the_notebook_does(tmp_path):
    from peft import PeftModel
    from transformers import AutoProcessor, CsmForConditionalGeneration, CsmProcessor, Trainer, TrainingArguments

    from unsloth import FastModel
    from unsloth.models import generation

    folder = save_tiny_csm(tmp_path / "csm")
    model, processor = FastModel.from_pretrained(folder, max_seq_length=256, dtype=None,
                                                 auto_model=CsmForConditionalGeneration, load_in_4bit=False)
    assert isinstance(model, CsmForConditionalGeneration) and isinstance(processor, CsmProcessor)
    model = FastModel.get_peft_model(model, r=16, target_modules=TARGETS, lora_alpha=16, lora_dropout=0,
                                     bias="none", use_gradient_checkpointing="unsloth", random_state=3407)
    report = model.get_base_model()._unsloth_patches
    assert (report.rms_norm, report.rope, report.mlp, report.checkpointed) == (10, 4, 4, 4)
    assert {k: n for k, n in report.lora.items() if n} == {"MLP": 4, "linear": 16}
    trained = {name.split(".")[2] for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"backbone_model", "depth_decoder"}  # the codec stays frozen and adapter-free

    data = _notebook_dataset(processor)
    trainer = Trainer(model=model, train_dataset=data, args=TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_steps=4, learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        use_cpu=True))
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 4 and np.mean(losses[-2:]) < np.mean(losses[:2])

    FastModel.for_inference(model)
    assert not generation.enabled(model)  # CSM keeps its own generate (frames through the depth decoder)
    inputs = processor("[0]the cat sat", add_special_tokens=True)
    torch.manual_seed(0)
    codes = model.generate(**inputs, max_new_tokens=3, do_sample=True, depth_decoder_do_sample=True)
    assert codes.shape[0] == 1 and codes.shape[2] == CODEBOOKS and 1 <= codes.shape[1] <= 3
    assert int(codes.min()) >= 0 and int(codes.max()) < CODEBOOK_SIZE
    torch.manual_seed(0)  # the same draw, now decoded through the codec as the notebook does
    [audio] = model.generate(**inputs, max_new_tokens=3, do_sample=True, depth_decoder_do_sample=True,
                             output_audio=True)
    frames = int((codes[0] != 0).any(dim=-1).cumprod(0).sum())  # up to the first end-of-audio frame
    wave = audio.to(torch.float32).cpu().numpy()
    assert frames >= 1 and wave.shape == (frames * SAMPLES_PER_FRAME,) and np.isfinite(wave).all()
    soundfile.write(str(tmp_path / "speech.wav"), wave, 24000)
    back, rate = soundfile.read(str(tmp_path / "speech.wav"), dtype="float32")
    assert rate == 24000 and back.shape == wave.shape

    batch = data.with_format("torch")[:2]  # what the Trainer's collator builds
    expected = _loss(model, batch)
    model.save_pretrained(tmp_path / "lora")
    processor.save_pretrained(tmp_path / "lora")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "lora").iterdir()}
    adapted = PeftModel.from_pretrained(CsmForConditionalGeneration.from_pretrained(folder), tmp_path / "lora")
    assert _loss(adapted, batch) == pytest.approx(expected, rel=1e-5)

    model.save_pretrained_merged(str(tmp_path / "merged"), processor, save_method="merged_16bit")
    merged = CsmForConditionalGeneration.from_pretrained(tmp_path / "merged")  # plain transformers, no peft
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    assert _loss(merged, batch) == pytest.approx(expected, rel=1e-5)
    assert isinstance(AutoProcessor.from_pretrained(tmp_path / "merged"), CsmProcessor)
