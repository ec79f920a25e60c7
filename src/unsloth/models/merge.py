"""Save a LoRA model as plain 16-bit merged weights (W + scale * B @ A), leaving the model as it is.

4-bit base weights are dequantized (our NF4 kernel where it runs, bitsandbytes otherwise), so the
result is an ordinary transformers checkpoint that export (GGUF) and any loader read.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn


def _dequantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating copy of a (possibly bitsandbytes-quantized) weight."""
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:  # bitsandbytes Params4bit
        from unsloth.models.kernels import kernels_available

        if kernels_available(weight.device):
            from unsloth_kernels.nf4 import dequantize_bnb_4bit

            return dequantize_bnb_4bit(weight.data, quant_state, dtype=dtype)
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, quant_state).to(dtype)
    if getattr(weight, "SCB", None) is not None or weight.dtype == torch.int8:
        raise NotImplementedError("merging 8-bit weights is not supported: load the model in 16-bit or 4-bit")
    return weight.detach().to(dtype)


def merged_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA layer merged and every weight dequantized (on the CPU)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    state: dict[str, torch.Tensor] = {}
    skip: set[str] = set()  # module paths already covered by a LoRA or modules_to_save wrapper

    def put(prefix: str, module: nn.Module) -> None:
        for name, p in module.named_parameters(recurse=False):
            state[f"{prefix}{name}"] = _dequantized(p, dtype).cpu()
        non_persistent = getattr(module, "_non_persistent_buffers_set", set())
        for name, b in module.named_buffers(recurse=False):
            if name not in non_persistent:
                state[f"{prefix}{name}"] = b.detach().cpu()

    for path, module in base.named_modules():
        if any(path == s or path.startswith(s + ".") for s in skip):
            continue
        prefix = f"{path}." if path else ""
        if isinstance(module, LoraLayer):
            skip.add(path)
            base_layer = module.get_base_layer()
            weight = _dequantized(base_layer.weight, dtype)
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).to(weight.device, dtype)
            state[f"{prefix}weight"] = weight.cpu()
            if getattr(base_layer, "bias", None) is not None:
                state[f"{prefix}bias"] = base_layer.bias.detach().to(dtype).cpu()
        elif isinstance(module, ModulesToSaveWrapper):
            skip.add(path)
            trained = module.modules_to_save[module.active_adapters[0]]
            for sub, child in trained.named_modules():
                put(f"{prefix}{sub}." if sub else prefix, child)
        else:
            put(prefix, module)
    return state


def save_pretrained_merged(self, save_directory: str, tokenizer=None, save_method: str = "merged_16bit",
                           max_shard_size: str = "5GB", **_unused) -> str:
    """Save merged 16-bit weights + config (+ tokenizer) to `save_directory`; "lora" saves adapters only."""
    if save_method == "lora":
        self.save_pretrained(save_directory)
    elif save_method == "merged_16bit":
        from huggingface_hub import save_torch_state_dict

        base = self.get_base_model() if hasattr(self, "get_base_model") else self
        config = copy.deepcopy(base.config)
        dtype = _save_dtype(base)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = dtype
        config.use_cache = True  # a saved model is for inference; training turned the cache off
        state = merged_state_dict(self, dtype)
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # the loader ties it back to the embeddings
        os.makedirs(save_directory, exist_ok=True)
        save_torch_state_dict(state, save_directory, max_shard_size=max_shard_size)
        config.save_pretrained(save_directory)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(save_directory)
    else:
        raise ValueError(f"save_method must be 'merged_16bit' or 'lora', got {save_method!r}")
    if tokenizer is not None:
        tokenizer.save_pretrained(save_directory)
    return save_directory


def _save_dtype(base: nn.Module) -> torch.dtype:
    quant = getattr(base.config, "quantization_config", None)
    compute = getattr(quant, "bnb_4bit_compute_dtype", None) if quant is not None else None
    if isinstance(compute, torch.dtype):
        return compute
    for p in base.parameters():
        if p.is_floating_point() and p.element_size() >= 2:
            return p.dtype
    return torch.float16
