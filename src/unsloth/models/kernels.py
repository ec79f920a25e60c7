"""Whether our Triton kernels can run for a device: the one place that decides.

Kernels run on a GPU (CUDA or ROCm), or on the CPU under Triton's interpreter (TRITON_INTERPRET=1,
slow but exact: that is how CI tests them). Anywhere else the patches step aside and the model
trains through the plain transformers + peft path, which we say once. UNSLOTH_KERNELS=0 turns
them off on purpose (to rule them out when something looks wrong).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

log = logging.getLogger("unsloth")


@functools.lru_cache(maxsize=None)
def _unavailable_reason(device_type: str) -> str | None:
    """None when kernels run on this kind of device, else why not (in words a user can act on)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if importlib.util.find_spec("unsloth_kernels") is None:
        return "the unsloth_kernels package is missing"
    if device_type == "cuda":
        return None
    if device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            return None
        return "the model is on the CPU (set TRITON_INTERPRET=1 to run the kernels in Triton's slow interpreter)"
    return f"there are no Triton kernels for {device_type!r} devices"


_said: set[str] = set()


def unavailable_reason(device: torch.device | str) -> str | None:
    """None when the Triton kernels can run on `device`, else why not."""
    if os.environ.get("UNSLOTH_KERNELS", "1") == "0":
        return "turned off by UNSLOTH_KERNELS=0"
    return _unavailable_reason(torch.device(device).type)


def kernels_available(device: torch.device | str) -> bool:
    """True when the Triton kernels can run on `device`; says once per reason when they cannot."""
    reason = unavailable_reason(device)
    if reason is not None and reason not in _said:
        _said.add(reason)
        log.warning("unsloth: kernels off, training through plain transformers + peft: %s.", reason)
    return reason is None


def compiling() -> bool:
    """True while torch.compile traces: our patched forwards then take their plain torch form.

    The compiled decode step (generation.py) is captured in CUDA graphs; Inductor fuses the plain
    math itself, while each of our Triton launches, with its Python-side setup, would break the
    graph in two and leave every decode step paying eager host time between the pieces.
    """
    return torch.compiler.is_compiling()
