"""What a Trainer asks of the model at every micro-batch, made cheap, and the version of the module tree
those answers (and the checkpoint's parameter lists) are kept by.

On a host-paced step (batch 1, a LoRA model of thousands of modules) transformers' Trainer spent a
tenth of the step outside the model in the H100 profile of the TTS bench: `model.train()` walks and
sets every module each micro-batch, and its FLOPs count calls `num_parameters`, which walks every
module and parameter. Both answers change only when the module tree does, or (for `train`) when a
module's mode was changed; they are kept until then.
"""

from __future__ import annotations

import types
import weakref

from torch import nn
from torch.nn.modules import module as torch_module

_version = 0
_hooks: list = []
# The modules of every tree something is kept for. Registrations elsewhere do not count: transformers'
# decoders slice their layer list at every forward (`self.layers[:n]`), which builds a new ModuleList
# and registers the layers into it.
_tracked: weakref.WeakSet = weakref.WeakSet()


def _bump(parent, *_) -> None:
    global _version
    if parent in _tracked:
        _version += 1


def tree_version() -> int:
    """Bumped whenever a module of a tracked tree registers a submodule or a parameter (an adapter
    added, a weight replaced): what is kept per module tree is rebuilt when it moves."""
    if not _hooks:
        _hooks.append(torch_module.register_module_module_registration_hook(_bump))
        _hooks.append(torch_module.register_module_parameter_registration_hook(_bump))
    return _version


def kept_per_tree(model: nn.Module, name: str, build):
    """build(model), kept on the model for the current tree version."""
    version = tree_version()
    kept = model.__dict__.get(name)
    if kept is None or kept[0] != version:
        _tracked.update(model.modules())
        kept = (version, build(model))
        model.__dict__[name] = kept
    return kept[1]


def _modes_and_hooks(model: nn.Module):
    """(every module, the transformers models among them, whether each train() only sets flags: torch's,
    or transformers' own, which also puts its hub kernels in the matching mode)."""
    from transformers import PreTrainedModel

    modules = list(model.modules())
    plain = all(type(m).train in (nn.Module.train, PreTrainedModel.train) for m in modules)
    return modules, [m for m in modules if isinstance(m, PreTrainedModel)], plain


def _kernels_in_mode(model, mode: bool) -> bool:
    """A transformers model's hub kernels are in the mode train(mode) would put them in (or it has none)."""
    from transformers.utils import is_kernels_available

    if not (model.use_kernels and is_kernels_available()):
        return True
    from kernels import Mode

    return model.kernels_mode == (Mode.TRAINING if mode else Mode.INFERENCE)


def train(self, mode: bool = True):
    """nn.Module.train, skipped when it would change nothing: every module already in `mode`, every
    train() in the tree one that only sets flags, and transformers' hub kernels in that mode too."""
    modules, models, plain = kept_per_tree(self, "_unsloth_modules", _modes_and_hooks)
    if (plain and isinstance(mode, bool) and all(m.training == mode for m in modules)
            and all(_kernels_in_mode(m, mode) for m in models)):  # fmt: skip
        return self
    return type(self).train(self, mode)


def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """transformers' count, kept per tree version (the Trainer's FLOPs estimate asks at every micro-batch).
    Trainable counts depend on requires_grad flags, not on the tree: those are counted each time."""
    count = type(self).num_parameters
    if only_trainable:
        return count(self, only_trainable=True, exclude_embeddings=exclude_embeddings)
    counts = kept_per_tree(self, "_unsloth_parameter_counts", lambda model: {})
    if exclude_embeddings not in counts:
        counts[exclude_embeddings] = count(self, exclude_embeddings=exclude_embeddings)
    return counts[exclude_embeddings]


def cheap_trainer_calls(model: nn.Module) -> None:
    """Give `model` (a loaded model, or a PeftModel) the kept train() and, where it has one, num_parameters."""
    model.train = types.MethodType(train, model)
    if hasattr(type(model), "num_parameters"):
        model.num_parameters = types.MethodType(num_parameters, model)
