"""FastLanguageModel: the API fine-tuning notebooks already use, on our kernels.

Loading and LoRA are ``unsloth.models.loader``'s; this class adds the notebook's entry points and
attaches to each model the methods notebooks call on it (merged and GGUF saves, ``save_lora`` /
``load_lora``, ``fast_generate``, the ``push_to_hub_*`` family, a ``generate`` that takes what
``apply_chat_template`` returns). Importing this module also makes TRL's trainers accept what the
notebooks pass (``unsloth.training.trl_compat``), as ``from unsloth import FastLanguageModel``
comes first in every notebook.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Mapping

from unsloth.export.merged import save_pretrained_merged
from unsloth.models import generation
from unsloth.models.loader import add_lora, is_bfloat16_supported, load_pretrained, model_config
from unsloth.models.merge import base_model
from unsloth.models.speech import load_speech_pretrained, speech_model_class
from unsloth.models.vision import (is_vision_language, is_vision_language_config, load_vision_pretrained,
                                   lora_target_regex, with_tokenizer_attributes)
from unsloth.notebook import hub, vllm_compat
from unsloth.training import trl_compat

__all__ = ["FastLanguageModel", "FastModel", "FastVisionModel", "is_bfloat16_supported", "is_bf16_supported",
           "FastLlamaModel", "FastMistralModel", "FastQwen2Model", "FastQwen3Model", "FastGemmaModel",
           "FastGemma2Model", "FastGraniteModel", "FastCohereModel"]

is_bf16_supported = is_bfloat16_supported  # the name the embedding notebooks import

log = logging.getLogger("unsloth")

trl_compat.install()

# get_peft_model keywords of vision-language notebooks -> which LoRA targets they keep, on a text model.
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "dense", "out_proj",
              "c_attn", "c_proj", "Wqkv"}
_MLP = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2", "w1", "w2", "w3", "c_fc",
        "dense_h_to_4h", "dense_4h_to_h"}


class FastLanguageModel:
    """Load, add LoRA, switch train/inference mode, save: the familiar entry points."""

    @staticmethod
    @functools.wraps(load_pretrained)
    def from_pretrained(*args, **kwargs):
        name = kwargs.get("model_name", args[0] if args else None)
        hub = {k: kwargs[k] for k in ("token", "revision", "trust_remote_code") if kwargs.get(k) is not None}
        if isinstance(name, str) and is_vision_language(name, **hub):
            # Magistral Small 2509 is Mistral 3 (a Pixtral tower), and its notebook loads it as a text model
            log.info("unsloth: %s is a vision-language model: loaded with its processor, as FastVisionModel does",
                     name)
            return FastVisionModel.from_pretrained(*args, **kwargs)
        model, tokenizer = load_pretrained(*args, **kwargs)
        _attach(model, tokenizer)
        return model, tokenizer

    @staticmethod
    @functools.wraps(add_lora)
    def get_peft_model(model, *args, finetune_vision_layers: bool = False, finetune_language_layers: bool = True,
                       finetune_attention_modules: bool = True, finetune_mlp_modules: bool = True,
                       finetune_audio_layers: bool = False, **kwargs):
        if _fully_finetuned(model):
            return model
        if _loader_of(model) is FastVisionModel:  # loaded by from_pretrained above: its towers stay as asked
            return FastVisionModel.get_peft_model(
                model, *args, finetune_vision_layers=finetune_vision_layers,
                finetune_language_layers=finetune_language_layers,
                finetune_attention_modules=finetune_attention_modules,
                finetune_mlp_modules=finetune_mlp_modules, finetune_audio_layers=finetune_audio_layers, **kwargs)
        if finetune_audio_layers:
            log.info("unsloth: finetune_audio_layers: this model has no audio tower; its language layers are trained")
        kwargs["target_modules"] = lora_targets(model, kwargs.get("target_modules"), finetune_language_layers,
                                                finetune_attention_modules, finetune_mlp_modules,
                                                finetune_vision_layers)
        peft_model = add_lora(model, *args, **kwargs)
        _attach(peft_model, getattr(model, "_unsloth_tokenizer", None))
        return peft_model

    @staticmethod
    def for_inference(model):
        """Evaluation mode and fast `model.generate`: a static KV cache, the decode step in CUDA graphs
        on a GPU (``unsloth.models.generation``). LoRA adapters stay unmerged, so training can resume."""
        model.eval()
        return generation.enable(model)

    @staticmethod
    def for_training(model, use_gradient_checkpointing: bool | str = True):
        """Back to training mode and plain `generate` (checkpointing stays as get_peft_model set it)."""
        generation.disable(model)
        model.train()
        model_config(model).use_cache = False
        return model


# The per-family loaders older notebooks import (`from unsloth import FastQwen2Model`): the same loader,
# which reads the family from the checkpoint's config.
FastLlamaModel = FastMistralModel = FastQwen2Model = FastQwen3Model = FastLanguageModel
FastGemmaModel = FastGemma2Model = FastGraniteModel = FastCohereModel = FastLanguageModel


class FastModel(FastLanguageModel):
    """Unsloth's general loader: it loads a checkpoint as what it is.

    - A vision-language or audio-text model (its config has a vision or an audio tower and transformers
      builds it as image-text-to-text: Gemma 3 / 3n / 4, Qwen-VL, Llama 3.2 Vision): FastVisionModel's
      loader, returning (model, processor).
    - A text-to-speech model that is no causal LM (Sesame CSM), or the transformers class `auto_model`
      names: that class with its processor.
    - Anything else (causal LMs, Orpheus-style TTS): FastLanguageModel's loader, (model, tokenizer).

    get_peft_model, for_inference and for_training are FastVisionModel's on a vision-language model and
    FastLanguageModel's otherwise."""

    @staticmethod
    def from_pretrained(model_name: str = "unsloth/Llama-3.2-1B-Instruct", *args, auto_model=None, **kwargs):
        hub = {k: kwargs[k] for k in ("token", "revision", "trust_remote_code") if kwargs.get(k) is not None}
        if auto_model is None and is_vision_language(model_name, **hub):
            return FastVisionModel.from_pretrained(model_name, *args, **kwargs)
        auto_model = auto_model or speech_model_class(model_name, **hub)
        if auto_model is None:
            return FastLanguageModel.from_pretrained(model_name, *args, **kwargs)
        model, processor = load_speech_pretrained(model_name, auto_model, *args, **kwargs)
        processor = with_tokenizer_attributes(processor)  # Whisper's notebook reads tokenizer.pad_token_id
        _attach(model, processor)
        return model, processor

    @staticmethod
    def get_peft_model(model, *args, **kwargs):
        return _loader_of(model).get_peft_model(model, *args, **kwargs)

    @staticmethod
    def for_inference(model):
        return _loader_of(model).for_inference(model)

    @staticmethod
    def for_training(model, use_gradient_checkpointing: bool | str = True):
        return _loader_of(model).for_training(model, use_gradient_checkpointing)


class FastVisionModel(FastLanguageModel):
    """Vision-language models (Qwen2.5-VL, Qwen3-VL, Gemma 3 / 4, Llama 3.2 Vision): the model and its
    processor, which notebooks call `tokenizer` and pass to UnslothVisionDataCollator."""

    @staticmethod
    @functools.wraps(load_vision_pretrained)
    def from_pretrained(model_name: str = "unsloth/Qwen2.5-VL-7B-Instruct", *args, **kwargs):
        model, processor = load_vision_pretrained(model_name, *args, **kwargs)
        processor = with_tokenizer_attributes(processor)
        _attach(model, processor)
        return model, processor

    @staticmethod
    def get_peft_model(model, *args, finetune_vision_layers: bool = True, finetune_language_layers: bool = True,
                       finetune_attention_modules: bool = True, finetune_mlp_modules: bool = True,
                       finetune_audio_layers: bool = False, **kwargs):
        """LoRA on the towers and module kinds the finetune_* switches pick (`target_modules`, a list of
        names or "all-linear", narrows them; a regex string is used as it is). The audio tower (Gemma 4
        E2B / E4B) only with finetune_audio_layers=True."""
        if _fully_finetuned(model):
            return model
        targets = kwargs.get("target_modules")
        if not isinstance(targets, str) or targets == "all-linear":
            names = None if targets in (None, "all-linear") else set(targets)
            kwargs["target_modules"] = lora_target_regex(model, finetune_vision_layers, finetune_language_layers,
                                                         finetune_attention_modules, finetune_mlp_modules, names,
                                                         audio=finetune_audio_layers)
        peft_model = add_lora(model, *args, **kwargs)
        _attach(peft_model, getattr(model, "_unsloth_tokenizer", None))
        return peft_model

    @staticmethod
    def for_inference(model):
        """Evaluation mode with the KV cache on, for `model.generate(**processor(images, text))`."""
        model.eval()
        model_config(model).use_cache = True
        return model


def _fully_finetuned(model) -> bool:
    """A model loaded with full_finetuning=True trains every weight: get_peft_model leaves it as it is
    (as Unsloth does), rather than freezing it under adapters the user did not ask for."""
    if not getattr(model, "_unsloth_full_finetuning", False):
        return False
    log.info("unsloth: full_finetuning=True: every weight trains, so get_peft_model adds no LoRA adapters")
    return True


def _loader_of(model) -> type[FastLanguageModel]:
    """FastVisionModel for a vision-language (or audio-text) model, else FastLanguageModel."""
    return FastVisionModel if is_vision_language_config(model_config(model)) else FastLanguageModel


def lora_targets(model, target_modules, language: bool, attention: bool, mlp: bool, vision: bool) -> list[str]:
    """The LoRA target names the finetune_* switches leave, among the model's linear layers."""
    from torch import nn

    from unsloth.models.loader import DEFAULT_TARGETS

    if target_modules is not None and target_modules != "all-linear":
        wanted = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    else:
        wanted = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in _ATTENTION | _MLP}
                        or DEFAULT_TARGETS)
    if vision and not any(k in n for n, _ in model.named_modules() for k in ("vision", "visual")):
        log.info("unsloth: finetune_vision_layers: this model has no vision layers; its language layers are trained")
    if not language:
        raise ValueError("finetune_language_layers=False leaves a text model nothing to train; "
                         "set it to True (vision-only training needs a vision model)")
    kept = [t for t in wanted if (attention or t not in _ATTENTION) and (mlp or t not in _MLP)]
    if not kept:
        raise ValueError("finetune_attention_modules=False and finetune_mlp_modules=False leave no LoRA targets; "
                         "turn one of them on")
    return kept


# --- methods attached to the model ---------------------------------------------------------------

def _save_pretrained_gguf(model, save_directory, tokenizer=None, quantization_method="q8_0", **kwargs):
    """`model.save_pretrained_gguf(dir, tokenizer, quantization_method=...)`; also writes the Ollama Modelfile."""
    from unsloth.export.gguf import save_pretrained_gguf  # needs the [export] extra: import on use

    tokenizer = tokenizer or model._unsloth_tokenizer
    if isinstance(quantization_method, str):
        quantization_method = quantization_method.lower()
    else:
        quantization_method = [m.lower() for m in quantization_method]
    kwargs.setdefault("modelfile", True)
    for unused in ("maximum_memory_usage", "first_conversion", "temporary_location"):
        kwargs.pop(unused, None)
    result = save_pretrained_gguf(model, save_directory, tokenizer, quantization_method, **kwargs)
    if result.modelfile is not None:
        tokenizer._ollama_modelfile = result.modelfile.read_text(encoding="utf-8")
    return result


def _save_lora(model, save_directory, tokenizer=None, **kwargs):
    """The LoRA adapters (peft's adapter_model.safetensors + adapter_config.json) and the tokenizer."""
    model.save_pretrained(save_directory, **kwargs)
    tokenizer = tokenizer or getattr(model, "_unsloth_tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(save_directory)
    return save_directory


def _generate_accepting_encodings(original, model):
    """`generate` that also takes a BatchEncoding (what apply_chat_template returns in transformers 5)
    where notebooks pass `input_ids`, positionally or by keyword, and drops the `token_type_ids` a
    tokenizer returns for a model that takes none (transformers 4's fast tokenizers return them unless
    their config names the inputs; its generate then refuses them for Llama, Qwen, ...), as Unsloth does,
    and a `sliding_window` keyword."""
    takes_token_types = "token_type_ids" in inspect.signature(base_model(model).forward).parameters

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if args and isinstance(args[0], Mapping) and "input_ids" in args[0]:
            kwargs = {**dict(args[0]), **kwargs}
            args = args[1:]
        ids = kwargs.get("input_ids")
        if isinstance(ids, Mapping) and "input_ids" in ids:
            kwargs = {**kwargs, **dict(ids)}
        if not takes_token_types:
            kwargs.pop("token_type_ids", None)
        # Tool-calling notebooks pass sliding_window=None, which Unsloth's own forwards ignored; transformers'
        # attention already passes the config's window, so the keyword would reach it twice.
        window = kwargs.pop("sliding_window", None)
        if window is not None:
            log.warning("unsloth: generate(sliding_window=%s) is ignored: the model's config sets its window", window)
        return original(*args, **kwargs)

    return generate


def _attach(model, tokenizer) -> None:
    if tokenizer is not None:
        model._unsloth_tokenizer = tokenizer
    for name, method in (("save_pretrained_merged", save_pretrained_merged),
                         ("save_pretrained_gguf", _save_pretrained_gguf), ("save_lora", _save_lora),
                         ("load_lora", vllm_compat.load_lora), ("fast_generate", vllm_compat.fast_generate),
                         ("push_to_hub_merged", hub.push_to_hub_merged), ("push_to_hub_gguf", hub.push_to_hub_gguf)):
        setattr(model, name, types.MethodType(method, model))
    # an encoder loaded through `auto_model` (AutoModelForSequenceClassification) has no generate
    if hasattr(model, "generate") and not getattr(model.generate, "_unsloth_accepts_encodings", False):
        model.generate = _generate_accepting_encodings(model.generate, model)
        model.generate._unsloth_accepts_encodings = True
