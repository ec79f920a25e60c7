"""Embeddings and LM head trained whole: continued-pretraining notebooks put "embed_tokens" and "lm_head"
in target_modules. Like Unsloth, they become peft's modules_to_save (full copies, trained), not LoRA layers:
TRL refuses a LoRA on lm_head (its loss reads lm_head.weight), and a new language needs whole embeddings.

The trained copies stay in float32 (an embedding learning rate of 5e-6 is below bfloat16's resolution, so
its updates would round away); hooks hand the model its own dtype at their edges, in training and generation.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("unsloth")

WHOLE_MODULES = ("embed_tokens", "lm_head")


def split_targets(target_modules: list, modules_to_save) -> tuple[list, list | None]:
    """(LoRA targets, modules_to_save) with embed_tokens / lm_head moved from the first to the second."""
    whole = [t for t in target_modules if t in WHOLE_MODULES]
    if not whole:
        return target_modules, modules_to_save
    kept = [t for t in target_modules if t not in WHOLE_MODULES]
    if not kept:
        raise ValueError(f"target_modules={target_modules} leaves no LoRA layers once {whole} are trained whole; "
                         "add the linear layers, e.g. q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
    log.info("unsloth: %s trained whole in float32 (modules_to_save), not through LoRA", ", ".join(whole))
    return kept, list(dict.fromkeys([*(modules_to_save or []), *whole]))


def _output_in(dtype):
    def hook(module, args, output):
        return output.to(dtype) if output.is_floating_point() else output
    return hook


def _input_in_weight_dtype(module, args):
    return tuple(a.to(module.weight.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def train_in_float32(model) -> int:
    """Keep the trained copies of the whole embeddings / LM head in float32 (again, after a trainer cast them);
    returns how many. Idempotent: the dtype hooks are added once."""
    from peft.utils import ModulesToSaveWrapper

    count = 0
    for name, wrapper in model.named_modules():
        if not isinstance(wrapper, ModulesToSaveWrapper) or name.rsplit(".", 1)[-1] not in WHOLE_MODULES:
            continue
        model_dtype = wrapper.original_module.weight.dtype
        for copy in wrapper.modules_to_save.values():
            copy.float()
            if getattr(copy, "_unsloth_float32_hooks", False):
                continue
            if isinstance(copy, torch.nn.Embedding):  # the decoder layers get the dtype they run in
                copy.register_forward_hook(_output_in(model_dtype))
            else:  # lm_head: the hidden states come in the model's dtype
                copy.register_forward_pre_hook(_input_in_weight_dtype)
            copy._unsloth_float32_hooks = True
            count += 1
    return count
