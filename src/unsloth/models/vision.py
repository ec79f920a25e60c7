"""Loading a vision-language model with our kernels in its language model, and choosing LoRA targets
in its two towers.

transformers builds the model (AutoModelForImageTextToText) and its processor (AutoProcessor); our part
is the text kernels inside the language model (the patch registry, behaviour-checked as for text
models), the vision tower frozen or adapted as asked, and a processor that works where torchvision is
missing (the slow PIL image processors; videos need torchvision).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re

from torch import nn

from unsloth.errors import UnslothError

log = logging.getLogger("unsloth")

# Where the towers live in transformers' composite models (module path components).
VISION_PARTS = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "embed_vision")
# An audio tower beside them (Gemma 4 E2B / E4B): llama.cpp's projector file holds it too.
AUDIO_PARTS = ("audio_tower", "embed_audio")
ATTENTION_PARTS = ("attn", "attention")
MLP_PARTS = ("mlp", "feed_forward", "ffn", "merger", "multi_modal_projector", "embed_vision")


class _NoVideo:
    """Between a processor class and ProcessorMixin: drops the video processor from the parts."""

    def __init__(self, *args, **kwargs):
        from transformers.processing_utils import ProcessorMixin

        kwargs.pop("video_processor", None)
        full = type(self).__mro__[1].get_attributes()
        if "video_processor" in full and len(args) > full.index("video_processor"):
            args = args[: full.index("video_processor")] + args[full.index("video_processor") + 1:]
        ProcessorMixin.__init__(self, *args, **kwargs)
        self.video_processor = None

    @classmethod
    def get_attributes(cls):
        return [name for name in super().get_attributes() if name != "video_processor"]


def without_video(processor_class):
    """`processor_class` built with no video processor (its base class needs torchvision): images
    and text only. Its name stays the same, so what it saves loads with AutoProcessor where
    torchvision is installed."""
    from transformers.processing_utils import ProcessorMixin

    if "video_processor" not in processor_class.get_attributes():
        return processor_class
    shim = type("_NoVideo", (_NoVideo, ProcessorMixin), {})
    return type(processor_class.__name__, (processor_class, shim), {"__module__": processor_class.__module__})


class _TokenizerAttributes:
    """Mixed into a processor's class: what the processor lacks, its tokenizer answers (pad_token,
    eos_token_id, convert_tokens_to_ids, ...), as notebooks that call the processor `tokenizer` expect."""

    def __getattr__(self, name):
        tokenizer = self.__dict__.get("tokenizer")
        if name.startswith("_") or tokenizer is None:  # private names stay the processor's own
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(tokenizer, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object (and its tokenizer) has no attribute "
                                 f"{name!r}") from None

    def __reduce_ex__(self, protocol):
        # pickled as its own processor class (pickle finds that one by name), answering again once loaded
        return _answering_again, (type(self).__mro__[1], self.__dict__.copy())


def _answering_again(processor_class, state):
    processor = processor_class.__new__(processor_class)
    processor.__dict__.update(state)
    return with_tokenizer_attributes(processor)


def _is_conversation(text) -> bool:
    """A list of role/content messages, or a list of such lists."""
    first = text[0] if isinstance(text, list) and text else None
    if isinstance(first, list):
        first = first[0] if first else None
    return isinstance(first, dict) and "role" in first


def _rendering_conversations(call):
    """The processor's `__call__`, also given a conversation as its text (the vision GRPO notebooks'
    `tokenizer(image, dataset[i]["prompt"])`): rendered through the chat template first, with the
    generation prompt unless `add_generation_prompt=False`, as Unsloth's processors do."""

    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        positional = "text" not in kwargs and len(args) > 1  # transformers' order: images, text, ...
        text = args[1] if positional else kwargs.get("text")
        if _is_conversation(text):
            text = self.apply_chat_template(text, tokenize=False,
                                            add_generation_prompt=kwargs.pop("add_generation_prompt", True))
            if positional:
                args = (args[0], text, *args[2:])
            else:
                kwargs["text"] = text
        return call(self, *args, **kwargs)

    return __call__


@functools.cache
def _answering_for_tokenizer(processor_class):
    return type(processor_class.__name__, (processor_class, _TokenizerAttributes),
                {"__module__": processor_class.__module__, "__qualname__": processor_class.__qualname__,
                 "__call__": _rendering_conversations(processor_class.__call__)})


def with_tokenizer_attributes(processor):
    """`processor`, answering for its tokenizer where it has no attribute of its own, and taking a
    conversation as its text (same class name, so what it saves loads as before). A processor without
    a tokenizer is returned as it is."""
    if getattr(processor, "tokenizer", None) is not None and not isinstance(processor, _TokenizerAttributes):
        processor.__class__ = _answering_for_tokenizer(type(processor))
    return processor


def _processor_class(model_name: str, **hub):
    """The processor class a folder or hub name was saved with (its processor_config.json), else the
    one transformers maps its model config to; None if neither says."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
    from transformers.processing_utils import ProcessorMixin

    try:
        saved = ProcessorMixin.get_processor_dict(model_name, **hub)[0].get("processor_class")
    except (OSError, ValueError, TypeError):
        saved = None
    if saved and hasattr(transformers, saved):
        return getattr(transformers, saved)
    try:
        return PROCESSOR_MAPPING[type(AutoConfig.from_pretrained(model_name, **hub))]
    except (KeyError, OSError, ValueError):
        return None


def load_processor(model_name: str, **hub):
    """The model's processor; without torchvision, the same processor over its PIL image processor."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    processor_class = None if is_torchvision_available() else _processor_class(model_name, **hub)
    if processor_class is None:
        return _with_saved_special_tokens(AutoProcessor.from_pretrained(model_name, **hub))
    loaders = {"tokenizer": AutoTokenizer, "image_processor": AutoImageProcessor,
               "feature_extractor": AutoFeatureExtractor}
    parts = {name: loaders[name].from_pretrained(model_name, **hub)
             for name in without_video(processor_class).get_attributes()}
    options = {}
    accepted = inspect.signature(processor_class.__init__).parameters
    try:  # the processor's own settings (image_seq_length, ...) and its chat template
        saved, _ = processor_class.get_processor_dict(model_name, **hub)
        options = {k: v for k, v in saved.items() if k in accepted and k not in parts and k != "video_processor"}
    except (OSError, ValueError, TypeError):
        pass
    if not options.get("chat_template") and "chat_template" in accepted:  # WhisperProcessor takes none
        options["chat_template"] = getattr(parts["tokenizer"], "chat_template", None)
    if "video_processor" in processor_class.get_attributes():
        parts["video_processor"] = None
    return _with_saved_special_tokens(without_video(processor_class)(**parts, **options))


def _with_saved_special_tokens(processor):
    """`processor` with its tokenizer's saved extra special tokens (Gemma 4's processor replaces them
    with its video token): a loaded and saved processor keeps them, and llama.cpp's converter, which
    marks only special tokens as control tokens, sees them."""
    tokenizer = getattr(processor, "tokenizer", None)
    saved = getattr(tokenizer, "init_kwargs", {}).get("extra_special_tokens")
    if isinstance(saved, list) and hasattr(tokenizer, "extra_special_tokens"):
        lost = [t for t in saved if isinstance(t, str) and t not in tokenizer.extra_special_tokens]
        if lost:
            tokenizer.add_special_tokens({"extra_special_tokens": lost}, replace_extra_special_tokens=False)
    return processor


def is_vision_module(name: str) -> bool:
    return any(part in name.split(".") for part in VISION_PARTS)


def is_audio_module(name: str) -> bool:
    return any(part in name.split(".") for part in AUDIO_PARTS)


def lora_target_regex(model: nn.Module, vision: bool, language: bool, attention: bool, mlp: bool,
                      names=None, audio: bool = False) -> str:
    """A peft target_modules regex for the linear layers the finetune_* switches select.

    Layers are told apart by where they are: in the vision tower (or the projector), the audio tower
    (Gemma 4 E2B / E4B; `audio`, off by default as in Unsloth) or the language model; under an
    attention or an MLP module. `names` narrows to those leaf names (a notebook's target_modules list).
    The LM head is never a target.
    """
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.endswith("lm_head"):
            continue
        parts = name.split(".")
        if names is not None and parts[-1] not in names:
            continue
        if not (audio if is_audio_module(name) else vision if is_vision_module(name) else language):
            continue
        in_attention = any(key in part for part in parts[:-1] for key in ATTENTION_PARTS)
        in_mlp = not in_attention and any(key in part for part in parts for key in MLP_PARTS)
        if (in_attention and attention) or (in_mlp and mlp) or (not in_attention and not in_mlp and attention and mlp):
            chosen.append(name)
    if not chosen:
        raise ValueError("the finetune_* switches select no linear layers of this model; turn on "
                         "finetune_language_layers or finetune_vision_layers, and attention or MLP modules")
    # layer numbers become \d+, so the regex stays short (one entry per kind of layer)
    shapes = sorted({re.sub(r"\\\.(\d+)\\\.", r"\\.\\d+\\.", re.escape(n)) for n in chosen})
    return "^(?:" + "|".join(shapes) + ")$"


def load_vision_pretrained(model_name: str, **options):
    """Load a vision-language model and its processor, with our kernels in its language model.
    Returns (model, processor); takes load_pretrained's options (4-bit, dtype, checkpointing...)."""
    from transformers import AutoModelForImageTextToText

    from unsloth.models.loader import load_pretrained

    hub = {k: options[k] for k in ("token", "revision", "trust_remote_code") if options.get(k) is not None}
    config = read_model_config(model_name, **hub)
    if config is not None:  # else the loader below says why it cannot read the model
        check_tower_backends(config)
    return load_pretrained(model_name, auto_class=AutoModelForImageTextToText, load_tokenizer=load_processor,
                           **options)


def is_vision_language(model_name: str, **hub) -> bool:
    """Whether a folder or hub name holds a vision-language (or audio-text) model: its config has a
    vision or an audio tower, and transformers builds it as an image-text-to-text model (Gemma 3 /
    3n / 4, Qwen-VL, Llama 3.2 Vision, ...). False where the config cannot be read here: the text
    loader then says why."""
    config = read_model_config(model_name, **hub)
    return config is not None and is_vision_language_config(config)


def read_model_config(model_name: str, **hub):
    """The config of a folder or hub name, or of its base model where it holds LoRA adapters
    (model.save_pretrained after get_peft_model); None where it cannot be read here (not found,
    offline, a config transformers rejects: the loader names it). A config that needs timm to be
    read (Gemma 3n) where timm is missing is refused with the fix."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_name, **hub)
    except Exception as error:  # noqa: BLE001 - see the docstring
        if isinstance(error, ImportError):
            _refuse_missing_backend(error)
        base = _adapters_base(model_name, **hub)
        if base is None:
            return None
        try:
            return AutoConfig.from_pretrained(base, **{k: v for k, v in hub.items() if k != "revision"})
        except Exception:  # noqa: BLE001 - as above
            return None


def _adapters_base(model_name: str, **hub) -> str | None:
    """The base model a folder or hub name of peft adapters names, else None."""
    try:
        from peft import PeftConfig

        where = {k: v for k, v in hub.items() if k in ("token", "revision")}
        return PeftConfig.from_pretrained(model_name, **where).base_model_name_or_path
    except Exception:  # noqa: BLE001 - no adapters there (or peft missing): not an adapter folder
        return None


def is_vision_language_config(config) -> bool:
    """A model config with a vision or an audio tower that AutoModelForImageTextToText builds."""
    from transformers import AutoModelForImageTextToText

    towers = any(getattr(config, part, None) is not None for part in ("vision_config", "audio_config"))
    remote = AutoModelForImageTextToText.__name__ in (getattr(config, "auto_map", None) or {})
    return towers and (remote or type(config) in AutoModelForImageTextToText._model_mapping)


def _timm_missing(model: str) -> UnslothError:
    return UnslothError(
        f"{model}'s vision tower is a timm model (Gemma 3n's MobileNetV5), and timm is not installed",
        "pip install timm, with the torchvision release built for your torch (from the index your torch "
        "came from: PyPI's CUDA torchvision does not load on a CPU torch)")


def check_tower_backends(config) -> None:
    """Refuses a model whose vision tower transformers builds through timm (TimmWrapperModel: Gemma 3n)
    where timm cannot be imported, before any weight is read."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING
    from transformers.utils import is_timm_available

    vision = getattr(config, "vision_config", None)
    tower = None if vision is None else MODEL_MAPPING.get(type(vision), None)
    if tower is not None and tower.__name__.startswith("Timm") and not is_timm_available():
        raise _timm_missing(type(config).__name__.removesuffix("Config"))


def _refuse_missing_backend(error: ImportError) -> None:
    """An ImportError of transformers' that names timm (a config that needs it to be read) as our error."""
    if "timm" in str(error):
        raise _timm_missing("This model") from error
