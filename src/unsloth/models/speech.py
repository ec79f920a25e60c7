"""Speech models transformers builds whole (Sesame CSM): loading them with their processor, and
which of their parts our kernels and LoRA go into.

CSM (`CsmForConditionalGeneration`) is three models in one: a Llama-shaped backbone over text and
audio-frame embeddings that predicts each frame's first codebook, a small Llama-shaped depth
decoder that writes the frame's other codebooks, and the Mimi codec (audio <-> codes). Our text
kernels go into the backbone and the depth decoder through the patch registry (by behaviour, as
for any family); the codec runs frozen under no_grad inside transformers' own forward, so it gets
no LoRA, no patches and no checkpointing. The Unsloth notebook loads it as
``FastModel.from_pretrained(name, auto_model=CsmForConditionalGeneration)``.
"""

from __future__ import annotations

from torch import nn

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


def load_speech_pretrained(model_name: str, auto_model, *args, **options):
    """Load `model_name` as `auto_model` (a transformers class) with its processor, our kernels in its
    text parts. Returns (model, processor); takes load_pretrained's options."""
    from unsloth.models.loader import load_pretrained
    from unsloth.models.vision import load_processor

    return load_pretrained(model_name, *args, auto_class=auto_model, load_tokenizer=load_processor, **options)
