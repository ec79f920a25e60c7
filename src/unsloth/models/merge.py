"""A model's merged weights: LoRA adapters merged in, quantized bases dequantized, the model untouched.

The one place that merges: the GGUF export and ``save_pretrained_merged`` both read
``merged_tensors``, which yields each tensor on demand, so a merge never holds a second copy of the
model in memory, and the user's model keeps its adapters (unlike ``merge_and_unload``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from unsloth.errors import UnslothError


class MergeError(UnslothError):
    """A model whose adapters cannot be merged as they are."""


class TensorSource(NamedTuple):
    shape: tuple[int, ...]  # known without computing the tensor (the header is written first)
    load: Callable[[], torch.Tensor]


def _quant_state(layer: Any):
    """A bitsandbytes 4-bit layer's quant state (on its weight; on the layer too, which is where it
    stays when FSDP gathers the weight into a plain tensor), else None."""
    return getattr(layer.weight, "quant_state", None) or getattr(layer, "quant_state", None)


def _logical_shape(layer: Any) -> tuple[int, ...]:
    quant_state = _quant_state(layer)  # bitsandbytes 4-bit packs the data
    return tuple(quant_state.shape) if quant_state is not None else tuple(layer.weight.shape)


def _as_is(tensor: torch.Tensor) -> TensorSource:
    return TensorSource(tuple(tensor.shape), tensor.detach)


def base_model(model: Any) -> Any:
    """The transformers model under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def dequantized_weight(layer: Any) -> torch.Tensor:
    """A linear layer's weight as a floating tensor: bitsandbytes 4-bit through our NF4 kernel where
    it runs (else bitsandbytes), 8-bit through peft; other weights as they are."""
    weight = layer.weight
    quant_state = _quant_state(layer)
    if quant_state is not None:  # bitsandbytes Params4bit
        from unsloth.models.kernels import unavailable_reason  # not kernels_available: no "training" warning

        if unavailable_reason(weight.device) is None:
            from unsloth_kernels.nf4 import dequantize_bnb_4bit

            return dequantize_bnb_4bit(weight.data, quant_state)
        from unsloth.models.bnb_layout import dequantize_4bit

        return dequantize_4bit(weight.data, quant_state)
    from peft.utils.integrations import dequantize_module_weight

    return dequantize_module_weight(layer).detach()


def _lora_weight(module: Any) -> torch.Tensor:
    weight = dequantized_weight(module.get_base_layer()).to(torch.float32)
    if module.disable_adapters:
        return weight
    for adapter in module.active_adapters:
        if adapter in module.merged_adapters or adapter not in module.lora_A.keys() | module.lora_embedding_A.keys():
            continue  # already in the base weight, or not targeting this layer
        if module.use_dora.get(adapter):
            raise MergeError(
                "DoRA adapters cannot be merged on the fly",
                fix="merge first: model = model.merge_and_unload(), then export the merged model",
            )
        weight = weight + module.get_delta_weight(adapter).detach().to(weight.device, torch.float32)
    return weight


def _stored(param: torch.Tensor) -> TensorSource:
    """A parameter as it is, or dense where it is a 4-bit expert stack (Nf4Stack)."""
    from unsloth.models.experts_4bit import Nf4Stack

    if isinstance(param, Nf4Stack):
        return TensorSource(tuple(param.shape), param.dequantize)
    return _as_is(param)


def _param_lora_weight(param: torch.Tensor, wrapper: Any) -> torch.Tensor:
    """A stack adapted by a peft ParamWrapper, its active adapters' delta added (in the stack's own orientation)."""
    weight = _stored(param).load().to(torch.float32)
    if wrapper is None or wrapper.disable_adapters:
        return weight
    for adapter in wrapper.active_adapters:
        if adapter in wrapper.merged_adapters or adapter not in wrapper.lora_A:
            continue
        weight = weight + wrapper.get_delta_weight(adapter).detach().to(weight.device, torch.float32)
    return weight


def _param_wrapper_sources(wrapper: Any, prefix: str) -> dict[str, TensorSource]:
    """The tensors of a module whose parameters peft adapts through `target_parameters` (packed MoE
    experts): a chain of ParamWrappers, one per adapted parameter, around the module itself."""
    from peft.tuners.lora import ParamWrapper

    wrappers = {}
    module = wrapper
    while isinstance(module, ParamWrapper):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    sources = {}
    for pname, param in module.named_parameters():
        sources[f"{prefix}{pname}"] = TensorSource(tuple(param.shape),
                                                   lambda p=param, w=wrappers.get(pname): _param_lora_weight(p, w))  # fmt: skip
    for sub_name, sub in module.named_modules():
        for bname, buf in sub.named_buffers(recurse=False):
            if bname not in sub._non_persistent_buffers_set:
                sources[f"{prefix}{sub_name}.{bname}" if sub_name else f"{prefix}{bname}"] = _as_is(buf)
    return sources


def merged_tensors(model: Any) -> dict[str, TensorSource]:
    """HF state-dict name -> a function returning that tensor with every active adapter merged in."""
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from peft.utils import ModulesToSaveWrapper

    sources: dict[str, TensorSource] = {}
    covered: list[str] = []  # prefixes whose parameters are handled by a wrapper above them
    for name, module in base_model(model).named_modules(remove_duplicate=False):
        if any(name.startswith(prefix) for prefix in covered):
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, ParamWrapper):
            covered.append(prefix)
            sources.update(_param_wrapper_sources(module, prefix))
            continue
        if isinstance(module, LoraLayer):
            covered.append(prefix)
            shape = _logical_shape(module.get_base_layer())
            sources[f"{prefix}weight"] = TensorSource(shape, lambda m=module: _lora_weight(m))
            bias = getattr(module.get_base_layer(), "bias", None)
            if bias is not None:
                sources[f"{prefix}bias"] = _as_is(bias)
            continue
        if isinstance(module, ModulesToSaveWrapper):  # fully trained copies (e.g. embeddings)
            covered.append(prefix)
            module = module.modules_to_save[module.active_adapter] if not module.disable_adapters else module.original_module
            for pname, param in module.named_parameters():
                sources[f"{prefix}{pname}"] = _as_is(param)
            continue
        if module.__class__.__name__ in ("Linear4bit", "Linear8bitLt"):  # bitsandbytes base layer
            shape = _logical_shape(module)
            sources[f"{prefix}weight"] = TensorSource(shape, lambda m=module: dequantized_weight(m))
            if module.bias is not None:
                sources[f"{prefix}bias"] = _as_is(module.bias)
            continue
        for pname, param in module.named_parameters(recurse=False):
            sources[f"{prefix}{pname}"] = _stored(param)
        for bname, buf in module.named_buffers(recurse=False):
            if bname not in module._non_persistent_buffers_set:
                sources[f"{prefix}{bname}"] = _as_is(buf)
    return sources
