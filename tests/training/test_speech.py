"""Orpheus-style TTS: the SNAC token layout, the codec round trip on a tiny random SNAC, and a few
training steps of a tiny Llama with the extended vocabulary through FastLanguageModel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unsloth.errors import UsageError
from unsloth.training import speech
from unsloth.training.speech import ORPHEUS, SpeechTokens

snac = pytest.importorskip("snac")
soundfile = pytest.importorskip("soundfile")

CODEBOOK = 64  # the tiny codec's codebook: its layout has 7 x 64 audio ids


def tiny_snac(seed: int = 0):
    torch.manual_seed(seed)
    return snac.SNAC(sampling_rate=8000, encoder_dim=8, encoder_rates=[2, 2], decoder_dim=16, decoder_rates=[2, 2],
                     attn_window_size=None, codebook_size=CODEBOOK, codebook_dim=4, vq_strides=[4, 2, 1]).eval()


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory):
    """A tiny SNAC saved as its package saves the hub's (config.json + pytorch_model.bin)."""
    import json

    folder = tmp_path_factory.mktemp("snac")
    model = tiny_snac()
    config = {k: getattr(model, k) for k in ("sampling_rate", "encoder_dim", "encoder_rates", "decoder_dim",
                                             "decoder_rates", "attn_window_size", "codebook_size", "codebook_dim",
                                             "vq_strides")}
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def random_codes(frames: int, codebook: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, codebook, (1, rate * frames), generator=g) for rate in (1, 2, 4)]


def test_default_layout_is_orpheus_3bs_vocabulary():
    # The ids the Orpheus notebook hard-codes (128257 start of speech ... 128266 first audio id).
    assert (ORPHEUS.start_of_speech, ORPHEUS.end_of_speech, ORPHEUS.start_of_human, ORPHEUS.end_of_human,
            ORPHEUS.start_of_ai, ORPHEUS.end_of_ai, ORPHEUS.pad) == tuple(range(128257, 128264))
    assert ORPHEUS.audio_start == 128266 and ORPHEUS.slot_offset(6) == 128266 + 6 * 4096
    assert ORPHEUS.vocab_size == 156940


@pytest.mark.parametrize("layout", [ORPHEUS, SpeechTokens(text_vocab=300, end_of_text=2, codebook_size=CODEBOOK)])
def test_codes_tokens_codes_is_exact(layout):
    codes = random_codes(frames=9, codebook=layout.codebook_size)
    tokens = speech.codes_to_tokens(codes, layout)
    assert len(tokens) == 7 * 9
    # frame 1, slot 4 holds the second level-1 code of that frame; slot 6 the last level-2 one
    assert tokens[7 + 4] == layout.slot_offset(4) + codes[1][0, 3].item()
    assert tokens[7 + 6] == layout.slot_offset(6) + codes[2][0, 7].item()
    assert speech.tokens_to_codes(tokens, layout) == [c[0].tolist() for c in codes]


def test_bad_audio_tokens_are_refused_with_the_fix():
    tokens = speech.codes_to_tokens(random_codes(2, 4096))
    with pytest.raises(UsageError, match="not whole frames of 7"):
        speech.tokens_to_codes(tokens[:-1])
    swapped = [tokens[1], tokens[0], *tokens[2:]]
    with pytest.raises(UsageError, match="not an audio token of slot 0"):
        speech.tokens_to_codes(swapped)
    with pytest.raises(UsageError, match="rates 1 : 2 : 4"):
        speech.codes_to_tokens([c[:, :2] for c in random_codes(2, 4096)])


def test_generated_ids_crop_to_the_last_speech_turn_in_whole_frames():
    layout = ORPHEUS
    audio = speech.codes_to_tokens(random_codes(3, 4096))
    generated = [5, layout.start_of_speech, 999, layout.start_of_speech, *audio, *audio[:3], layout.end_of_speech,
                 *audio]
    assert speech.speech_tokens(generated, layout) == audio


def test_frames_broken_by_a_misplaced_token_are_dropped_so_the_rest_decodes():
    audio = speech.codes_to_tokens(random_codes(3, 4096))
    broken = [*audio[:3], audio[12], *audio[7:]]  # frame 0 cut by a slot-5 token; frames 1 and 2 follow whole
    assert speech.speech_tokens([ORPHEUS.start_of_speech, *broken]) == audio[7:]


def test_duplicate_frames_are_dropped_as_the_notebook_does():
    codes = random_codes(3, 4096)
    codes[0][0, 1] = codes[0][0, 0]  # frame 1 repeats frame 0's coarse code
    tokens = speech.codes_to_tokens(codes)
    assert speech.remove_duplicate_frames(tokens) == tokens[:7] + tokens[14:]


def test_training_row_and_prompt_layout():
    from unsloth.training.demo import build_tokenizer

    tokenizer = build_tokenizer(["hello there speech"], vocab_size=300)
    layout = SpeechTokens(text_vocab=len(tokenizer), end_of_text=tokenizer.eos_token_id, codebook_size=CODEBOOK)
    audio = speech.codes_to_tokens(random_codes(2, CODEBOOK), layout)
    row = speech.training_row(tokenizer, "hello", audio, speaker="tara", layout=layout)
    text = tokenizer.encode("tara: hello", add_special_tokens=True)
    assert row["input_ids"] == [layout.start_of_human, *text, layout.end_of_text, layout.end_of_human,
                                layout.start_of_ai, layout.start_of_speech, *audio, layout.end_of_speech,
                                layout.end_of_ai]
    assert row["labels"] == row["input_ids"] and row["attention_mask"] == [1] * len(row["input_ids"])
    prompt = speech.speech_prompt(tokenizer, "hello", speaker="tara", layout=layout)
    assert row["input_ids"][: len(prompt)] == prompt and prompt[-1] == layout.end_of_human
    with pytest.raises(UsageError):
        speech.training_row(tokenizer, "hello", audio[:-2], layout=layout)


def test_audio_codes_audio_round_trip_through_a_local_snac(codec_dir, tmp_path):
    codec = speech.load_codec(codec_dir)  # the package's own loader, on a local folder
    layout = SpeechTokens(text_vocab=300, end_of_text=2, codebook_size=CODEBOOK)
    t = np.arange(4000) / 16000  # 0.25 s at 16 kHz: resampled to the codec's 8 kHz
    wave = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    tokens = speech.encode_audio(codec, wave, 16000, layout)
    # 2000 samples at 8 kHz, padded to whole coarse frames of hop 4 x stride 4 = 16 samples: 125 frames
    assert len(tokens) == 7 * 125
    levels = speech.tokens_to_codes(tokens, layout)
    with torch.inference_mode():
        direct = codec.encode(torch.from_numpy(speech.resample(wave, 16000, 8000)).view(1, 1, -1))
    assert levels == [c[0].tolist() for c in direct]
    audio = speech.decode_audio(codec, tokens, layout)
    assert audio.dtype == np.float32 and audio.shape == (2000,) and np.isfinite(audio).all()
    path = speech.write_wav(tmp_path / "out" / "speech.wav", audio, codec.sampling_rate)
    back, rate = soundfile.read(str(path), dtype="float32")
    assert rate == 8000 and back.shape == (2000,)
    assert np.allclose(back, np.clip(audio, -1, 1), atol=1e-4)


def test_a_codec_that_does_not_fit_the_layout_is_refused():
    with pytest.raises(UsageError, match="codebook_size=64"):
        speech.encode_audio(tiny_snac(), np.zeros(64, np.float32), 8000)  # ORPHEUS wants 4096


def test_add_speech_tokens_names_the_ids_as_orpheus_does():
    from unsloth.training.demo import build_tokenizer

    tokenizer = build_tokenizer(["hello"], vocab_size=300)
    layout = SpeechTokens(text_vocab=len(tokenizer), end_of_text=tokenizer.eos_token_id, codebook_size=CODEBOOK)
    speech.add_speech_tokens(tokenizer, layout)
    assert len(tokenizer) == layout.vocab_size
    assert tokenizer.convert_tokens_to_ids("<custom_token_10>") == layout.audio_start
    with pytest.raises(UsageError, match="text vocabulary"):
        speech.add_speech_tokens(tokenizer, layout)


def _speech_model(folder, codec):
    """A tiny Llama whose vocabulary is a small text one plus the Orpheus ids, and a dataset of rows."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from unsloth.training.demo import build_tokenizer

    texts = ["the cat sat", "a dog ran far", "hello there", "good morning to you"]
    tokenizer = build_tokenizer(texts, vocab_size=300)
    layout = SpeechTokens(text_vocab=len(tokenizer), end_of_text=tokenizer.eos_token_id, codebook_size=CODEBOOK)
    speech.add_speech_tokens(tokenizer, layout)
    config = LlamaConfig(vocab_size=layout.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=layout.end_of_speech,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a frozen head at std 0.02 caps what LoRA can learn in a few steps
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rng = np.random.default_rng(0)
    rows = [{"text": text, "audio": {"array": rng.standard_normal(112).astype(np.float32) * 0.1,
                                     "sampling_rate": 8000}} for text in texts]
    data = speech.speech_dataset(Dataset.from_list(rows), tokenizer, codec, layout=layout)
    return layout, data


@pytest.mark.slow
def test_tiny_orpheus_trains_through_the_fast_path_and_speaks(codec_dir, tmp_path):
    from transformers import Trainer, TrainingArguments

    from unsloth import FastLanguageModel

    codec = speech.load_codec(codec_dir)
    layout, data = _speech_model(tmp_path / "model", codec)
    assert set(data.column_names) == {"input_ids", "labels", "attention_mask"} and len(data) == 4
    model, tokenizer = FastLanguageModel.from_pretrained(str(tmp_path / "model"), max_seq_length=256,
                                                         dtype=torch.float32, load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing="unsloth",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"])
    report = model.get_base_model()._unsloth_patches
    assert report.skipped is None and report.loss and report.rms_norm and report.lora
    trainer = Trainer(model=model, train_dataset=data, args=TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, gradient_accumulation_steps=1,
        max_steps=5, learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        use_cpu=True))
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 5
    assert np.mean(losses[-2:]) < np.mean(losses[:2])

    FastLanguageModel.for_inference(model)
    waves = speech.generate_speech(model, tokenizer, codec, ["the cat sat"], layout=layout, max_new_tokens=14,
                                   do_sample=False, repetition_penalty=1.0)
    assert len(waves) == 1 and waves[0].dtype == np.float32 and waves[0].ndim == 1
    # whole frames decode to hop x 4 samples each (a generation with none gives an empty clip)
    assert waves[0].size % 16 == 0
