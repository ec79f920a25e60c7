"""RoPE: route the modeling module's own `apply_rotary_pos_emb` to our kernel inside patched attentions.

Attention forwards call the module-level function `apply_rotary_pos_emb` of their modeling file.
We put a dispatcher in its place that runs our kernel only while a patched attention module is
running (forward hooks count them in and out, also when gradient checkpointing replays the layer)
and the call has the plain HF shape; every other caller gets the original function untouched.
The kernel is adopted for a modeling module only if it matches the original on a probe.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch
from torch import nn

from unsloth.models.kernels import compiling
from unsloth.models.patches.probe import same

_inside = threading.local()  # how many patched attention forwards are running on this thread


def _enter(module, args):
    if not compiling():  # a traced step takes transformers' own rope: nothing to count
        _inside.depth = getattr(_inside, "depth", 0) + 1


def _leave(module, args, output):
    if not compiling():
        _inside.depth -= 1


def _fast_rope(q, k, cos, sin):
    from unsloth_kernels.rope import apply_rope

    from unsloth.models.checkpointing import keeping_for_recompute

    # Not in place while a checkpoint keeps the projections' outputs: q and k are views of them.
    return apply_rope(q, k, cos, sin, inplace=not keeping_for_recompute())


def _plain_call(q, cos, args, kwargs, partial: bool) -> bool:
    """The HF call our kernel reproduces: (q, k, cos, sin), cos/sin broadcast over heads, the full
    rotary dim, or (`partial`: the original was checked on one) the first cos.shape[-1] dims of each head."""
    rot = cos.shape[-1]
    return (
        not args
        and set(kwargs) <= {"unsqueeze_dim"}
        and kwargs.get("unsqueeze_dim", 1) == 1
        and q.dim() == 4
        and (rot == q.shape[-1] or (partial and rot < q.shape[-1] and rot % 2 == 0))
    )


def _dispatcher(original, partial: bool):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not compiling() and getattr(_inside, "depth", 0) > 0 and _plain_call(q, cos, args, kwargs, partial):
            return _fast_rope(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__unsloth_original__ = original
    return apply_rotary_pos_emb


def _matches(original, head_dim: int, device, dtype, rot: int | None = None) -> bool:
    """Whether our kernel gives the original's output on a probe rotating the first `rot` dims of each
    head (all of them by default; Phi-4-mini rotates 3/4, and a Llama-style function none but all)."""
    seq, rot = 7, rot or head_dim
    positions = torch.arange(seq, device=device, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=device, dtype=torch.float32) / rot))
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = torch.randn(2, 4, seq, head_dim, device=device, dtype=dtype)
    k = torch.randn(2, 2, seq, head_dim, device=device, dtype=dtype)
    with torch.no_grad():
        try:  # a function of another signature (Gemma 4 rotates q and k in separate calls), or a
            # kernel that cannot take this shape, is a mismatch, not a crash
            expected = original(q.clone(), k.clone(), cos, sin)
            actual = _fast_rope(q.clone(), k.clone(), cos, sin)
        except Exception:
            return False
    return same(tuple(actual), tuple(expected))


def _head_dim(attention: nn.Module) -> int | None:
    head_dim = getattr(attention, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    config = getattr(attention, "config", None)
    if config is not None and getattr(config, "num_attention_heads", None):
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return None


def patch_rope(model: nn.Module, device, dtype) -> int:
    """Route RoPE of every attention module whose modeling file we can check; returns how many."""
    patched = 0
    verdicts: dict[str, bool] = {}  # modeling module -> full rotary matches (then: partial too?)
    for module in model.modules():
        if getattr(module, "_unsloth_rope", False) or not type(module).__name__.endswith("Attention"):
            continue
        modeling = sys.modules.get(type(module).__module__)
        original = getattr(modeling, "apply_rotary_pos_emb", None)
        head_dim = _head_dim(module)
        if original is None or head_dim is None:
            continue
        original = getattr(original, "__unsloth_original__", original)
        name = modeling.__name__
        if name not in verdicts:
            verdicts[name] = _matches(original, head_dim, device, dtype)
            if verdicts[name]:
                partial = head_dim >= 4 and _matches(original, head_dim, device, dtype, rot=2 * (head_dim // 4))
                modeling.apply_rotary_pos_emb = _dispatcher(original, partial)
        if not verdicts[name]:
            continue
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)
        module._unsloth_rope = True
        patched += 1
    return patched
