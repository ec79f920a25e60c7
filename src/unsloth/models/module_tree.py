"""Answers about a module tree, kept until the tree changes.

A host-paced training step (batch 1, a LoRA model of a thousand modules) pays for walks of the whole
tree that give the same answer every time: the checkpoint's per-layer parameter lists, the LoRA
kernels' view of each adapted layer, and, in transformers' Trainer, `model.train()` (it sets every
module's flag at every micro-batch), the FLOPs estimate's `num_parameters()` and the `parameters()`
of zero_grad and gradient clipping. In the H100 profile of the TTS bench the first two Trainer calls
were a tenth of the step.

What is kept lives on the module it was asked of, stamped with its tree's current token. Every module of
a tree holds the same one-slot holder of that token, and a global registration hook puts a new token in
the holder when any of those modules registers a submodule or a parameter (an adapter added, a weight
replaced): what was kept is then rebuilt at its next use. Registrations elsewhere change nothing:
transformers' decoders slice their layer list at every forward (`self.layers[:n]` registers the layers
into a fresh ModuleList, which holds no token). The hook does nothing while torch.compile traces: the
compiled decode step traces that slicing, and whatever the hook touched would become a guard of the step.
"""

from __future__ import annotations

import types

import torch
from torch import nn

_TOKEN, _KEPT = "_unsloth_tree_token", "_unsloth_kept"
_hooks: list = []


def _forget(parent: nn.Module, *_) -> None:
    if torch.compiler.is_compiling():
        return
    holder = parent.__dict__.get(_TOKEN)
    if holder is not None:
        holder[0] = object()


def watch_registrations() -> None:
    """Install the hook (once). Dynamo guards on the number of global registration hooks, so this runs
    before anything is compiled (at load and when layers are checkpointed): installed later, it made a
    decode step compiled before it (GRPO's first rollouts) compile a second time."""
    if not _hooks:
        from torch.nn.modules import module

        _hooks.append(module.register_module_module_registration_hook(_forget))
        _hooks.append(module.register_module_parameter_registration_hook(_forget))


def kept(root: nn.Module, name: str, build):
    """build(root), kept until a module of root's tree registers a submodule or a parameter."""
    holder, values = root.__dict__.get(_TOKEN), root.__dict__.get(_KEPT)
    entry = values.get(name) if values else None
    if holder is not None and entry is not None and entry[0] is holder[0]:
        return entry[1]
    watch_registrations()  # nothing is kept without the hook that forgets it
    value = build(root)
    modules = list(root.modules())
    if holder is None or any(m.__dict__.get(_TOKEN) is not holder for m in modules):
        # a tree seen for the first time, or one with a part new to it: one holder for all its modules
        # (whatever a tree around it kept is rebuilt once, under this holder)
        holder = [object()]
        for m in modules:
            m.__dict__[_TOKEN] = holder
    root.__dict__.setdefault(_KEPT, {})[name] = (holder[0], value)
    return value


def _parameter_dicts(module: nn.Module) -> list[dict]:
    """The `_parameters` dicts of the module's tree that hold any, in `modules()` order. Kept (`kept`),
    they give the tree's parameters without a walk; read per call, they give the current ones: FSDP2
    swaps its gathered parameters into those same dicts for the forward."""
    return [m._parameters for m in module.modules() if m._parameters]


def _modules_and_train_kinds(model: nn.Module) -> tuple[list[nn.Module], bool, list[nn.Module]]:
    """(every module, whether each one's train() is torch's or transformers', the transformers models among
    them: where one uses hub kernels, its train() also switches their mode)."""
    from transformers import PreTrainedModel

    modules = list(model.modules())
    plain = all(type(m).train in (nn.Module.train, PreTrainedModel.train) for m in modules)
    return modules, plain, [m for m in modules if isinstance(m, PreTrainedModel)]


def _kernels_in(models: list[nn.Module], mode: bool) -> bool:
    """Every one of `models` that uses hub kernels has them in `mode` (asked per call: use_kernels is a
    setting, which no registration announces)."""
    from transformers.utils import import_utils

    kernelized = [m for m in models if getattr(m, "use_kernels", False)]
    # transformers releases before hub kernels have neither the check nor the attribute
    if not kernelized or not getattr(import_utils, "is_kernels_available", lambda: False)():
        return True
    from kernels import Mode

    wanted = Mode.TRAINING if mode else Mode.INFERENCE
    return all(getattr(m, "kernels_mode", None) == wanted for m in kernelized)


def train(self, mode: bool = True):
    """nn.Module.train, skipped where it would change nothing: every module already in `mode`, every
    train() in the tree torch's or transformers' own, and transformers' hub kernels in that mode too."""
    modules, plain, models = kept(self, "train", _modules_and_train_kinds)
    if plain and isinstance(mode, bool) and all(m.training is mode for m in modules) and _kernels_in(models, mode):
        return self
    return type(self).train(self, mode)


def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """transformers' count, kept per tree for all parameters; trainable ones depend on requires_grad
    flags, not on the tree, and are counted every time."""
    count = type(self).num_parameters
    if only_trainable:
        return count(self, only_trainable=True, exclude_embeddings=exclude_embeddings)
    return kept(self, f"num_parameters {exclude_embeddings}",
                lambda model: count(model, exclude_embeddings=exclude_embeddings))


def parameters(self, recurse: bool = True):
    """nn.Module.parameters, from the tree's kept parameter dicts (the Trainer's zero_grad and gradient
    clipping ask for them at every step): the same parameters in the same order, each once."""
    if not recurse:
        return type(self).parameters(self, recurse)
    return _each_once(self)


def current_parameters(module: nn.Module) -> list[nn.Parameter]:
    """`list(module.parameters())` without the walk: read from the tree's kept parameter dicts, so the
    ones FSDP2 swapped in are found; each once, in order (modules may share one: tied weights)."""
    return list(_each_once(module))


def _each_once(module: nn.Module):
    """The tree's parameters, lazily as nn.Module.parameters gives them: `next(model.parameters())`
    (transformers' `model.device`, asked several times per generated token) reads one, not thousands."""
    seen = set()  # by id: Tensor.__hash__ is a Python-level call
    for d in kept(module, "parameter dicts", _parameter_dicts):
        for p in d.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield p


def cheap_trainer_calls(model: nn.Module) -> None:
    """Give `model` (as the Trainer holds it: a loaded model or a PeftModel) the kept train() and
    parameters(), and it and the transformers models inside it the kept num_parameters (the Trainer asks
    the one it holds, or, in older transformers, the model inside, for its FLOPs estimate). The functions
    bear the methods' names: pickle stores a bound method as `getattr(obj, name)`, which loading a saved
    model asks again."""
    from transformers import PreTrainedModel

    watch_registrations()
    model.train = types.MethodType(train, model)
    model.parameters = types.MethodType(parameters, model)
    for m in (model, *(m for m in model.modules() if isinstance(m, PreTrainedModel))):
        if hasattr(type(m), "num_parameters"):
            m.num_parameters = types.MethodType(num_parameters, m)
