"""Gated DeltaNet layers (Qwen3.5, Qwen3-Next): which implementation of the gated delta rule runs.

transformers picks flash-linear-attention's kernel at import when fla is installed, else its own
torch reference (correct, an order of magnitude slower). fla itself refuses its gated chunked
backward on Hopper with Triton >= 3.4.0 and < 3.7.1 (wrong results), which would stop training at
the first backward; there we send the chunked rule back to transformers' torch path at load time.
Found by behaviour: the model's modules' globals that transformers wrapped with an fla fallback.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator

from torch import nn

FLA = "flash-linear-attention"


def fla_refusal() -> str | None:
    """Why fla's gated chunked backward cannot run on this GPU, read from fla's own flags; None when
    it can (or fla is not installed)."""
    try:
        import fla.utils as flags
    except Exception:  # not installed, or it fails to import on this machine: transformers falls back too
        return None
    broken = (getattr(flags, "IS_NVIDIA_HOPPER", False) and getattr(flags, "TRITON_ABOVE_3_4_0", False)
              and not getattr(flags, "TRITON_ABOVE_3_7_1", True))
    if not broken:
        return None
    import triton

    return (f"{FLA}'s gated backward is wrong on Hopper with Triton {triton.__version__}; "
            "a torch whose Triton is >= 3.7.1 (or `pip install tilelang`) gives the fast kernel")


def _fla_wrappers(model: nn.Module) -> Iterator[tuple[object, str, dict]]:
    """(module, global name, the wrapper's closure) for each chunked gated-delta-rule function that
    transformers wrapped with an fla fallback, in the Python modules that define the model's layers."""
    seen = set()
    for layer in model.modules():
        module = sys.modules.get(type(layer).__module__)
        if module is None or module in seen:
            continue
        seen.add(module)
        for name, value in list(vars(module).items()):
            closure = _fallback_of(value) if callable(value) and "chunk_gated_delta_rule" in name else None
            if closure is not None:
                yield module, name, closure


def _fallback_of(function: Callable) -> dict | None:
    """The wrapper's closure (`package`, `implementation`, `torch_function`) when `function` is
    transformers' package-or-torch fallback for fla; None otherwise."""
    while function is not None:
        try:
            closure = inspect.getclosurevars(function).nonlocals
        except TypeError:  # a builtin or a callable object
            return None
        if closure.get("package") == "fla" and "implementation" in closure and "torch_function" in closure:
            return closure
        function = getattr(function, "__wrapped__", None)
    return None


def route_delta_rule(model: nn.Module) -> tuple[str, bool] | None:
    """(what runs the gated delta rule, whether it is the fast kernel); None for a model without one.
    Where fla refuses its backward on this GPU, the chunked rule goes to transformers' torch path."""
    wrappers = list(_fla_wrappers(model))
    if not wrappers:
        return None
    on_fla = [(module, name, closure) for module, name, closure in wrappers
              if closure["implementation"] is not closure["torch_function"]]
    if not on_fla:
        return f"transformers' torch path ({FLA} not installed)", False
    refusal = fla_refusal()
    if refusal is None:
        return FLA, True
    for module, name, closure in on_fla:
        setattr(module, name, _torch_path(closure["torch_function"], refusal))
    return f"transformers' torch path ({refusal})", False


def _torch_path(torch_function: Callable, refusal: str) -> Callable:
    """transformers' torch rule, refusing packed sequences as transformers' own fallback does (the
    reference would run them as one sequence)."""

    @functools.wraps(torch_function)
    def chunk_gated_delta_rule(*args, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None:
            raise ValueError(f"packed sequences in a Gated DeltaNet layer need {FLA}'s kernel, which is off "
                             f"here: {refusal}. Train without packing / padding-free batches, or fix that.")
        return torch_function(*args, **kwargs)

    return chunk_gated_delta_rule
