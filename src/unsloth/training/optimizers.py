"""The optimizer a run asks for (`optim = "adamw_8bit"`, as notebooks write it), checked to run here.

bitsandbytes' 8-bit and paged optimizers are the transformers Trainer's own (`optim` names); we only
check, by running one step on a small tensor, that this machine's bitsandbytes can step them on the
training device. Where it cannot (no bitsandbytes, or a build without that device's kernels), the
run falls back to PyTorch's AdamW with one warning that says what it costs, instead of failing at
the first optimizer step after minutes of loading.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("unsloth")

FALLBACK = "adamw_torch"
_warned: set[tuple[str, str]] = set()  # said once per run, though configs are checked before and after loading


def is_bitsandbytes_optimizer(optim) -> bool:
    """True for the Trainer's optimizer names that bitsandbytes implements (8-bit, paged, bnb)."""
    name = str(getattr(optim, "value", optim) or "").lower()
    return "8bit" in name or "bnb" in name or name.startswith("paged_")


@functools.lru_cache(maxsize=None)
def bitsandbytes_optimizer_problem(device_type: str) -> str | None:
    """None when bitsandbytes' 8-bit AdamW steps a tensor on `device_type`, else why not."""
    try:
        import bitsandbytes as bnb
        import torch
    except ImportError:
        return "bitsandbytes is not installed (`pip install bitsandbytes`)"
    try:
        weight = torch.nn.Parameter(torch.ones(4096, device=device_type))  # the size bnb keeps in 8 bits
        weight.grad = torch.full_like(weight, 0.5)
        optimizer = bnb.optim.AdamW8bit([weight], lr=0.1)
        optimizer.step()
        if optimizer.state[weight]["state1"].dtype != torch.uint8 or not bool((weight < 1).all()):
            return f"bitsandbytes {bnb.__version__}'s 8-bit AdamW did not update a test tensor on {device_type}"
    except Exception as exc:  # noqa: BLE001 - a missing kernel surfaces as many kinds of error
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return f"bitsandbytes {getattr(bnb, '__version__', '?')} cannot step an 8-bit optimizer on {device_type} ({first})"
    return None


def training_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def usable_optimizer(optim, where: str, device_type: str | None = None):
    """`optim`, or FALLBACK with a warning when it is a bitsandbytes optimizer that cannot run here."""
    if optim is None or not is_bitsandbytes_optimizer(optim):
        return optim
    problem = bitsandbytes_optimizer_problem(device_type or training_device_type())
    if problem is None:
        return optim
    name = getattr(optim, "value", optim)
    if (name, problem) in _warned:
        return FALLBACK
    _warned.add((name, problem))
    log.warning("unsloth: %s: optim=%r cannot run here: %s; training with %r instead (its two states per "
                "weight then take 2 to 4 bytes each instead of 1)", where, name, problem, FALLBACK)
    return FALLBACK
