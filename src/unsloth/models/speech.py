"""Speech models transformers builds whole (Sesame CSM): loading them with their processor, and
which of their parts our kernels and LoRA go into.

CSM (`CsmForConditionalGeneration`) is three models in one: a Llama-shaped backbone over text and
audio-frame embeddings that predicts each frame's first codebook, a small Llama-shaped depth
decoder that writes the frame's other codebooks, and the Mimi codec (audio <-> codes). Our text
kernels go into the backbone and the depth decoder through the patch registry (by behaviour, as
for any family); the codec runs frozen under no_grad inside transformers' own forward, so it gets
no LoRA, no patches and no checkpointing. Its `generate(..., output_audio=True)` decodes only the frames
the codec can (decode_audio_safely). The Unsloth notebook loads it as
``FastModel.from_pretrained(name, auto_model=CsmForConditionalGeneration)``.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn

log = logging.getLogger("unsloth")

CODEC = "codec_model"  # where transformers' speech models keep their audio codec
CODEC_MODULES = rf"{CODEC}\..*"  # peft exclude_modules: nothing inside the codec is adapted


def codec_of(model: nn.Module) -> nn.Module | None:
    """The audio codec inside a speech model (under a peft wrapper too), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    codec = getattr(base, CODEC, None)
    return codec if isinstance(codec, nn.Module) else None


def outside_codec(model: nn.Module) -> list[nn.Module]:
    """The model's top-level parts other than its codec (CSM: backbone, depth decoder, heads)."""
    codec = codec_of(model)
    return [child for child in model.children() if child is not codec]


def speech_model_class(model_name: str, **hub):
    """The transformers class of a text-to-speech checkpoint that is not a causal LM (CSM), else None."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTextToWaveform

    try:
        config_class = type(AutoConfig.from_pretrained(model_name, **hub))
    except (OSError, ValueError):  # not readable here: the loader will say why
        return None
    if config_class in AutoModelForCausalLM._model_mapping:
        return None
    try:
        return AutoModelForTextToWaveform._model_mapping[config_class]
    except KeyError:
        return None


def load_speech_pretrained(model_name: str, auto_model, *args, whisper_language: str | None = None,
                           whisper_task: str | None = None, **options):
    """Load `model_name` as `auto_model` (a transformers class) with its processor, our kernels in its
    text parts. Returns (model, processor); takes load_pretrained's options. `whisper_language` and
    `whisper_task` ("English", "transcribe") are the transcription prefix its tokenizer puts before
    every text, as a Whisper processor loaded with `language=` and `task=` has it."""
    from unsloth.models.loader import load_pretrained
    from unsloth.models.vision import load_processor

    model, processor = load_pretrained(model_name, *args, auto_class=auto_model, load_tokenizer=load_processor,
                                       **options)
    if whisper_language is not None or whisper_task is not None:
        set_transcription_prefix(processor, whisper_language, whisper_task)
    return decode_audio_safely(model), processor


def set_transcription_prefix(processor, language: str | None, task: str | None) -> None:
    """Give a Whisper tokenizer its language and task prefix tokens (what labels start with)."""
    from unsloth.errors import UsageError

    tokenizer = getattr(processor, "tokenizer", processor)
    if not hasattr(tokenizer, "set_prefix_tokens"):
        raise UsageError(f"whisper_language / whisper_task: {type(tokenizer).__name__} has no transcription "
                         "prefix to set (only a Whisper tokenizer has one)",
                         fix="leave whisper_language and whisper_task out for this model")
    try:
        tokenizer.set_prefix_tokens(language=language, task=task)
    except ValueError as e:  # an unknown language or task: transformers names the ones it knows
        raise UsageError(f"whisper_language={language!r}, whisper_task={task!r}: {e}",
                         fix="pass a language Whisper knows (\"English\" or \"en\") and task=\"transcribe\" or "
                             "\"translate\"") from None


def _end_codes(model: nn.Module) -> tuple[int, int] | None:
    """(end-of-audio code, the codec's codebook size) of a model whose generate decodes frames of codes
    through its codec (CSM: ``generate(..., output_audio=True)``), else None."""
    codec = codec_of(model)
    eos = getattr(model.config, "codebook_eos_token_id", None)
    size = getattr(getattr(codec, "config", None), "codebook_size", None)
    if codec is None or not isinstance(eos, int) or not isinstance(size, int):
        return None
    if "output_audio" not in inspect.signature(type(model).generate).parameters:
        return None
    return eos, size


def audio_frames(codes: torch.Tensor, eos: int, codebook_size: int) -> tuple[torch.Tensor, str | None]:
    """The frames of one generated sequence ([frames, codebooks]) the codec can decode, and why it stops
    early (None: all of them). They end before the first end-of-audio frame, by generation's own rule
    (every codebook but the last holds the end code), and before the first frame with a code the codec
    has no entry for (CSM's heads have more codes than Mimi's codebooks: csm-1b's 2051 against 2048)."""
    ended = (codes[:, :-1] == eos).all(dim=-1) if codes.shape[-1] > 1 else codes[:, 0] == eos
    outside = ((codes < 0) | (codes >= codebook_size)).any(dim=-1)
    stop, why = codes.shape[0], None
    if ended.any():
        stop = int(ended.nonzero()[0])
    if outside[:stop].any():
        stop = int(outside.nonzero()[0])
        bad = codes[stop][(codes[stop] < 0) | (codes[stop] >= codebook_size)]
        why = f"frame {stop} holds code {int(bad[0])}, outside the codec's {codebook_size}-entry codebooks"
    return codes[:stop], why


def decode_audio_safely(model: nn.Module) -> nn.Module:
    """`model` whose ``generate(..., output_audio=True)`` decodes only the frames the codec can (see
    audio_frames): an empty waveform where the first frame already ends the audio, and a warning naming the
    frame and code where a code is outside the codec's codebooks. transformers' own decoding crashes on
    both (a convolution over no frames; an index past the codec's codebook). Other models: unchanged."""
    found = _end_codes(model)
    if found is None:
        return model
    eos, size = found
    original = model.generate

    @functools.wraps(original)
    def generate(*args, output_audio: bool = False, **kwargs):
        output = original(*args, **kwargs)
        if not output_audio:
            return output
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        codec = codec_of(model)
        audio = []
        with torch.no_grad():
            for row, codes in enumerate(sequences):
                frames, why = audio_frames(codes, eos, size)
                if why:
                    log.warning("unsloth: generated audio %d is cut at %s; the frames before it are kept", row, why)
                if not len(frames):
                    log.warning("unsloth: generated audio %d ends at its first frame: an empty waveform", row)
                    audio.append(torch.zeros(0, dtype=next(codec.parameters()).dtype, device=codes.device))
                    continue
                audio.append(codec.decode(frames.transpose(0, 1).unsqueeze(0)).audio_values[0, 0])
        if isinstance(output, torch.Tensor):
            return audio
        output.audio = audio
        return output

    model.generate = generate
    return model
