"""Gradient checkpointing of the decoder layers, with the saved activations offloaded to pinned
host memory (copies on a side stream, overlapped with compute).

Each decoder layer keeps only its input hidden state for the backward pass and recomputes the
rest. In "unsloth" mode on a GPU that input goes to pinned host memory while the next layers run,
and during the backward pass the previous layer's input is fetched back while this one recomputes.
In that mode the layer's modules may also keep some first-pass outputs with it, which the recompute
then replays instead of computing again (see "outputs kept for the recompute").
"""

from __future__ import annotations

import os
import threading
import types
from collections import deque
from collections.abc import MutableMapping

import torch
from torch import nn

from unsloth.models.embedding import require_grad_when_recorded
from unsloth.models.module_tree import current_parameters, watch_registrations


_recompute = threading.local()


def recomputing() -> bool:
    """True while a checkpointed layer reruns its forward for backward: its output is then never read,
    only the graph behind it (the fused MLP uses this to skip work no gradient needs)."""
    return getattr(_recompute, "active", False)


# --- outputs kept for the recompute ---------------------------------------------------------------
#
# A module inside a checkpointed layer may keep its first-pass output (in host memory, with the
# layer's input) and get it back during the recompute instead of computing it again: the recompute
# runs the same module on the same input, so the values are the same. The attention projections
# do this (patches/lora.py): their matmuls are most of what the attention's recompute costs, and
# their outputs are small beside the MLP's.


def _keeping_entry() -> "_Saved | None":
    return getattr(_recompute, "keeping", None)


def keeping_for_recompute() -> bool:
    """True during a checkpointed layer's first pass when its modules may keep outputs for the recompute.

    For the whole pass, even once the host budget is spent: what was kept earlier in it must not
    be overwritten in place (RoPE asks this).
    """
    entry = _keeping_entry()
    return entry is not None and entry.offloader.keep_budget > 0


def keep_for_recompute(key, *tensors: torch.Tensor) -> None:
    """Keep `tensors` (a module's first-pass results) for the recompute's `kept_for_recompute(key)`.

    They must not be changed in place afterwards (an in-place torch op is caught and the entry
    dropped; a kernel writing into them would go unnoticed, so callers keep only fresh outputs).
    """
    entry = _keeping_entry()
    if entry is not None and entry.room_to_keep():
        entry.keep(key, tensors)


def kept_for_recompute(key) -> tuple[torch.Tensor, ...] | None:
    """During the recompute: what the module `key` kept in the first pass (in call order), else None."""
    kept = getattr(_recompute, "kept", None)
    queue = kept.get(key) if kept else None
    return queue.popleft() if queue else None


def _replay_enabled() -> bool:
    return os.environ.get("UNSLOTH_REPLAY_PROJECTIONS", "1") != "0"


def _host_budget() -> int:
    """Bytes of kept outputs one forward pass may pin in host memory: a quarter of the RAM available."""
    import psutil

    return psutil.virtual_memory().available // 4


class _Offloader:
    """The saved tensors of one forward pass, in host memory, fetched back in reverse order ahead of use.

    Without a GPU (or for CPU tensors) "host memory" is where they already are: they are kept as they are.
    """

    def __init__(self):
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.saved: list[_Saved] = []
        self.pool: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) -> free pinned buffers
        self.kept_bytes = 0
        self.keep_budget = _host_budget() if _replay_enabled() else 0

    def save(self, hidden: torch.Tensor, layer_index: int) -> "_Saved":
        # A new forward pass (whatever happened to the last one) starts at a layer not above the last
        # one saved: not always layer 0, since a multimodal model's text-only batch skips its vision tower.
        if not self.saved or layer_index <= self.saved[-1].layer_index:
            self._recycle()
        entry = _Saved(self, len(self.saved), layer_index)
        entry.add(hidden)
        self.saved.append(entry)
        return entry

    def _recycle(self) -> None:
        """Make the last pass's pinned buffers the pool: allocating pinned memory is slow, and each
        step needs the same buffers again. A buffer is refilled on the side stream, after every
        copy out of it that stream has queued. Buffers the last pass did not use are let go, so
        changing shapes (sequence lengths) do not pile up host memory. Only entries whose backward
        has fetched them are reused: a graph still waiting for its backward keeps its own."""
        self.pool = {}
        for entry in self.saved:
            if entry.device is not None and entry.fetched:
                for host in entry.host:
                    self.pool.setdefault((host.shape, host.dtype), []).append(host)
        self.saved.clear()
        self.kept_bytes = 0

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        free = self.pool.get((like.shape, like.dtype))
        return free.pop() if free else torch.empty(like.shape, dtype=like.dtype, pin_memory=True)


class _Saved:
    """One layer's input, then the outputs its modules keep: copied to pinned host memory on the side
    stream as they come, brought back together on demand."""

    def __init__(self, offloader: _Offloader, index: int, layer_index: int):
        self.offloader, self.index, self.layer_index = offloader, index, layer_index
        self.host: list[torch.Tensor] = []
        self.device: torch.device | None = None  # the GPU they came from; None: nothing was copied
        self.gpu: list[torch.Tensor] | None = None
        self.event = None
        self.fetched = False
        # key -> what the module kept, in call order: [(index of its first tensor in host, tensors,
        # their versions)] during the first pass, [(index, count)] once sealed
        self.kept: dict = {}

    def add(self, *tensors: torch.Tensor) -> None:
        """Copy tensors (all on one device) out on the side stream, after the work that made them."""
        stream = self.offloader.stream
        if stream is None or not tensors[0].is_cuda:
            self.host.extend(tensors)
            return
        self.device = tensors[0].device
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for tensor in tensors:
                host = self.offloader.host_buffer(tensor)
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)  # keep its memory until the copy is done
                self.host.append(host)
        self.event = stream.record_event()

    def room_to_keep(self) -> bool:
        return self.offloader.kept_bytes < self.offloader.keep_budget

    def keep(self, key, tensors) -> None:
        first = len(self.host)
        self.add(*tensors)
        self.offloader.kept_bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.kept.setdefault(key, []).append((first, tensors, [t._version for t in tensors]))

    def seal(self) -> None:
        """End of the first pass: drop what was changed in place after it was kept (the copy may be wrong)."""
        self.kept = {key: [(first, len(ts)) for first, ts, _ in items] for key, items in self.kept.items()
                     if all([t._version for t in ts] == versions for _, ts, versions in items)}  # fmt: skip

    def prefetch(self) -> None:
        if self.gpu is not None:
            return
        if self.device is None:
            self.gpu = list(self.host)
            return
        stream = self.offloader.stream
        with torch.cuda.stream(stream):
            stream.wait_event(self.event)
            self.gpu = [h.to(self.device, non_blocking=True) for h in self.host]
        self.event = stream.record_event()

    def fetch(self) -> tuple[torch.Tensor, dict]:
        """The layer input, and key -> queue of what each module kept (for `kept_for_recompute`)."""
        self.prefetch()
        tensors, self.gpu, self.fetched = self.gpu, None, True
        if self.device is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.event)
            for tensor in tensors:
                tensor.record_stream(current)
        saved = self.offloader.saved
        if 0 < self.index < len(saved) and saved[self.index] is self:
            saved[self.index - 1].prefetch()  # the layer below runs its backward next: start its copy now
        kept = {key: deque(tuple(tensors[first : first + count]) for first, count in items)
                for key, items in self.kept.items()}  # fmt: skip
        return tensors[0], kept


class _CheckpointedLayer(torch.autograd.Function):
    """Run a layer without keeping its activations; recompute them from its input in backward.

    The layer's trainable parameters (and any outside tensor it reads that needs a gradient) are
    inputs of this Function, and its backward returns their gradients instead of accumulating them
    itself: the autograd engine then accumulates each parameter once, through the outer graph.
    That is what data-parallel training needs: DDP's per-parameter hooks fire once per step, and
    its search for unused parameters (`find_unused_parameters`, what the Trainer asks for with a
    PeftModel) finds these parameters in the graph instead of marking them unused in the forward
    and then seeing them again in the recompute (DDP's "marked a variable ready only once" error).
    FSDP2 gets the gradients on its unsharded parameters, as from an uncheckpointed layer.
    """

    @staticmethod
    def forward(ctx, run, offloader, layer_index, hidden, *extras):
        ctx.run = run
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        ctx.offloaded = offloader is not None
        if not ctx.offloaded:
            ctx.save_for_backward(hidden)
            with torch.no_grad():
                return run(hidden)
        ctx.saved = offloader.save(hidden, layer_index)
        previous, _recompute.keeping = _keeping_entry(), ctx.saved
        try:
            with torch.no_grad():
                return run(hidden)
        finally:
            _recompute.keeping = previous
            ctx.saved.seal()

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.offloaded:
            hidden, kept = ctx.saved.fetch()
        else:
            hidden, kept = ctx.saved_tensors[0], {}
        hidden = hidden.detach().requires_grad_(True)
        devices = [hidden.device] if hidden.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            state = (recomputing(), getattr(_recompute, "kept", None))
            _recompute.active, _recompute.kept = True, kept
            try:
                with torch.enable_grad():
                    output, inputs = ctx.run(hidden, recompute=True)
            finally:
                _recompute.active, _recompute.kept = state
        del kept
        wanted = [hidden, *inputs]
        grads = torch.autograd.grad(output, wanted, grad_output, allow_unused=True)
        # A parameter the layer did not use still gets a (zero) gradient: DDP waits for every one.
        grads = [torch.zeros_like(x) if g is None and x.requires_grad else g for g, x in zip(grads, wanted)]
        return (None, None, None, *grads)


def _kv_sharing(layers: list[nn.Module]) -> list[bool | None]:
    """Per layer: whether it writes K/V into the mapping its layers share for later layers that read
    them, or is one of those readers (Gemma 3n, Gemma 4 E2B / E4B), by transformers' attention flags;
    None where a layer has no such flags (a mapping passed to it is then an unknown side channel)."""
    flags = [(getattr(getattr(layer, "self_attn", None), "store_full_length_kv", None),
              getattr(getattr(layer, "self_attn", None), "is_kv_shared_layer", None)) for layer in layers]
    readers = any(reads for _, reads in flags)  # Gemma 4 stores K/V even where no layer reads them
    return [None if stores is None and reads is None else bool(reads or (stores and readers))
            for stores, reads in flags]


def _passes_tensors_between_layers(layer, args, kwargs) -> bool:
    """A mapping among the layer's arguments that carries tensors between it and other layers."""
    return layer._unsloth_kv_sharing is not False and any(
        isinstance(a, MutableMapping) for a in (*args, *kwargs.values()))


def _trainable_parameters(layer: nn.Module) -> list[nn.Parameter]:
    """`[p for p in layer.parameters() if p.requires_grad]`, without walking the module tree on every
    call (a LoRA layer has dozens of modules: the walk was a few percent of a host-paced step). The
    layer's modules' parameter dicts are kept and read per call: FSDP2 swaps its unsharded parameters
    into those same dicts for the forward, and requires_grad may change between steps."""
    return [p for p in current_parameters(layer) if p.requires_grad]


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
    if _passes_tensors_between_layers(self, args, kwargs):
        # The Function's no-grad first pass would cut the graph of what this layer writes into the
        # mapping, and it does not see what the layer reads from it as an input needing a gradient.
        # torch's non-reentrant checkpoint keeps both right (not offloaded).
        from torch.utils.checkpoint import checkpoint

        return checkpoint(original, hidden_states, *args, use_reentrant=False, **kwargs)
    returns_tuple = []
    # Arguments that need a gradient (rare: the hidden state and masks do not) are inputs of the
    # Function beside the parameters; the recompute reads them as fresh leaves to get theirs.
    outside = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    outside += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    params = _trainable_parameters(self)

    def run(hidden, recompute=False):
        call_args, call_kwargs = args, kwargs
        leaves = []
        if recompute and outside:
            call_args, call_kwargs = list(args), dict(kwargs)
            for key, tensor in outside:
                leaves.append(tensor.detach().requires_grad_(True))
                if isinstance(key, int):
                    call_args[key] = leaves[-1]
                else:
                    call_kwargs[key] = leaves[-1]
        out = original(hidden, *call_args, **call_kwargs)
        if isinstance(out, tuple):  # older transformers return (hidden_states, ...)
            if not recompute:
                returns_tuple.append(out[1:])
            out = out[0]
        return (out, leaves + params) if recompute else out

    offloader = self._unsloth_offloader
    output = _CheckpointedLayer.apply(run, offloader, self._unsloth_layer_index, hidden_states,
                                      *(t for _, t in outside), *params)
    return (output, *returns_tuple[0]) if returns_tuple else output


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: transformers' checkpointable layers, else the longest ModuleList's items.
    A speech model's codec is left out: it runs under no_grad (CSM encodes audio to codes with it)."""
    from unsloth.models.speech import codec_of

    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers
        GradientCheckpointingLayer = None
    codec = codec_of(model)
    skipped = set(map(id, codec.modules())) if codec is not None else set()
    if GradientCheckpointingLayer is not None:
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and id(m) not in skipped]
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
    offloader = _Offloader() if mode == "unsloth" else None
    for index, (layer, sharing) in enumerate(zip(layers, _kv_sharing(layers))):
        if mode is False:
            layer.__dict__.pop("forward", None)
            continue
        if "_unsloth_original_forward" not in layer.__dict__:
            layer._unsloth_original_forward = layer.forward
        layer._unsloth_offloader = offloader
        layer._unsloth_layer_index = index
        layer._unsloth_kv_sharing = sharing
        layer.forward = types.MethodType(_checkpointed_forward, layer)
    if mode is not False:
        watch_registrations()  # before anything is compiled: module_tree says why
        # With frozen embeddings nothing upstream requires grad, and the checkpoint would cut the graph.
        _inputs_require_grad(model)
    return 0 if mode is False else len(layers)


def _inputs_require_grad(model: nn.Module) -> None:
    from unsloth.models.speech import codec_of

    if codec_of(model) is None:
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
        return
    # transformers 5 hooks every sub-model's input embedding; Sesame CSM's depth decoder writes into its
    # embedding output in place, which a leaf that requires grad forbids: the model's own embedding only
    previous = model.__dict__.pop("_unsloth_input_grad_hook", None)
    if previous is not None:
        previous.remove()
    model._unsloth_input_grad_hook = model.get_input_embeddings().register_forward_hook(require_grad_when_recorded)
