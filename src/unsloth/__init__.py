"""unsloth: hardware-aware installer, environment manager and fast LoRA/QLoRA trainer.

Importing the package is cheap (no torch): the CLI for detect/doctor/install must answer in about a
second. The trainer API that users' notebooks import (``from unsloth import FastLanguageModel``)
is loaded lazily on first attribute access.
"""

from __future__ import annotations

__version__ = "0.1.0"

# name -> module that defines it; resolved on first access (PEP 562).
# Importing unsloth.notebook.fast_model also makes TRL's trainers accept what notebooks pass.
_LAZY = {
    **dict.fromkeys(("FastLanguageModel", "FastModel", "FastVisionModel", "is_bfloat16_supported",
                     "is_bf16_supported", "FastLlamaModel", "FastMistralModel", "FastQwen2Model", "FastQwen3Model",
                     "FastGemmaModel", "FastGemma2Model", "FastGraniteModel", "FastCohereModel"),
                    "unsloth.notebook.fast_model"),
    **dict.fromkeys(("SamplingParams", "LoRARequest"), "unsloth.notebook.vllm_compat"),
    "FastSentenceTransformer": "unsloth.notebook.sentence_transformer",
    **dict.fromkeys(("check_python_modules", "create_locked_down_function", "execute_with_time_limit"),
                    "unsloth.notebook.code_sandbox"),
    **dict.fromkeys(("UnslothTrainer", "UnslothTrainingArguments", "unsloth_train", "UnslothVisionDataCollator",
                     "PatchDPOTrainer", "PatchKTOTrainer"), "unsloth.notebook.trainers"),
    **dict.fromkeys(("get_chat_template", "standardize_sharegpt", "standardize_data_formats", "to_sharegpt",
                     "apply_chat_template", "train_on_responses_only"), "unsloth.chat_templates"),
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unsloth' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
