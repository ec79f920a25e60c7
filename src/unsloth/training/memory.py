"""Memory: gradient checkpointing of the decoder layers, with the saved activations offloaded to
pinned host memory (copies on a side stream, overlapped with compute), and the out-of-memory advice.

Each decoder layer keeps only its input hidden state for the backward pass and recomputes the
rest. In "unsloth" mode on a GPU that input goes to pinned host memory while the next layers run,
and during the backward pass the previous layer's input is fetched back while this one recomputes.
"""

from __future__ import annotations

import threading
import types

import torch
from torch import nn


_recompute = threading.local()


def recomputing() -> bool:
    """True while a checkpointed layer reruns its forward for backward: its output is then never read,
    only the graph behind it (the fused MLP uses this to skip work no gradient needs)."""
    return getattr(_recompute, "active", False)


class _Offloader:
    """The layer inputs of one forward pass, in host memory, fetched back in reverse order ahead of use."""

    def __init__(self):
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.saved: list[_Saved] = []

    def save(self, hidden: torch.Tensor, layer_index: int) -> "_Saved":
        if layer_index == 0:  # a new forward pass (whatever happened to the last one)
            self.saved.clear()
        entry = _Saved(self, hidden, len(self.saved))
        self.saved.append(entry)
        return entry


class _Saved:
    """One layer input: copied to pinned host memory on the side stream, brought back on demand."""

    def __init__(self, offloader: _Offloader, hidden: torch.Tensor, index: int):
        self.offloader, self.index, self.device = offloader, index, hidden.device
        self.gpu: torch.Tensor | None = None
        stream = offloader.stream
        self.host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(stream):
            self.host.copy_(hidden, non_blocking=True)
            hidden.record_stream(stream)  # keep its memory until the copy is done
        self.event = stream.record_event()

    def prefetch(self) -> None:
        if self.gpu is not None:
            return
        stream = self.offloader.stream
        with torch.cuda.stream(stream):
            stream.wait_event(self.event)
            self.gpu = self.host.to(self.device, non_blocking=True)
        self.event = stream.record_event()

    def fetch(self) -> torch.Tensor:
        self.prefetch()
        torch.cuda.current_stream(self.device).wait_event(self.event)
        hidden, self.gpu = self.gpu, None
        hidden.record_stream(torch.cuda.current_stream(self.device))
        saved = self.offloader.saved
        if 0 < self.index < len(saved) and saved[self.index] is self:
            saved[self.index - 1].prefetch()  # the layer below runs its backward next: start its copy now
        return hidden


class _CheckpointedLayer(torch.autograd.Function):
    """Run a layer without keeping its activations; recompute them from its input in backward."""

    @staticmethod
    def forward(ctx, run, offloader, layer_index, hidden):
        ctx.run = run
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        if offloader is not None:
            ctx.saved = offloader.save(hidden, layer_index)
        else:
            ctx.save_for_backward(hidden)
        ctx.offloaded = offloader is not None
        with torch.no_grad():
            return run(hidden)

    @staticmethod
    def backward(ctx, grad_output):
        hidden = ctx.saved.fetch() if ctx.offloaded else ctx.saved_tensors[0]
        hidden = hidden.detach().requires_grad_(True)
        devices = [hidden.device] if hidden.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            previous, _recompute.active = recomputing(), True
            try:
                with torch.enable_grad():
                    output = ctx.run(hidden)
            finally:
                _recompute.active = previous
        torch.autograd.backward(output, grad_output)
        return (None, None, None, hidden.grad)


def _checkpointed_forward(self, hidden_states, *args, **kwargs):
    original = self._unsloth_original_forward
    if not (self.training and torch.is_grad_enabled()):
        return original(hidden_states, *args, **kwargs)
    # We checkpoint this layer; transformers' own checkpointing of it would recompute it twice.
    if getattr(self, "gradient_checkpointing", False):
        self.gradient_checkpointing = False
    kwargs["use_cache"] = False
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if kwargs.get(name) is not None:
            kwargs[name] = None
    returns_tuple = []

    def run(hidden):
        out = original(hidden, *args, **kwargs)
        if isinstance(out, tuple):  # older transformers return (hidden_states, ...)
            returns_tuple.append(out[1:])
            return out[0]
        return out

    offloader = self._unsloth_offloader if hidden_states.is_cuda else None
    output = _CheckpointedLayer.apply(run, offloader, self._unsloth_layer_index, hidden_states)
    return (output, *returns_tuple[0]) if returns_tuple else output


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: transformers' checkpointable layers, else the longest ModuleList's items."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers
        GradientCheckpointingLayer = None
    if GradientCheckpointingLayer is not None:
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        if layers:
            return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def apply_gradient_checkpointing(model: nn.Module, mode: bool | str) -> int:
    """Checkpoint every decoder layer (`True`), offloading their inputs to host memory (`"unsloth"`).

    Returns the number of layers checkpointed. Calling it again changes the mode.
    """
    if mode not in (True, False, "unsloth"):
        raise ValueError(f"use_gradient_checkpointing must be True, False or \"unsloth\", got {mode!r}")
    layers = decoder_layers(model)
    # One offloader for all layers of the model. Its list of saved inputs is emptied by the next forward's
    # first layer, so the last step's pinned host copies stay allocated until then.
    offloader = _Offloader() if mode == "unsloth" and torch.cuda.is_available() else None
    for index, layer in enumerate(layers):
        if mode is False:
            layer.__dict__.pop("forward", None)
            continue
        if "_unsloth_original_forward" not in layer.__dict__:
            layer._unsloth_original_forward = layer.forward
        layer._unsloth_offloader = offloader
        layer._unsloth_layer_index = index
        layer.forward = types.MethodType(_checkpointed_forward, layer)
    if mode is not False and hasattr(model, "enable_input_require_grads"):
        # With frozen embeddings nothing upstream requires grad, and the checkpoint would cut the graph.
        model.enable_input_require_grads()
    return 0 if mode is False else len(layers)


def out_of_memory_advice(batch_size: int | None = None, max_seq_length: int | None = None,
                         load_in_4bit: bool | None = None) -> str:
    """What to change after a CUDA out-of-memory error, most effective first."""
    tips = []
    if batch_size and batch_size > 1:
        tips.append(f"a smaller batch: --set training.per_device_train_batch_size={max(1, batch_size // 2)} "
                    "(raise training.gradient_accumulation_steps to keep the effective batch)")
    if load_in_4bit is False:
        tips.append("4-bit base weights: --set model.load_in_4bit=true")
    if max_seq_length and max_seq_length > 512:
        tips.append(f"shorter sequences: --set model.max_seq_length={max_seq_length // 2}")
    tips.append('activation offloading: --set gradient_checkpointing="unsloth" (the default)')
    return "Out of GPU memory. Try, in this order:\n" + "\n".join(f"  - {t}" for t in tips)
