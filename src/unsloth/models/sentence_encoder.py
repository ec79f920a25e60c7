"""Embedding models: a sentence-transformers model whose encoder runs our kernels and trains LoRA.

sentence-transformers does the loading (its modules.json layout, or a plain checkpoint given a
pooling), the encoding and the training (its trainer and contrastive losses); our part is the
encoder inside its first module: the family patches where its family is one we patch (a Qwen3 or
Llama embedding model is a decoder backbone: RMSNorm, RoPE, MLP through ours), LoRA through peft
with our fused LoRA path on every adapted linear layer (any family, BERT and ModernBERT included),
and our gradient checkpointing.
"""

from __future__ import annotations

import torch
from torch import nn

from unsloth.errors import UnslothError
from unsloth.models.checkpointing import apply_gradient_checkpointing
from unsloth.models.patches import patch_model, patch_peft_model

POOLING_MODES = ("mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean")


def _sentence_transformers():
    try:
        import sentence_transformers
    except ImportError as e:
        raise UnslothError("sentence-transformers is not installed",
                           "pip install 'unsloth[embeddings]' (sentence-transformers)") from e
    return sentence_transformers


def encoder(st_model) -> nn.Module:
    """The transformers model inside a SentenceTransformer's first module (peft-wrapped after LoRA)."""
    module = st_model[0]
    return module.model if hasattr(module, "model") else module.auto_model


def _set_encoder(st_model, model: nn.Module) -> None:
    module = st_model[0]
    if hasattr(module, "model"):  # sentence-transformers 6: auto_model is a read-only alias of model
        module.model = model
    else:
        module.auto_model = model


def load_sentence_transformer(model_name: str, max_seq_length: int | None = None, dtype=None,
                              pooling_mode: str | None = None, device: str | None = None,
                              trust_remote_code: bool = False, token: str | None = None,
                              revision: str | None = None, attn_implementation: str = "sdpa", **kwargs):
    """A SentenceTransformer with our kernels in its encoder and every weight frozen (LoRA comes next).

    `pooling_mode`: None keeps the model's own pooling (mean for a plain checkpoint, as
    sentence-transformers builds it); a name replaces it (e.g. "lasttoken" for Qwen3-Embedding).
    """
    st = _sentence_transformers()
    if pooling_mode is not None and pooling_mode not in POOLING_MODES:
        raise ValueError(f"pooling_mode {pooling_mode!r} is not one of {', '.join(POOLING_MODES)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model_kwargs = {"attn_implementation": attn_implementation, **kwargs.pop("model_kwargs", {})}
    if dtype is not None and dtype != "auto":
        model_kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    elif torch.cuda.is_available():
        model_kwargs["dtype"] = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    model = st.SentenceTransformer(model_name, device=device, trust_remote_code=trust_remote_code, token=token,
                                   revision=revision, model_kwargs=model_kwargs, **kwargs)
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    if pooling_mode is not None:
        _replace_pooling(model, pooling_mode)
    inner = encoder(model)
    patch_model(inner)
    inner.requires_grad_(False)
    return model


def _replace_pooling(model, pooling_mode: str) -> None:
    from sentence_transformers import models

    for index, module in enumerate(model):
        if isinstance(module, models.Pooling):
            model[index] = models.Pooling(model[0].get_word_embedding_dimension()
                                          if hasattr(model[0], "get_word_embedding_dimension")
                                          else model[0].get_embedding_dimension(), pooling_mode=pooling_mode)
            return
    raise UnslothError(f"this model has no Pooling module to set to {pooling_mode!r}",
                       "leave pooling_mode=None to keep the model's own")


def linear_names(model: nn.Module) -> list[str]:
    """The names of the encoder's linear layers (LoRA's default targets: all of them)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and name})


def add_encoder_lora(st_model, r: int = 16, target_modules=None, lora_alpha: int = 16, lora_dropout: float = 0.0,
                     bias: str = "none", use_gradient_checkpointing: bool | str = False, random_state: int = 3407,
                     use_rslora: bool = False, modules_to_save=None, init_lora_weights=True, **kwargs):
    """LoRA adapters (peft, FEATURE_EXTRACTION) on the encoder, routed through our fused LoRA path."""
    from peft import LoraConfig, get_peft_model

    inner = encoder(st_model)
    torch.manual_seed(random_state)
    if target_modules is None or target_modules == "all-linear":
        target_modules = linear_names(inner)
    for unused in ("max_seq_length", "loftq_config", "task_type", "layers_to_transform", "layers_pattern"):
        kwargs.pop(unused, None)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias,
                        target_modules=list(target_modules), use_rslora=use_rslora, modules_to_save=modules_to_save,
                        init_lora_weights=init_lora_weights, task_type="FEATURE_EXTRACTION", **kwargs)
    peft_model = get_peft_model(inner, config)
    base = peft_model.get_base_model()
    layers = apply_gradient_checkpointing(base, use_gradient_checkpointing)
    report = patch_peft_model(peft_model)
    if report is not None:
        report.checkpointed = layers
        report.say()
    _set_encoder(st_model, peft_model)
    return st_model
