"""A frozen input embedding kept in pinned host memory, its rows read by the GPU as batches need them.

LoRA and QLoRA never train the input embedding, yet on the GPU it holds vocab x hidden weights
(1 GiB for Llama 3's 128256 x 4096 in bf16). Offloaded, the table lives in pinned host memory and
each forward reads only its batch's rows over PCIe (`unsloth_kernels.embedding.gather_rows`: 128 MiB
for 16k tokens at 4096 wide). It is adopted only when the gather reproduces the lookup on a probe,
and it stays in host memory when the model is moved (`.to`, `.cuda`), so a Trainer placing the model
keeps it offloaded; `.to(dtype)` still casts it.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("unsloth")


class OffloadedEmbedding(nn.Embedding):
    """nn.Embedding whose table is in pinned host memory; lookups land on `compute_device`."""

    compute_device: torch.device

    # Outside any compiled graph: dynamo cannot trace the Triton gather of a host table, and a graph holding
    # the table as an input would not be captured in a CUDA graph. A compiled decode step breaks here once.
    @torch.compiler.disable
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.compute_device.type == "cpu" or self.weight.device.type != "cpu":
            return super().forward(input.to(self.weight.device))
        from unsloth_kernels.embedding import gather_rows

        return gather_rows(self.weight, input.to(self.compute_device, non_blocking=True))

    def __setstate__(self, state):  # copy.deepcopy and pickle come through here; their copy is not pinned
        super().__setstate__(state)
        if self.compute_device.type != "cpu" and self.weight.device.type == "cpu" and not self.weight.is_pinned():
            self.weight.data = _pinned_copy(self.weight.data)

    def _apply(self, fn, recurse=True):
        # A device move changes where lookups land, not where the table is; a dtype cast applies to it.
        target = fn(torch.empty(0, dtype=self.weight.dtype, device=self.compute_device))
        self.compute_device = target.device
        if target.dtype != self.weight.dtype:
            cast = self.weight.data.to(target.dtype)
            self.weight.data = _pinned_copy(cast) if self.weight.is_pinned() else cast
        return self


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def _register_last(model: nn.Module, child: nn.Module) -> None:
    """Move `child` to the end of its parent's submodules.

    `model.device` is its first parameter's device, and the input embedding is usually that
    parameter: registered last, the model still reports the GPU it computes on.
    """
    for parent in model.modules():
        for name, module in parent.named_children():
            if module is child:
                parent._modules[name] = parent._modules.pop(name)
                return


def offload_input_embedding(model: nn.Module) -> str | None:
    """Move a frozen, untied input embedding to pinned host memory; None when done, else why not."""
    if os.environ.get("UNSLOTH_OFFLOAD_EMBEDDING", "1") == "0":
        return "turned off by UNSLOTH_OFFLOAD_EMBEDDING=0"
    embedding = model.get_input_embeddings()
    if isinstance(embedding, OffloadedEmbedding):
        return None
    weight = getattr(embedding, "weight", None)
    if weight is not None and weight.requires_grad:  # first: a trained copy is wrapped (peft modules_to_save)
        return "the input embedding is being trained"
    if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
        return "the input embedding is not a plain lookup (scaled or normed)"
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None and head.weight.data_ptr() == weight.data_ptr():
        return "the input embedding is tied to the LM head, which needs it on the GPU"
    if not weight.is_cuda:
        return "the input embedding is not on a GPU"

    device = weight.device
    rows = weight.shape[0]  # first, last and rows spread between (no RNG drawn: training stays reproducible)
    probe = torch.tensor([0, rows - 1, *range(rows // 7, rows, max(1, rows // 7))][:15], device=device)
    expected = F.embedding(probe, weight)
    host = _pinned_copy(weight.data)
    try:
        from unsloth_kernels.embedding import gather_rows

        ok = torch.equal(gather_rows(host, probe), expected)
    except Exception as error:  # e.g. a platform where the GPU cannot read host memory
        return f"the GPU could not read the table from host memory ({type(error).__name__}: {error})"
    if not ok:
        return "reading the table from host memory did not reproduce the lookup"
    embedding.__class__ = OffloadedEmbedding
    embedding.compute_device = device
    weight.data = host
    _register_last(model, embedding)
    log.info("unsloth: input embedding %s in pinned host memory (%.2f GiB of GPU memory freed)",
             tuple(weight.shape), weight.numel() * weight.element_size() / 2**30)
    return None


def require_grad_when_recorded(module, args, output):
    """transformers' `make_inputs_require_grads` hook, which does nothing where autograd records no graph
    (generation): there a `requires_grad_` call would break a compiled decode step's graph in two."""
    if torch.is_grad_enabled():
        output.requires_grad_(True)


def grad_mode_input_hooks(model: nn.Module) -> None:
    """Put `require_grad_when_recorded` in place of the hooks transformers' `enable_input_require_grads`
    put on the input embedding (under the same handles: `disable_input_require_grads` still removes them)."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return
    hooks = getattr(embedding, "_forward_hooks", None) or {}
    for key, hook in list(hooks.items()):
        if getattr(hook, "__qualname__", "").endswith("enable_input_require_grads.<locals>.make_inputs_require_grads"):
            hooks[key] = require_grad_when_recorded
