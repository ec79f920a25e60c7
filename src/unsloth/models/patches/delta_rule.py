"""Gated DeltaNet layers (Qwen3.5, Qwen3-Next): which implementation of the gated delta rule runs.

transformers picks flash-linear-attention's kernel at import when fla is installed, else its own
torch reference (correct, much slower). fla itself refuses its gated chunked backward on Hopper
with Triton >= 3.4.0 and < 3.7.1 (wrong results), which would stop training at the first backward.
Wherever the chunked rule would run transformers' torch path (fla absent, or refused here), we put
our own torch rule in its place at load (unsloth_kernels.delta_rule: the same numbers, faster; it
needs no Triton, but lives in the kernels package: without that package, transformers' path stays).
Found by behaviour: the model's modules' globals that transformers wrapped with an fla fallback.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn

FLA = "flash-linear-attention"
OURS = "unsloth's torch chunked rule"
TRANSFORMERS = "transformers' torch path"


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


def _rule_globals(model: nn.Module) -> Iterator[tuple[object, str, Callable]]:
    """(module, global name, function) for each chunked gated-delta-rule function in the Python
    modules that define the model's layers."""
    seen = set()
    for layer in model.modules():
        module = sys.modules.get(type(layer).__module__)
        if module is None or module in seen:
            continue
        seen.add(module)
        for name, value in list(vars(module).items()):
            if callable(value) and "chunk_gated_delta_rule" in name:
                yield module, name, value


def hub_callee(function):
    """What transformers' hub-kernels wrapper calls, where the `kernels` package is installed
    (transformers >= 5.25 requires it): the module global is then its `Func` module, whose forward
    calls the decorated function. Anything else is returned as it is."""
    if not isinstance(function, nn.Module):
        return function
    try:
        return inspect.getclosurevars(type(function).forward).nonlocals.get("func")
    except TypeError:
        return None


def _fallback_of(function: Callable) -> dict | None:
    """The wrapper's closure (`package`, `implementation`, `torch_function`) when `function` is
    transformers' package-or-torch fallback for fla; None otherwise."""
    function = hub_callee(function)
    while function is not None:
        try:
            closure = inspect.getclosurevars(function).nonlocals
        except TypeError:  # a builtin or a callable object
            return None
        if closure.get("package") == "fla" and "implementation" in closure and "torch_function" in closure:
            return closure
        function = getattr(function, "__wrapped__", None)
    return None


def _our_rule() -> Callable | None:
    try:
        from unsloth_kernels.delta_rule import chunk_gated_delta_rule
    except ImportError:  # no kernels package, or no Triton for its other kernels
        return None
    return chunk_gated_delta_rule


def route_delta_rule(model: nn.Module) -> tuple[str, bool] | None:
    """(what runs the gated delta rule, whether it is fla's kernel); None for a model without one.
    Where transformers would run its torch path, our torch rule goes in instead. A rule we put in
    on an earlier load says its route again."""
    routes = []
    for module, name, function in _rule_globals(model):
        if hasattr(function, "unsloth_route"):
            routes.append(function.unsloth_route)
            continue
        closure = _fallback_of(function)
        if closure is None:
            continue
        on_fla = closure["implementation"] is not closure["torch_function"]
        refusal = fla_refusal() if on_fla else f"{FLA} not installed"
        if refusal is None:
            routes.append((FLA, True))
            continue
        rule = _our_rule()
        if rule is None and not on_fla:
            routes.append((f"{TRANSFORMERS} ({refusal})", False))  # what runs already
            continue
        route = (f"{OURS if rule else TRANSFORMERS} ({refusal})", False)
        setattr(module, name, _replacement(rule or closure["torch_function"], function, refusal, route))
        routes.append(route)
    return routes[0] if routes else None


def _replacement(rule: Callable, replaced: Callable, refusal: str, route: tuple[str, bool]) -> Callable:
    """`rule` in place of transformers' wrapper `replaced`: packed sequences refused as transformers'
    own fallback does (a torch rule would run them as one sequence); torch.export keeps transformers'
    path (its export-friendly form); tagged with its route, so that a later load recognises it."""

    @functools.wraps(replaced)  # __wrapped__: what it replaced, whose own __wrapped__ is the reference
    def chunk_gated_delta_rule(*args, **kwargs):
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"packed sequences in a Gated DeltaNet layer need {FLA}'s kernel, which is off "
                             f"here: {refusal}. Train without packing / padding-free batches, or fix that.")
        if torch.compiler.is_exporting():
            return replaced(*args, **kwargs)
        return rule(*args, **kwargs)  # it ignores the other keywords transformers' layers pass along

    chunk_gated_delta_rule.unsloth_route = route
    return chunk_gated_delta_rule
