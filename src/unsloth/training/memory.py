"""The GPU memory a training run needs, estimated before it starts; and what to change when it does not fit.

    weights      every parameter and buffer as loaded (16-bit, 8-bit or packed 4-bit, with their scales)
    gradients    one per trainable weight, in its dtype (LoRA: the adapters only; full: every weight)
    optimizer    AdamW: two states per trainable weight in its dtype (float32 weights: 8 bytes each);
                 bitsandbytes 8-bit: 1 byte per state plus a float32 scale per 256 (tensors under
                 4096 elements keep float32 states), as bitsandbytes allocates them
    activations  what the backward pass keeps for the chosen batch x sequence length: every layer's
                 saved tensors without checkpointing; each layer's input plus one layer's recompute
                 with it (its MLP buffers as chunks where our MLP skips its output there); only the
                 layers in flight when the inputs are offloaded ("unsloth"); plus
                 the loss (our fused loss keeps no logits, but computes the LM head's gradient early)

The weights, gradients and optimizer states are counted exactly from the loaded model (the tests
compare them with what PyTorch and bitsandbytes allocate); the activations are a per-layer formula
for decoder blocks (attention with SDPA, a gated MLP), a sanity-level figure. The parts are summed,
which slightly overstates the peak (activations are freed while the gradients fill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from unsloth.errors import ExitCode, UnslothError

GIB = 2**30
_BNB_BLOCK = 256  # bitsandbytes' blockwise 8-bit optimizer states: one float32 absmax per block
_BNB_MIN_8BIT = 4096  # smaller tensors keep float32 states (bitsandbytes' min_8bit_size default)
_LOSS_CHUNK_BYTES = 256 * 2**20  # the fused loss's logits chunk (unsloth_kernels.cross_entropy)


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate reads off a loaded model, once."""

    hidden: int
    intermediate: int
    layers: int
    q_width: int  # attention heads x head size
    kv_width: int  # key/value heads x head size
    vocab: int
    weight_bytes: int
    trainable: tuple[tuple[int, int], ...]  # (elements, bytes per element) per trainable tensor
    activation_bytes: int  # bytes per activation element (the compute dtype)
    fused_loss: bool
    head_trainable: bool
    mlp_kept: int = 3  # (tokens x intermediate) tensors a layer's MLP keeps for backward (ours: gate, up)
    mlp_chunk_bytes: int = 0  # our MLP's chunk in a recompute's backward (0: it holds whole buffers)


@dataclass(frozen=True)
class RunSettings:
    batch: int
    seq: int
    optim: str = "adamw_torch"
    checkpointing: bool | str = "unsloth"
    offload: bool = True  # "unsloth" checkpointing offloads to host memory (a GPU run)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    optimizer_kind: str

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def summary(self) -> str:
        return (f"weights {gib(self.weights)} + gradients {gib(self.gradients)} + optimizer states "
                f"{gib(self.optimizer)} ({self.optimizer_kind}) + activations {gib(self.activations)} "
                f"= {gib(self.total)}")


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


# --- exact parts ---------------------------------------------------------------------------------

def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _quantization_bytes(weight) -> int:
    """bitsandbytes' side tensors of a quantized weight: 4-bit absmax (and its nested state), 8-bit row scales."""
    total = 0
    state = getattr(weight, "quant_state", None)
    while state is not None:
        for name in ("absmax", "code"):
            value = getattr(state, name, None)
            if value is not None and hasattr(value, "numel"):
                total += _tensor_bytes(value)
        state = getattr(state, "state2", None)
    scales = getattr(weight, "SCB", None)
    if scales is not None and hasattr(scales, "numel"):
        total += _tensor_bytes(scales)
    return total


def weight_bytes(model, device_type: str | None = None) -> int:
    """Bytes of every parameter and buffer as stored (tied weights once), with quantization scales;
    only those on `device_type` when given (an input embedding offloaded to host memory is not)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in seen or (device_type is not None and t.device.type != device_type):
            continue
        seen.add(id(t))
        total += _tensor_bytes(t) + _quantization_bytes(t)
    return total


def trainable_tensors(model) -> tuple[tuple[int, int], ...]:
    return tuple((p.numel(), p.element_size()) for p in model.parameters() if p.requires_grad)


def gradient_bytes(trainable) -> int:
    return sum(n * size for n, size in trainable)


def _is_8bit(optim: str) -> bool:
    return "8bit" in optim


def _one_state(optim: str) -> bool:
    return "lion" in optim or "rmsprop" in optim


def optimizer_bytes(trainable, optim: str) -> tuple[int, str]:
    """Bytes of the optimizer's states for these trainable tensors, and what they are in words."""
    optim = str(getattr(optim, "value", optim)).lower()
    states = 1 if _one_state(optim) else 2
    if optim in ("sgd", "adafactor"):  # no momentum; factored second moments (small)
        return 0, f"{optim}: not counted"
    if _is_8bit(optim):
        total, any_8bit = 0, False
        for n, _ in trainable:
            if n < _BNB_MIN_8BIT:
                total += states * 4 * n
            else:
                any_8bit = True
                total += states * (n + 4 * math.ceil(n / _BNB_BLOCK))
        return total + (states * 256 * 4 if any_8bit else 0), f"{optim}: 8-bit states"
    if optim.startswith("paged_") or "bnb" in optim:  # bitsandbytes 32-bit states
        return sum(states * 4 * n for n, _ in trainable), f"{optim}: float32 states"
    # PyTorch's AdamW: exp_avg and exp_avg_sq like the weight, and a float32 step count per tensor
    return sum(states * n * size + 4 for n, size in trainable), f"{optim}: states in the weights' dtype"


# --- activations ---------------------------------------------------------------------------------

def layer_activation_bytes(facts: ModelFacts, tokens: int, recompute: bool = False) -> int:
    """What one decoder layer's backward keeps: its input and normed input (twice: attention and MLP),
    q, k, v after RoPE, the attention output (and the copy o_proj reads), gate, up and (but in our MLP)
    their product; in a checkpoint's recompute where our MLP skips its output, the three chunks its
    backward works in instead."""
    h, q, kv, i = facts.hidden, facts.q_width, facts.kv_width, facts.intermediate
    mlp = tokens * facts.mlp_kept * i * facts.activation_bytes
    if recompute and facts.mlp_chunk_bytes:
        mlp = min(tokens * 3 * i * facts.activation_bytes, 3 * facts.mlp_chunk_bytes)
    return tokens * (4 * h + 3 * q + 2 * kv) * facts.activation_bytes + mlp


def activation_parts(facts: ModelFacts, settings: RunSettings) -> tuple[int, int]:
    """(kept, working): the bytes the forward pass keeps for backward, and the largest short-lived
    buffers on top of them (a checkpointed layer's recompute, the fused loss's logits chunk)."""
    tokens = settings.batch * settings.seq
    recompute = layer_activation_bytes(facts, tokens, recompute=True)
    layer_input = tokens * facts.hidden * facts.activation_bytes
    if settings.checkpointing is False:
        kept, working = facts.layers * layer_activation_bytes(facts, tokens), 0
    elif settings.checkpointing == "unsloth" and settings.offload:
        kept, working = 2 * layer_input, recompute  # inputs in host memory but the ones in flight
    else:
        kept, working = facts.layers * layer_input, recompute
    kept += layer_input  # the final norm's input
    if facts.fused_loss:
        kept += layer_input  # d(loss)/d(hidden), computed in the forward pass
        if facts.head_trainable:
            kept += facts.vocab * facts.hidden * facts.activation_bytes  # and the head's gradient
        rows = min(tokens, max(_LOSS_CHUNK_BYTES // max(facts.vocab * facts.activation_bytes, 1), 16))
        working = max(working, rows * facts.vocab * facts.activation_bytes)
    else:  # transformers' loss keeps the logits, their float32 copy and its log-softmax
        kept += tokens * facts.vocab * (facts.activation_bytes + 8)
    return kept, working


def activation_bytes(facts: ModelFacts, settings: RunSettings) -> int:
    return sum(activation_parts(facts, settings))


def estimate(facts: ModelFacts, settings: RunSettings) -> MemoryEstimate:
    optimizer, kind = optimizer_bytes(facts.trainable, settings.optim)
    return MemoryEstimate(facts.weight_bytes, gradient_bytes(facts.trainable), optimizer,
                          activation_bytes(facts, settings), kind)


def training_device(model):
    """The accelerator the model trains on (some weights may sit in host memory), else the CPU."""
    import torch

    devices = {p.device for p in model.parameters()}
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def model_facts(model) -> ModelFacts:
    """The facts of a loaded causal LM (a PeftModel's base config is read through it); its weights
    are counted where it trains."""
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    floats = [p for p in model.parameters() if p.is_floating_point()]
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    compute = getattr(getattr(config, "quantization_config", None), "bnb_4bit_compute_dtype", None)
    activation = floats[0].element_size() if floats else 2
    if getattr(getattr(config, "quantization_config", None), "load_in_4bit", False) and compute is not None:
        activation = compute.itemsize
    return ModelFacts(
        hidden=text.hidden_size, intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        layers=text.num_hidden_layers, q_width=heads * head_dim, kv_width=kv_heads * head_dim,
        vocab=text.vocab_size, weight_bytes=weight_bytes(model, training_device(model).type),
        trainable=trainable_tensors(model),
        activation_bytes=activation, fused_loss=bool(getattr(base, "_unsloth_fused_loss", False)),
        head_trainable=head is not None and head.weight.requires_grad,
        mlp_kept=2 if any(hasattr(m, "_unsloth_act") for m in base.modules()) else 3,
        mlp_chunk_bytes=_mlp_chunk_bytes(base),
    )


def _mlp_chunk_bytes(model) -> int:
    """The chunk our MLPs' recompute backward works in, where they skip their output (0 elsewhere):
    the trained-weights MLP's where its projections train (full fine-tuning), else the LoRA MLP's."""
    skipping = [m for m in model.modules() if getattr(m, "_unsloth_mlp_feeds_residual", False)]
    if not skipping:
        return 0
    from unsloth_kernels import gated_mlp, lora  # patched MLPs: our kernels are there

    trained = getattr(getattr(skipping[0].gate_proj, "weight", None), "requires_grad", False)
    return gated_mlp.CHUNK_BYTES if trained else lora.MLP_CHUNK_BYTES


# --- the check before training -------------------------------------------------------------------

class NotEnoughMemory(UnslothError):
    """The run's estimate does not fit the device's free memory: refused before the first step."""

    exit_code = ExitCode.OUT_OF_MEMORY


def fixes(facts: ModelFacts, settings: RunSettings, full_finetuning: bool, load_in_4bit: bool) -> list[str]:
    """What would make the run smaller, most effective first, each with its new estimate where we can say."""
    tips = []

    def after(**change) -> str:
        return f"then about {gib(estimate(facts, replace(settings, **change)).total)} in all"

    if settings.checkpointing != "unsloth":
        tips.append(f'offloaded checkpointing: gradient_checkpointing = "unsloth" ({after(checkpointing="unsloth")})')
    optim = str(getattr(settings.optim, "value", settings.optim)).lower()
    if not _is_8bit(optim) and full_finetuning:
        tips.append(f'8-bit optimizer states: training.optim = "adamw_8bit" ({after(optim="adamw_8bit")})')
    if settings.batch > 1:
        smaller = max(1, settings.batch // 2)
        tips.append(f"a smaller batch: training.per_device_train_batch_size = {smaller} ({after(batch=smaller)}; "
                    "raise training.gradient_accumulation_steps to keep the effective batch)")
    if full_finetuning:
        tips.append("LoRA instead of full fine-tuning: model.full_finetuning = false, with a [lora] table")
    elif not load_in_4bit:
        tips.append("4-bit base weights (QLoRA): model.load_in_4bit = true")
    if settings.seq > 512:
        tips.append(f"shorter sequences: model.max_seq_length = {settings.seq // 2} "
                    f"({after(seq=settings.seq // 2)})")
    return tips


def check_fits(estimated: MemoryEstimate, free: int, tips: list[str], weights_loaded: bool = True) -> None:
    """Raise NotEnoughMemory when the run cannot fit `free` bytes (the weights, once loaded, are already off it)."""
    needed = estimated.total - (estimated.weights if weights_loaded else 0)
    if needed <= free:
        return
    loaded = f" beyond the {gib(estimated.weights)} of weights already loaded" if weights_loaded else ""
    raise NotEnoughMemory(
        f"this run needs about {gib(needed)} more GPU memory{loaded}, and {gib(free)} is free: "
        f"{estimated.summary()}",
        "Try, in this order:\n" + "\n".join(f"  - {t}" for t in tips) if tips else None,
        kept="nothing was trained or written")


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


def sharded_estimate(whole: MemoryEstimate, shards: int) -> MemoryEstimate:
    """One GPU's part of a run whose weights, gradients and optimizer states are split over `shards`."""
    return replace(whole, weights=math.ceil(whole.weights / shards), gradients=math.ceil(whole.gradients / shards),
                   optimizer=math.ceil(whole.optimizer / shards))


def check_before_training(model, *, batch: int, seq: int, optim, checkpointing, full_finetuning: bool,
                          load_in_4bit: bool, echo=None, shards: int = 1) -> MemoryEstimate | None:
    """On a GPU: estimate the run, say it, and refuse it at once (NotEnoughMemory) when it cannot fit the
    free memory. UNSLOTH_MEMORY_CHECK=0 skips the refusal (the estimate is still said).

    `shards`: the processes an FSDP2-sharded model is split over; each GPU holds that share of the
    weights, gradients and optimizer states (the activations are its own)."""
    import os

    import torch

    device = training_device(model)
    if device.type != "cuda":
        return None
    facts = model_facts(model)
    settings = RunSettings(batch=batch, seq=seq, optim=str(getattr(optim, "value", optim)),
                           checkpointing=checkpointing, offload=True)
    estimated = sharded_estimate(estimate(facts, settings), shards)
    free, _ = torch.cuda.mem_get_info(device)
    if echo is not None:
        echo(f"memory: {estimated.summary()}; {gib(free)} free on {torch.cuda.get_device_name(device)}")
    if os.environ.get("UNSLOTH_MEMORY_CHECK", "1") != "0":
        check_fits(estimated, free, fixes(facts, settings, full_finetuning, load_in_4bit))
    return estimated
