"""FastSentenceTransformer: the embedding-model API of Unsloth's notebooks, on our kernels.

    model = FastSentenceTransformer.from_pretrained("unsloth/all-MiniLM-L6-v2", max_seq_length=512)
    model = FastSentenceTransformer.get_peft_model(model, r=64, target_modules=["query", "key", "value", "dense"])
    ... sentence-transformers' SentenceTransformerTrainer with losses.MultipleNegativesRankingLoss(model) ...
    model.save_pretrained_merged("merged")   # sentence-transformers layout, LoRA merged in

The model is a sentence_transformers.SentenceTransformer throughout (encode, the trainer, the
losses take it as it is); loading and LoRA are ``unsloth.models.sentence_encoder``'s.
"""

from __future__ import annotations

import functools
import types

from unsloth.export.sentence_transformer import save_sentence_transformer_merged
from unsloth.models.sentence_encoder import add_encoder_lora, load_sentence_transformer
from unsloth.notebook import hub

__all__ = ["FastSentenceTransformer"]

# from_pretrained options of Unsloth's API that change nothing here
_ACCEPTED_UNUSED = {"load_in_4bit", "load_in_8bit", "load_in_16bit", "full_finetuning", "fix_tokenizer",
                    "use_exact_model_name", "resize_model_vocab", "max_lora_rank", "disable_log_stats",
                    "qat_scheme", "unsloth_tiled_mlp", "offload_embedding", "random_state", "for_inference",
                    "use_unpadding", "rope_scaling", "device_map", "use_gradient_checkpointing"}


class FastSentenceTransformer:
    """Load an embedding model, add LoRA, save merged: the notebook entry points."""

    @staticmethod
    @functools.wraps(load_sentence_transformer)
    def from_pretrained(model_name: str, max_seq_length: int | None = None, dtype=None, **kwargs):
        device_map = kwargs.get("device_map")
        for name in _ACCEPTED_UNUSED & set(kwargs):
            kwargs.pop(name)
        if isinstance(device_map, str) and device_map not in ("auto", "sequential", "balanced"):
            kwargs.setdefault("device", device_map)
        model = load_sentence_transformer(model_name, max_seq_length=max_seq_length, dtype=dtype, **kwargs)
        _attach(model)
        return model

    @staticmethod
    @functools.wraps(add_encoder_lora)
    def get_peft_model(model, *args, **kwargs):
        model = add_encoder_lora(model, *args, **kwargs)
        _attach(model)
        return model


def _attach(model) -> None:
    model.save_pretrained_merged = types.MethodType(save_sentence_transformer_merged, model)
    model.push_to_hub_merged = types.MethodType(hub.push_to_hub_merged, model)  # the notebooks' upload cell
