"""FastLanguageModel: the API fine-tuning notebooks already use, on our kernels.

Loading and LoRA are ``unsloth.models.loader``'s; this class adds the notebook's entry points and
attaches the saving methods (merged 16-bit, GGUF) that the export layer provides.
"""

from __future__ import annotations

import functools
import types

from unsloth.export.merged import save_pretrained_merged
from unsloth.models.loader import add_lora, is_bfloat16_supported, load_pretrained, model_config

__all__ = ["FastLanguageModel", "FastModel", "is_bfloat16_supported"]


class FastLanguageModel:
    """Load, add LoRA, switch train/inference mode, save: the familiar entry points."""

    @staticmethod
    @functools.wraps(load_pretrained)
    def from_pretrained(*args, **kwargs):
        model, tokenizer = load_pretrained(*args, **kwargs)
        _attach_saving(model)
        return model, tokenizer

    @staticmethod
    @functools.wraps(add_lora)
    def get_peft_model(*args, **kwargs):
        peft_model = add_lora(*args, **kwargs)
        _attach_saving(peft_model)
        return peft_model

    @staticmethod
    def for_inference(model):
        """Evaluation mode with the KV cache on: for `model.generate`."""
        model.eval()
        model_config(model).use_cache = True
        return model

    @staticmethod
    def for_training(model, use_gradient_checkpointing: bool | str = True):
        """Back to training mode (checkpointing stays as get_peft_model set it)."""
        model.train()
        model_config(model).use_cache = False
        return model


FastModel = FastLanguageModel  # the original API's name for the general loader


def _save_pretrained_gguf(model, *args, **kwargs):
    """`model.save_pretrained_gguf(dir, tokenizer, quantization_method=...)`; see unsloth.export.gguf."""
    from unsloth.export.gguf import save_pretrained_gguf  # needs the [export] extra: import on use

    return save_pretrained_gguf(model, *args, **kwargs)


def _attach_saving(model) -> None:
    model.save_pretrained_merged = types.MethodType(save_pretrained_merged, model)
    model.save_pretrained_gguf = types.MethodType(_save_pretrained_gguf, model)
