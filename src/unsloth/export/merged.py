"""Save a LoRA model as plain 16-bit merged weights (W + scale * B @ A), leaving the model as it is.

The merged tensors come from ``unsloth.models.merge.merged_tensors`` (the one place that merges and
dequantizes 4-bit bases), so the result is an ordinary transformers checkpoint that export (GGUF)
and any loader read.
"""

from __future__ import annotations

import copy
import os
import re

import torch
from torch import nn

from unsloth.models.distributed import gathered, is_main_process
from unsloth.models.merge import base_model, merged_tensors
from unsloth.models.tokenizer_files import save_tokenizer


def merged_state_dict(model: nn.Module, dtype: torch.dtype, copy: bool = False) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA layer merged and every floating tensor in `dtype` (on
    the CPU; `copy`: never the model's own tensors)."""
    state = {}
    for name, source in merged_tensors(model).items():
        tensor = source.load()
        tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
        state[name] = tensor.to("cpu", copy=copy)
    return state


def save_pretrained_merged(self, save_directory: str, tokenizer=None, save_method: str = "merged_16bit",
                           max_shard_size: str = "5GB", **_unused) -> str:
    """Save merged 16-bit weights + config (+ tokenizer) to `save_directory`; "lora" saves adapters only.
    `save_method=None` (Whisper's notebook) is the default, merged 16-bit."""
    save_method = save_method or "merged_16bit"
    if save_method == "lora":
        self.save_pretrained(save_directory)
    elif save_method == "merged_16bit":
        from huggingface_hub import save_torch_state_dict

        base = base_model(self)
        config = copy.deepcopy(base.config)
        dtype = _save_dtype(base)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = dtype
        config.use_cache = True  # a saved model is for inference; training turned the cache off
        config.architectures = [type(base).__name__]  # as save_pretrained records it; converters dispatch on it
        with gathered(self) as whole:  # FSDP2: every weight gathered once, by every rank; rank 0 writes
            state = merged_state_dict(self, dtype, copy=whole) if is_main_process() else None
        if state is None:
            return save_directory
        for key in _tied_copies(base, config):
            state.pop(key, None)  # the loader ties them back to their sources
        # the checkpoint's own key layout: vision towers as visual.* (llama.cpp's --mmproj reads them so),
        # experts as published
        state = _checkpoint_layout(base, state)
        os.makedirs(save_directory, exist_ok=True)
        save_torch_state_dict(state, save_directory, max_shard_size=max_shard_size)
        config.save_pretrained(save_directory)
        generation = _generation_config(base)
        if generation is not None:
            generation.save_pretrained(save_directory)
    elif save_method in ("merged_4bit", "merged_4bit_forced"):
        _save_merged_4bit(self, save_directory, max_shard_size)
    else:
        raise ValueError(f"save_method must be 'merged_16bit', 'merged_4bit' or 'lora', got {save_method!r}")
    if tokenizer is not None:
        save_tokenizer(tokenizer, save_directory)
    return save_directory


def _checkpoint_layout(base: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict under the checkpoint's own names and layout, as save_pretrained writes it:
    transformers loads some families' experts into packed stacks (Mixtral's per-expert w1 / w2 / w3
    into gate_up_proj / down_proj) and reverts that on save; converters such as llama.cpp's read the
    published layout."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: experts load as published; only VLMs' key renames are reverted
        return _reverted_key_mapping(base, state)

    reverted = revert_weight_conversion(base, state)
    # a split stack comes back as views into it; safetensors writes only tensors that own their storage
    return {name: t if t.untyped_storage().nbytes() == t.nbytes else t.clone() for name, t in reverted.items()}


def _reverted_key_mapping(base: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 4's layout: a model that renames checkpoint keys on load (its
    `_checkpoint_conversion_mapping`, a regex -> new prefix map: Qwen2-VL's `^visual` -> `model.visual`)
    saves them under the checkpoint's names, so each renamed prefix goes back (first match wins)."""
    renames = getattr(base, "_checkpoint_conversion_mapping", None) or {}
    # the new name, as loaded, -> the checkpoint's own prefix (its pattern without anchors or look-arounds)
    back = [(re.compile(re.escape(new)), re.sub(r"\(.*\)", "", old.lstrip("^"))) for old, new in renames.items()]
    out = {}
    for name, tensor in state.items():
        for loaded, published in back:
            name, done = loaded.subn(published, name, count=1)
            if done:
                break
        out[name] = tensor
    return out


def _tied_copies(base: nn.Module, config) -> list[str]:
    """The weights the loader ties to others (not saved): the model's own map of them where transformers
    keeps one (Sesame CSM ties its depth decoder's codebook embeddings, not its LM head), else the LM head."""
    if not getattr(config, "tie_word_embeddings", False):
        return []
    tied = getattr(base, "all_tied_weights_keys", None)
    return list(tied) if isinstance(tied, dict) else ["lm_head.weight"]


def _generation_config(base: nn.Module):
    """The generation config as the model's own save_pretrained writes it: Sesame CSM keeps its depth
    decoder's sampling settings in it, prefixed `depth_decoder_` (its from_pretrained moves them back)."""
    config = getattr(base, "generation_config", None)
    depth = getattr(getattr(base, "depth_decoder", None), "generation_config", None)
    if config is None or depth is None:
        return config
    config = copy.deepcopy(config)
    for name, value in depth.to_diff_dict().items():
        if name != "transformers_version":
            setattr(config, f"depth_decoder_{name}", value)
    return config


def _save_merged_4bit(model, save_directory: str, max_shard_size: str) -> None:
    """Merged weights quantized to bitsandbytes NF4 (what `load_in_4bit` loads); written whole or not at all."""
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError("save_method='merged_4bit' needs bitsandbytes (pip install bitsandbytes); "
                         "save_method='merged_16bit' needs nothing more") from None
    with tempfile.TemporaryDirectory(prefix="unsloth-merged-") as staging:
        save_pretrained_merged(model, staging, save_method="merged_16bit", max_shard_size=max_shard_size)
        dtype = _save_dtype(base_model(model))
        quantized = AutoModelForCausalLM.from_pretrained(
            staging, dtype=dtype, quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype))
        out = os.path.join(staging, "4bit")
        quantized.save_pretrained(out, max_shard_size=max_shard_size)
        os.makedirs(save_directory, exist_ok=True)
        for name in os.listdir(out):
            shutil.move(os.path.join(out, name), os.path.join(save_directory, name))


def _save_dtype(base: nn.Module) -> torch.dtype:
    quant = getattr(base.config, "quantization_config", None)
    compute = getattr(quant, "bnb_4bit_compute_dtype", None) if quant is not None else None
    if isinstance(compute, torch.dtype):
        return compute
    loaded = next((p.dtype for p in base.parameters() if p.is_floating_point() and p.element_size() >= 2),
                  torch.float16)
    source = getattr(base, "_unsloth_source_dtype", None)  # set when the loader chose the dtype itself
    if loaded == torch.float32 and source in (torch.bfloat16, torch.float16):
        return source
    return loaded
