"""Text-to-speech fine-tuning, Orpheus-style: a Llama decoder that writes SNAC audio-codec tokens.

Orpheus extends Llama 3's vocabulary with speech markers and 7 x 4096 audio tokens. The SNAC codec
(its own PyPI package) turns 24 kHz audio into three code levels at 1 : 2 : 4 rates; each coarse
frame becomes 7 tokens, one per slot, each slot with its own 4096-token range:

    slot:   0        1        2        3        4          5        6
    code:   l0[i]    l1[2i]   l2[4i]   l2[4i+1] l1[2i+1]   l2[4i+2] l2[4i+3]

A training row is ``start_of_human, text (bos ... end_of_text), end_of_human, start_of_ai,
start_of_speech, audio tokens, end_of_speech, end_of_ai`` with the labels equal to the ids, as the
Unsloth Orpheus notebook lays it out; generation is prompted with the human turn and stops at
end_of_speech. The model itself trains as any causal LM, through ``FastLanguageModel`` (our fast path).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from unsloth.errors import UnslothError, UsageError

SNAC_24KHZ = "hubertsiuzdak/snac_24khz"  # the codec Orpheus was trained on
FRAME = 7  # tokens per coarse SNAC frame
# slot -> (code level, which of that level's codes in the frame)
_SLOTS = ((0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (2, 2), (2, 3))
_LEVEL_RATES = (1, 2, 4)  # codes per coarse frame at each level: SNAC's vq_strides 4, 2, 1


@dataclass(frozen=True)
class SpeechTokens:
    """The token ids of an Orpheus vocabulary: the text vocabulary, then markers, then audio slots.

    The defaults are Orpheus 3B's (Llama 3 text ids, 4096-entry SNAC codebooks: 156940 tokens in
    all); a smaller model or codec gets its own by naming its text vocabulary and codebook size.
    """

    text_vocab: int = 128256
    end_of_text: int = 128009  # Llama 3's <|eot_id|>, closing the text prompt
    codebook_size: int = 4096

    @property
    def start_of_speech(self) -> int:
        return self.text_vocab + 1

    @property
    def end_of_speech(self) -> int:
        return self.text_vocab + 2

    @property
    def start_of_human(self) -> int:
        return self.text_vocab + 3

    @property
    def end_of_human(self) -> int:
        return self.text_vocab + 4

    @property
    def start_of_ai(self) -> int:
        return self.text_vocab + 5

    @property
    def end_of_ai(self) -> int:
        return self.text_vocab + 6

    @property
    def pad(self) -> int:
        return self.text_vocab + 7

    @property
    def audio_start(self) -> int:
        return self.text_vocab + 10

    @property
    def vocab_size(self) -> int:
        """The embedding rows a model needs (Orpheus adds two unused ids at the end: 156940)."""
        return self.audio_start + FRAME * self.codebook_size + 2

    def slot_offset(self, slot: int) -> int:
        return self.audio_start + slot * self.codebook_size


ORPHEUS = SpeechTokens()


def _bad_audio(problem: str) -> UnslothError:
    return UsageError(problem, "pass audio tokens as the codec and this layout wrote them "
                                 "(codes_to_tokens / encode_audio), whole frames of 7")


# --- codes <-> tokens (pure) --------------------------------------------------------------------

def codes_to_tokens(codes: Sequence, layout: SpeechTokens = ORPHEUS) -> list[int]:
    """SNAC's three code levels (tensors [1, n], [1, 2n], [1, 4n]) -> the flat token list, 7 per frame."""
    levels = [_as_list(level) for level in codes]
    if len(levels) != 3:
        raise _bad_audio(f"the Orpheus layout takes 3 SNAC code levels, got {len(levels)}")
    frames = len(levels[0])
    for level, rate in zip(levels, _LEVEL_RATES):
        if len(level) != rate * frames:
            raise _bad_audio(f"SNAC levels of {[len(v) for v in levels]} codes are not at rates 1 : 2 : 4")
    tokens = []
    for i in range(frames):
        for slot, (level, k) in enumerate(_SLOTS):
            code = levels[level][_LEVEL_RATES[level] * i + k]
            if not 0 <= code < layout.codebook_size:
                raise _bad_audio(f"code {code} is outside a codebook of {layout.codebook_size}")
            tokens.append(layout.slot_offset(slot) + code)
    return tokens


def tokens_to_codes(tokens: Sequence[int], layout: SpeechTokens = ORPHEUS) -> list[list[int]]:
    """The inverse of `codes_to_tokens`: audio tokens (whole frames) -> the three code levels as lists."""
    tokens = [int(t) for t in tokens]
    if len(tokens) % FRAME:
        raise _bad_audio(f"{len(tokens)} audio tokens are not whole frames of {FRAME}")
    levels: list[list[int]] = [[], [], []]
    for start in range(0, len(tokens), FRAME):
        for slot, (level, _) in enumerate(_SLOTS):
            code = tokens[start + slot] - layout.slot_offset(slot)
            if not 0 <= code < layout.codebook_size:
                raise _bad_audio(f"token {tokens[start + slot]} at position {start + slot} is not an audio "
                                 f"token of slot {slot} (ids {layout.slot_offset(slot)}.."
                                 f"{layout.slot_offset(slot + 1) - 1})")
            levels[level].append(code)
    return levels


def remove_duplicate_frames(tokens: Sequence[int]) -> list[int]:
    """Drop each frame whose coarse code repeats the previous kept frame's (the notebook's cleanup
    of silences the codec encodes as runs of one code)."""
    tokens = list(tokens)
    if len(tokens) % FRAME:
        raise _bad_audio(f"{len(tokens)} audio tokens are not whole frames of {FRAME}")
    kept = tokens[:FRAME]
    for start in range(FRAME, len(tokens), FRAME):
        if tokens[start] != kept[-FRAME]:
            kept.extend(tokens[start:start + FRAME])
    return kept


def speech_tokens(generated: Sequence[int], layout: SpeechTokens = ORPHEUS) -> list[int]:
    """The audio frames in one generated sequence, after its last start_of_speech.

    A sampled model can put a token in the wrong slot or stop mid-frame; only whole frames with
    every token in its own slot are kept (a stray token drops the frame it broke, and a slot-0
    token starts the next one), so what comes back always decodes."""
    ids = [int(t) for t in generated]
    starts = [i for i, t in enumerate(ids) if t == layout.start_of_speech]
    audio, frame = [], []
    for token in ids[starts[-1] + 1:] if starts else ids:
        if token == layout.end_of_speech:
            break
        if _in_slot(token, len(frame), layout):
            frame.append(token)
        else:
            frame = [token] if _in_slot(token, 0, layout) else []
        if len(frame) == FRAME:
            audio += frame
            frame = []
    return audio


def _in_slot(token: int, slot: int, layout: SpeechTokens) -> bool:
    return layout.slot_offset(slot) <= token < layout.slot_offset(slot + 1)


# --- rows and prompts ---------------------------------------------------------------------------

def _text_ids(tokenizer, text: str, speaker: str | None, layout: SpeechTokens) -> list[int]:
    prompt = f"{speaker}: {text}" if speaker else text  # multi-speaker models are prompted "name: text"
    return [*tokenizer.encode(prompt, add_special_tokens=True), layout.end_of_text]


def training_row(tokenizer, text: str, audio_tokens: Sequence[int], speaker: str | None = None,
                 layout: SpeechTokens = ORPHEUS) -> dict[str, list[int]]:
    """One SFT row (input_ids, labels, attention_mask): the text turn, then the speech turn."""
    audio = list(audio_tokens)
    tokens_to_codes(audio, layout)  # checks: whole frames, every token in its slot
    ids = [layout.start_of_human, *_text_ids(tokenizer, text, speaker, layout), layout.end_of_human,
           layout.start_of_ai, layout.start_of_speech, *audio, layout.end_of_speech, layout.end_of_ai]
    return {"input_ids": ids, "labels": list(ids), "attention_mask": [1] * len(ids)}


def speech_prompt(tokenizer, text: str, speaker: str | None = None, layout: SpeechTokens = ORPHEUS) -> list[int]:
    """The ids a model is prompted with to speak `text`: the human turn."""
    return [layout.start_of_human, *_text_ids(tokenizer, text, speaker, layout), layout.end_of_human]


# --- the codec (SNAC) ---------------------------------------------------------------------------

def load_codec(name_or_path: str = SNAC_24KHZ, device=None):
    """The SNAC codec from the hub or a local folder (config.json + pytorch_model.bin), in eval mode."""
    try:
        from snac import SNAC
    except ImportError as e:
        raise UnslothError("the SNAC codec is not installed", "pip install 'unsloth[tts]' (snac, soundfile)") from e
    codec = SNAC.from_pretrained(str(name_or_path)).eval()
    return codec.to(device) if device is not None else codec


def _check_codec(codec, layout: SpeechTokens) -> None:
    if list(codec.vq_strides) != [4, 2, 1] or codec.codebook_size != layout.codebook_size:
        raise UsageError(
            f"this SNAC codec (vq_strides {list(codec.vq_strides)}, codebook {codec.codebook_size}) does not "
            f"fit the Orpheus layout (vq_strides [4, 2, 1], codebook {layout.codebook_size})",
            f"use {SNAC_24KHZ} or a layout with codebook_size={codec.codebook_size}")


def resample(waveform, orig_rate: int, new_rate: int):
    """A mono waveform (numpy, 1-D) at `new_rate`, by polyphase filtering (scipy)."""
    import numpy as np

    waveform = np.asarray(waveform, dtype=np.float32)
    if waveform.ndim == 2:  # (samples, channels) as soundfile reads it: mix down
        waveform = waveform.mean(axis=1)
    if int(orig_rate) == int(new_rate):
        return waveform
    from scipy.signal import resample_poly

    g = math.gcd(int(orig_rate), int(new_rate))
    return resample_poly(waveform, int(new_rate) // g, int(orig_rate) // g).astype(np.float32)


def encode_audio(codec, waveform, sample_rate: int, layout: SpeechTokens = ORPHEUS) -> list[int]:
    """Audio (a 1-D array at `sample_rate`) -> Orpheus audio tokens, through the codec."""
    import torch

    _check_codec(codec, layout)
    audio = resample(waveform, sample_rate, codec.sampling_rate)
    if audio.size == 0:
        raise UsageError("the audio is empty", "drop rows without audio before encoding")
    device = next(codec.parameters()).device
    with torch.inference_mode():
        codes = codec.encode(torch.from_numpy(audio).to(device).view(1, 1, -1))
    return codes_to_tokens([c[0].tolist() for c in codes], layout)


def decode_audio(codec, audio_tokens: Sequence[int], layout: SpeechTokens = ORPHEUS):
    """Orpheus audio tokens -> a 1-D float32 waveform at the codec's sampling rate (numpy)."""
    import torch

    _check_codec(codec, layout)
    levels = tokens_to_codes(audio_tokens, layout)
    if not levels[0]:
        raise _bad_audio("no audio frames to decode")
    device = next(codec.parameters()).device
    codes = [torch.tensor(level, dtype=torch.long, device=device).unsqueeze(0) for level in levels]
    with torch.inference_mode():
        audio = codec.decode(codes)
    return audio.detach().float().reshape(-1).cpu().numpy()


def write_wav(path: str | Path, waveform, sample_rate: int) -> Path:
    import soundfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(path), waveform, int(sample_rate))
    return path


# --- datasets and generation --------------------------------------------------------------------

def speech_dataset(dataset, tokenizer, codec, text_column: str = "text", audio_column: str = "audio",
                   speaker_column: str = "source", layout: SpeechTokens = ORPHEUS, dedupe_frames: bool = True):
    """A datasets.Dataset of (text, audio[, speaker]) rows -> training rows, as the Orpheus notebook
    prepares them. Audio is `{"array", "sampling_rate"}` (what datasets' Audio feature yields); rows
    without audio are dropped."""
    missing = [c for c in (text_column, audio_column) if c not in dataset.column_names]
    if missing:
        raise UsageError(f"the dataset has no column {', '.join(map(repr, missing))} "
                           f"(it has {', '.join(dataset.column_names)})",
                           "name the text and audio columns: speech_dataset(..., text_column=, audio_column=)")
    has_speaker = speaker_column in dataset.column_names

    def row(example):
        audio = example[audio_column]
        tokens = encode_audio(codec, audio["array"], audio["sampling_rate"], layout)
        if dedupe_frames:
            tokens = remove_duplicate_frames(tokens)
        return training_row(tokenizer, example[text_column], tokens,
                            example[speaker_column] if has_speaker else None, layout)

    kept = dataset.filter(lambda e: e[audio_column] is not None and len(e[audio_column]["array"]) > 0)
    return kept.map(row, remove_columns=kept.column_names)


def generate_speech(model, tokenizer, codec, texts: str | Iterable[str], speaker: str | None = None,
                    layout: SpeechTokens = ORPHEUS, max_new_tokens: int = 1200, **generate_kwargs) -> list:
    """Speak each text: generate audio tokens (the notebook's sampling defaults) and decode them to
    waveforms at the codec's rate. A text whose generation holds no whole frame gets an empty array."""
    import numpy as np
    import torch

    texts = [texts] if isinstance(texts, str) else list(texts)
    options = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1,
               "eos_token_id": layout.end_of_speech, "pad_token_id": layout.pad, **generate_kwargs}
    if not options["do_sample"]:  # greedy: the sampling settings would only draw a warning
        for name in ("temperature", "top_p", "top_k", "min_p"):
            options.pop(name, None)
    device = next(model.parameters()).device
    waveforms = []
    for text in texts:
        ids = torch.tensor([speech_prompt(tokenizer, text, speaker, layout)], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, **options)
        audio = speech_tokens(out[0, ids.shape[1]:].tolist(), layout)
        waveforms.append(decode_audio(codec, audio, layout) if audio else np.zeros(0, dtype=np.float32))
    return waveforms


def _as_list(level) -> list[int]:
    if hasattr(level, "tolist"):
        level = level.tolist()
    while level and isinstance(level[0], list):  # [1, n] tensors from the codec: the batch of one
        if len(level) != 1:
            raise _bad_audio("codes_to_tokens takes one clip at a time (a batch of 1)")
        level = level[0]
    return [int(c) for c in level]


def add_speech_tokens(tokenizer, layout: SpeechTokens = ORPHEUS):
    """Give a text tokenizer (of exactly `layout.text_vocab` ids) the Orpheus ids, named as Orpheus
    names them (``<custom_token_N>`` is id text_vocab + N), so a base Llama can be trained to speak
    (then ``model.resize_token_embeddings(len(tokenizer))``)."""
    if len(tokenizer) != layout.text_vocab:
        raise UsageError(f"the tokenizer has {len(tokenizer)} ids and this layout's text vocabulary is "
                         f"{layout.text_vocab}", "use SpeechTokens(text_vocab=len(tokenizer), ...) for it")
    names = [f"<custom_token_{i}>" for i in range(layout.vocab_size - layout.text_vocab)]
    tokenizer.add_tokens(names, special_tokens=True)
    return tokenizer
