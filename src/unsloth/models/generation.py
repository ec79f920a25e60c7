"""Fast decoding after training: a static KV cache sized in buckets, the decode step in CUDA graphs.

`enable(model)` (what `for_inference` calls) routes the model's `generate` through `fast_generate`:
transformers' `generate` stays the driver (so every sampling option, stop string and streamer users
pass keeps working through its logits processors and stopping criteria), but it is handed a
`StaticCache` we keep between calls. On a GPU transformers then compiles the one-token decode step
with `torch.compile(mode="reduce-overhead")`, i.e. captures it in CUDA graphs, because the cache is
static; on the CPU the same path runs eagerly (and gives the same tokens as plain `generate`).

The cache length is rounded up to a bucket and one cache is kept per (batch, bucket), so a new
prompt length or `max_new_tokens` reuses the shapes (and graphs) already compiled instead of
compiling every call. LoRA adapters stay unmerged: the graphs read the very parameters training
updates in place, so generation always uses the current adapters, with no copy per step.
`disable(model)` (what `for_training` calls) drops the caches and gives back plain `generate`.

On CUDA transformers' decode loop reads "has every row finished?" back to the host after every
step, so the host prepares step n + 1 only once the GPU has finished step n. Its `DeferredStopCheck`
reads that flag one step late instead (one extra decode step when rows stop early, undone after),
but transformers turns it on for Apple's "mps" only and never for a cache the caller passed in.
Inside our calls it decides for CUDA as it decides for "mps" (`_defer_stop_checks`), and our kept
cache does not count as the caller's (nothing outside reads it back), so the host runs a step ahead.
The tokens are generate's; only when sampling rows that all stop early does the undone step draw
random numbers of its own, so the generator's state after the call is one step further on.

Sampling reads back too: torch.multinomial checks the probabilities with two `.item()` calls per token
before its one-sample draw (p / q with q ~ Exp(1), argmax). Inside our calls on the same devices that draw
runs without them (`_sample_without_readback`: the same draws from the same generator), and the checks
are kept on the device and raised when the call ends (a 4-bit 8B GRPO rollout: 3.40 s against 2.59 s
greedy before this).

Once a call has decoded with dynamo's guards for a (rows, cache length), later calls of that shape skip
them (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)` around the compiled step only: just the
guards that tell the kept graphs apart, here their sizes, run). A QLoRA step is guarded on thousands of
tensors and quant states, checked before every token: on the CPU, 32 tiny LoRA layers (dynamo's eager
backend) decoded in a median 19.9 against 22.4 ms a step without them, the same tokens. Only while every
call so far ran in one set of modes (the adapters' switches, grad and autocast modes, dtype and device):
once another is seen (a call inside `disable_adapter()`), the guards run at every step again, since graphs
kept for two adapter states were told apart wrongly without them. UNSLOTH_DECODE_SKIP_GUARDS=0 keeps them.

Grouped-query attention decodes on the key/value heads themselves (patches/decode_attention.py), not on
copies made per query head. The hook that makes the input embedding's output require grad for training
does nothing without grad mode, so it does not break the step's graph; a table in host memory is looked up
outside the graph (models/embedding.py), the one break then.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import os
import threading
from collections.abc import Mapping

import torch
import torch._dynamo

from unsloth.models.embedding import grad_mode_input_hooks

log = logging.getLogger("unsloth")

__all__ = ["BUCKET", "cache_length", "disable", "enable", "enabled"]

BUCKET = 256  # cache lengths are multiples of this: few shapes to compile, at most BUCKET - 1 slots unused
_MAX_CACHES = 4  # (batch, bucket) caches kept per model; the oldest is dropped first
# Devices where our calls defer transformers' stop check (the CPU has no events to defer it with) and
# sample without reading the probabilities' checks back.
DEFER_DEVICES = {"cuda"}
_CALLS = threading.local()  # .depth: fast_generate calls running on this thread; .invalid: the draws' checks;
# .skip_guards: whether this call's compiled steps skip dynamo's guards (its state decoded with them before)
SKIP_GUARDS = os.environ.get("UNSLOTH_DECODE_SKIP_GUARDS", "1") != "0"


def cache_length(tokens: int, bucket: int = BUCKET) -> int:
    """The static cache length serving a call that needs `tokens` positions: the bucket above."""
    return -(-tokens // bucket) * bucket


def _backbone(model):
    """The transformers model whose `generate` runs (under peft's wrapper when there is one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enabled(model) -> bool:
    return getattr(_backbone(model), "_unsloth_fast_generation", None) is not None


def enable(model):
    """Turn the fast path on (idempotent): KV cache on, `generate` through `fast_generate`.

    The train/eval mode is the caller's: `fast_generate` itself decodes in eval mode."""
    from transformers import GenerationMixin

    from unsloth.models.patches.decode_attention import patch_decode_attention

    backbone = _backbone(model)
    backbone.config.use_cache = True
    if getattr(type(backbone), "generate", None) is not GenerationMixin.generate:
        # a model class with its own generate (Sesame CSM writes audio frames through its depth decoder)
        # manages its own caches: it keeps that generate, with the KV cache on
        return model
    if getattr(backbone, "_unsloth_fast_generation", None) is None:
        backbone._unsloth_fast_generation = {}  # (batch, cache length) -> StaticCache
    _defer_stop_checks()
    _sample_without_readback()
    patch_decode_attention()
    if not getattr(backbone.generate, "_unsloth_fast", False):
        plain = backbone.generate
        fast = functools.wraps(plain)(functools.partial(fast_generate, backbone, plain))
        fast._unsloth_fast, fast._unsloth_plain = True, plain
        backbone.generate = fast
    if "get_compiled_call" not in backbone.__dict__ and hasattr(backbone, "get_compiled_call"):
        backbone.get_compiled_call = functools.partial(_compiled_call, backbone.get_compiled_call)
    return model


def disable(model):
    """Undo `enable`: caches freed, plain `generate` back (the mode is the caller's to set)."""
    backbone = _backbone(model)
    backbone.__dict__.pop("_unsloth_fast_generation", None)
    backbone.__dict__.pop("_unsloth_eager_decode", None)
    if getattr(backbone.generate, "_unsloth_fast", False):
        plain = backbone.generate._unsloth_plain
        # the plain one was the class's method unless someone had put an instance attribute there
        if getattr(plain, "__self__", None) is backbone and plain.__func__ is type(backbone).generate:
            del backbone.generate
        else:
            backbone.generate = plain
    # compiled decode steps hold graphs sized for inference; training never uses them
    backbone.__dict__.pop("_compiled_call", None)
    backbone.__dict__.pop("_unsloth_said_compiling", None)
    backbone.__dict__.pop("_unsloth_guarded_states", None)
    if isinstance(backbone.__dict__.get("get_compiled_call"), functools.partial):
        del backbone.get_compiled_call
    return model


def _unsupported(config, kwargs) -> str | None:
    """Why this call goes to plain `generate`, or None when the static-cache path serves it."""
    from transformers.generation.utils import ALL_CACHE_NAMES

    if any(kwargs.get(name) is not None for name in ALL_CACHE_NAMES):
        return "a cache was passed"
    if (config.num_beams or 1) > 1 or kwargs.get("assistant_model") is not None or config.prompt_lookup_num_tokens:
        return "beam search and assisted decoding keep their own caches"
    if config.cache_implementation not in (None, "static"):
        return f"cache_implementation={config.cache_implementation!r} was asked for"
    if config.use_cache is False:
        return "use_cache=False"
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds"
    return None


def fast_generate(backbone, plain, *args, **kwargs):
    """`generate` on a static cache kept between calls (compiled decode step on a GPU)."""
    from transformers.generation.utils import ALL_CACHE_NAMES

    caches = getattr(backbone, "_unsloth_fast_generation", None)
    if args and isinstance(args[0], Mapping) and "input_ids" in args[0]:  # a BatchEncoding, positionally
        kwargs, args = {**dict(args[0]), **kwargs}, args[1:]
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if caches is None or not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        return plain(*args, **kwargs)
    # The options this call ends up with, to decide on; `generate` itself still gets the caller's own keywords
    # (an explicit None there, as eos_token_id=None, wins over the model's default only as a keyword)
    config = copy.deepcopy(kwargs.get("generation_config") or backbone.generation_config)
    rest = config.update(**{key: value for key, value in kwargs.items() if key != "generation_config"})
    if _unsupported(config, rest) is not None:
        return plain(*args, **kwargs)
    if config.stop_strings and rest.get("tokenizer") is None and hasattr(backbone, "_unsloth_tokenizer"):
        kwargs["tokenizer"] = backbone._unsloth_tokenizer  # stop strings are matched on text (TRL passes none)
    batch, prompt = input_ids.shape
    # unset fields are None in newer transformers (their defaults are applied inside generate)
    new = config.max_new_tokens if config.max_new_tokens is not None else (config.max_length or 20) - prompt
    rows = batch * (config.num_return_sequences or 1)
    length = cache_length(prompt + max(new, 1))
    cache = caches.pop((rows, length), None)
    if cache is None:
        cache = _new_cache(backbone, length)
    caches[(rows, length)] = cache  # most recently used last
    while len(caches) > _MAX_CACHES:
        caches.pop(next(iter(caches)))
    cache.reset()
    ours = {"cache_implementation": None,  # the cache is ours; generate refuses both
            # TRL turns compilation off for its rollouts (made for a dynamic cache); we compile unless it failed
            "disable_compile": backbone.__dict__.get("_unsloth_eager_decode", False),
            "compile_config": config.compile_config or _compile_config(backbone)}
    config.update(**ours)
    compiles = config.compile_config is not None and not config.disable_compile
    if compiles:
        _say_compiling(backbone, rows, length)
    was_training = backbone.training
    backbone.eval()  # no dropout in rollouts, as with vLLM; the caller's mode comes back after
    quantizer = _hide_bitsandbytes_4bit(backbone) if not config.disable_compile else None
    grad_mode_input_hooks(backbone)  # no graph break at the embedding
    guarded = backbone.__dict__.setdefault("_unsloth_guarded_states", {})  # modes -> shapes decoded with guards
    modes = _decode_modes(backbone) if SKIP_GUARDS and compiles else None
    skip = len(guarded) == 1 and (rows, length) in guarded.get(modes, ())
    _CALLS.depth = getattr(_CALLS, "depth", 0) + 1
    outer, _CALLS.invalid = getattr(_CALLS, "invalid", None), None
    outer_skip, _CALLS.skip_guards = getattr(_CALLS, "skip_guards", False), skip
    try:
        try:
            out = plain(*args, **_with_options(kwargs, ours), **{ALL_CACHE_NAMES[0]: cache})
        except torch._dynamo.exc.TorchDynamoException as error:
            if config.disable_compile:
                raise
            # a layer torch.compile cannot take: keep the static cache, decode without graphs from now on
            log.warning("unsloth: the decode step could not be compiled (%s: %s); generating without CUDA graphs",
                        type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            backbone._unsloth_eager_decode = True
            cache.reset()
            config.disable_compile = ours["disable_compile"] = True
            modes = None
            out = plain(*args, **_with_options(kwargs, ours), **{ALL_CACHE_NAMES[0]: cache})
        if modes is not None:
            guarded.setdefault(modes, set()).add((rows, length))  # decoded with every guard: its graphs exist
        if _CALLS.invalid is not None and bool(_CALLS.invalid):
            raise RuntimeError("sampling met a probability tensor with `inf`, `nan`, an element < 0 or a row of "
                               "zeros (as torch.multinomial says), so the sampled tokens are not valid: check the "
                               "logits processors and the temperature")
        return out
    finally:
        _CALLS.depth -= 1
        _CALLS.invalid, _CALLS.skip_guards = outer, outer_skip
        if quantizer is not None:
            backbone.hf_quantizer = quantizer
        backbone.train(was_training)


def _with_options(kwargs: dict, options: dict) -> dict:
    """The caller's keywords with generation `options` added: as keywords, or set on a copy of the caller's
    generation_config (generate warns when given both)."""
    given = kwargs.get("generation_config")
    if given is None:
        return {**kwargs, **options}
    config = copy.deepcopy(given)
    config.update(**options)
    return {**{key: value for key, value in kwargs.items() if key not in options}, "generation_config": config}


def _decode_modes(backbone) -> tuple:
    """What the compiled decode step's graphs depend on beyond the shapes and the tensors' values: the modes
    and each adapter layer's switches (peft's `disable_adapter()`, `set_adapter`, merges and scales)."""
    layers = _adapter_layer_types()
    adapters = tuple(
        (getattr(module, "disable_adapters", False), tuple(getattr(module, "active_adapters", ())),
         tuple(getattr(module, "merged_adapters", ())), tuple(getattr(module, "scaling", {}).items()))
        for module in backbone.modules() if isinstance(module, layers))
    return (backbone.dtype, backbone.device, torch.is_grad_enabled(), torch.is_autocast_enabled(backbone.device.type),
            adapters)


@functools.cache
def _adapter_layer_types() -> tuple[type, ...]:
    """peft's layer classes that switch adapters on and off (LoRA and the other tuners, modules_to_save)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return ()
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        return (BaseTunerLayer,)
    return BaseTunerLayer, AuxiliaryTrainingWrapper


def _compiled_call(get_compiled_call, compile_config):
    """transformers' compiled decode step, called under a stance that skips dynamo's guards where this call's
    state was decoded with them before (`_CALLS.skip_guards`)."""
    compiled = get_compiled_call(compile_config)
    if not _can_skip_guards():
        return compiled

    @functools.wraps(compiled)
    def step(*args, **kwargs):
        stance = getattr(torch._dynamo.eval_frame, "_stance", None)  # one the caller set is theirs to keep
        if (not getattr(_CALLS, "skip_guards", False) or getattr(stance, "stance", "default") != "default"
                or getattr(stance, "backend", None) is not None):
            return compiled(*args, **kwargs)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return compiled(*args, **kwargs)

    return step


@functools.cache
def _can_skip_guards() -> bool:
    return "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters


def _say_compiling(backbone, rows: int, length: int) -> None:
    """The first call for a (batch, cache length) compiles its decode step: on an H100, for an 8B model,
    about 40 s in 16-bit and 3 minutes in 4-bit with cold compile caches (30 s once Inductor's cache holds
    its kernels); without a word that looks like a hang. Said once per shape (its graphs are kept)."""
    said = backbone.__dict__.setdefault("_unsloth_said_compiling", set())
    if (rows, length) not in said:
        said.add((rows, length))
        log.info("unsloth: compiling the decode step for %d row%s and a %d-token cache (once for this shape, "
                 "up to a few minutes for an 8B model; later calls reuse it)", rows, "" if rows == 1 else "s", length)


def _compile_config(backbone):
    """How transformers compiles the decode step: on a GPU with shapes specialized, so one graph per
    (batch, bucket), none of them symbolic; elsewhere it does not compile (None)."""
    from transformers import CompileConfig

    return CompileConfig(dynamic=False) if backbone.device.type == "cuda" else None


def _hide_bitsandbytes_4bit(backbone):
    """transformers never compiles a bitsandbytes model's decode step (its quantizer says so), but a
    4-bit layer traces into one graph (bitsandbytes' ops are torch custom ops: a test checks it with
    fullgraph=True); for the call, the quantizer is out of sight of that check. Returns it to put back."""
    quantizer = backbone.__dict__.get("hf_quantizer")
    config = getattr(quantizer, "quantization_config", None)
    if quantizer is None or backbone.device.type != "cuda" or not getattr(config, "load_in_4bit", False):
        return None
    backbone.hf_quantizer = None
    return quantizer


def _new_cache(backbone, length: int):
    return _kept_cache_class()(config=backbone.config.get_text_config(decoder=True), max_cache_len=length)


@functools.cache
def _kept_cache_class():
    from transformers import StaticCache

    class KeptStaticCache(StaticCache):
        """A StaticCache we keep between calls and pass to `generate`. transformers marks a passed cache
        as the caller's (`_is_user_defined`), which it would hand back and so must not step past the
        stop; ours is reset by the next call and read by no one, so the mark does not stick."""

        _is_user_defined = property(lambda self: False, lambda self, value: None)

    KeptStaticCache.__module__, KeptStaticCache.__qualname__ = __name__, "KeptStaticCache"  # pickles by name
    return KeptStaticCache


def __getattr__(name):  # the cache class is made on first use, so that importing this module stays light
    if name == "KeptStaticCache":
        return _kept_cache_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _defer_stop_checks() -> bool:
    """Make transformers' DeferredStopCheck decide for our calls on DEFER_DEVICES as it decides for
    "mps" (idempotent). Only where its `is_supported(device, cache, cache_is_returned, is_assistant)`
    is the static method this was checked against; otherwise nothing changes. Returns whether it is on."""
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:
        return False
    original = DeferredStopCheck.__dict__.get("is_supported")
    if not isinstance(original, staticmethod):
        return False
    decide = original.__func__
    if getattr(decide, "_unsloth_defers", False):
        return True
    if list(inspect.signature(decide).parameters) != ["device", "cache", "cache_is_returned", "is_assistant"]:
        log.debug("unsloth: transformers' DeferredStopCheck.is_supported changed; the stop check stays per step")
        return False

    @functools.wraps(decide)
    def is_supported(device, cache, cache_is_returned, is_assistant=False):
        if getattr(_CALLS, "depth", 0) and torch.device(device).type in DEFER_DEVICES:
            device = torch.device("mps")  # transformers' own rule, for the device it already defers on
        return decide(device, cache, cache_is_returned, is_assistant=is_assistant)

    is_supported._unsloth_defers = True
    DeferredStopCheck.is_supported = staticmethod(is_supported)
    return True


def _draw_one(probs, generator=None):
    """torch.multinomial's draw of one sample per row (ATen's Gumbel-max form), without its checks."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / q, dim=-1, keepdim=True)


def _sample_without_readback() -> bool:
    """Route `torch.multinomial(p, 1)` inside our calls on DEFER_DEVICES to `_draw_one`, its checks kept
    on the device for `fast_generate` to raise at the end (idempotent). Installed only where a probe on
    the CPU gives torch's own draws, seeded alike, for one row and for several. Returns whether it is on."""
    original = torch.multinomial
    if getattr(original, "_unsloth_original", None) is not None:
        return True
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    for p in (probs, probs[0]):
        expected = original(p, 1, generator=torch.Generator().manual_seed(1))
        if not torch.equal(_draw_one(p, torch.Generator().manual_seed(1)), expected):
            log.debug("unsloth: torch.multinomial draws differently; sampling reads its checks back per token")
            return False

    @functools.wraps(original)
    def multinomial(input, num_samples, replacement=False, *, generator=None, out=None):
        if (torch.compiler.is_compiling()  # someone's compiled sampling traces torch's, as before
                or num_samples != 1 or out is not None or not getattr(_CALLS, "depth", 0)
                or input.device.type not in DEFER_DEVICES or input.dim() not in (1, 2) or not input.numel()):
            return original(input, num_samples, replacement, generator=generator, out=out)
        invalid = ~((input.min() >= 0) & (input.max() < math.inf) & (input.sum(-1) > 0).all())
        _CALLS.invalid = invalid if _CALLS.invalid is None else _CALLS.invalid | invalid
        return _draw_one(input, generator)

    multinomial._unsloth_original = original
    torch.multinomial = multinomial
    return True
