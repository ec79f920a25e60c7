"""Windowed vision attention: one SDPA call per run of equal windows instead of one per window.

The vision towers of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and their kin attend within windows of packed
patches (`cu_seqlens`: each image, or each 112-pixel window of one). Without flash-attention,
transformers splits q, k and v into one piece per window (reading the lengths back from the GPU in
every layer) and runs one attention call per piece: two 448-pixel images make 32 windows, so about
450 attention calls a training step through 8 vision blocks, each with its autograd nodes. The step
is paced by the host, not the GPU. Windows of the same length are one batch: q of [rows, heads, dim]
viewed as [windows, length, heads, dim], one call, the same numbers.

The module keeps its projections (LoRA wrappers on them still apply) and its modeling file's own
rotary function. The forward is adopted for a module only if it reproduces the module's own output
on a probe with uneven windows; a call it does not cover (no position embeddings, dropout, tracing)
goes to the module's original forward. UNSLOTH_VISION_ATTENTION=0 keeps transformers' (to compare).
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from unsloth.models.kernels import compiling
from unsloth.models.patches.probe import same

# The lengths of the last few cu_seqlens tensors seen: a vision forward passes the same two (whole
# images, windows) to every block, and checkpointing passes them again, so one read per tensor.
_LENGTHS: dict[int, tuple[weakref.ref, int, list[int]]] = {}
_MAX_CACHED = 8


def window_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """The windows' lengths, read from the device once per tensor (and again if it is changed in place)."""
    key = id(cu_seqlens)
    hit = _LENGTHS.get(key)
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if len(_LENGTHS) >= _MAX_CACHED:
        _LENGTHS.pop(next(iter(_LENGTHS)))
    _LENGTHS[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, lengths)
    return lengths


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                       scale: float) -> torch.Tensor:  # fmt: skip
    """Attention of [rows, heads, dim] q, k, v within consecutive windows of `lengths` rows (no mask,
    not causal); each run of equal windows is one SDPA batch. Returns [rows, heads, dim]."""
    heads = q.shape[1]
    outputs, start = [], 0
    for length, run in itertools.groupby(lengths):
        count = len(list(run))
        rows = slice(start, start + count * length)
        q_w, k_w, v_w = (t[rows].reshape(count, length, heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_w, k_w, v_w, scale=scale)  # [count, heads, length, dim]
        outputs.append(out.transpose(1, 2).reshape(count * length, heads, v.shape[-1]))
        start += count * length
    if start != q.shape[0]:
        raise ValueError(f"windows cover {start} rows, the input has {q.shape[0]}")
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _windowed_forward(self, hidden_states, cu_seqlens, rotary_pos_emb=None, position_embeddings=None, **kwargs):
    dropout = getattr(self, "attention_dropout", 0.0) if self.training else 0.0
    if position_embeddings is None or dropout or compiling() or hidden_states.dim() != 2:
        return self._unsloth_original_forward(hidden_states, cu_seqlens, rotary_pos_emb=rotary_pos_emb,
                                              position_embeddings=position_embeddings, **kwargs)  # fmt: skip
    rows = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(rows, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = self._unsloth_rotate(q, k, cos, sin)
    scale = getattr(self, "scaling", None) or q.shape[-1] ** -0.5
    out = windowed_attention(q, k, v, window_lengths(cu_seqlens), scale)
    return self.proj(out.reshape(rows, -1))


def _rotary_if_windowed(module: nn.Module):
    """The rotary function of the module's modeling file, when the module looks like a windowed
    vision attention (qkv and proj Linears, num_heads, a forward taking cu_seqlens); else None."""
    if not (isinstance(getattr(module, "qkv", None), nn.Linear) and isinstance(getattr(module, "proj", None), nn.Linear)
            and isinstance(getattr(module, "num_heads", None), int)):  # fmt: skip
        return None
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return None
    if "cu_seqlens" not in params or "position_embeddings" not in params:
        return None
    return getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb_vision", None)


def _probe(module: nn.Module, device, dtype):
    """Hidden states, uneven windows (two runs of equal ones and a lone short one) and rotary tables."""
    dim = module.qkv.in_features
    head_dim = module.qkv.out_features // 3 // module.num_heads
    lengths = [6, 6, 6, 3, 6, 6]
    rows = sum(lengths)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], device=device, dtype=torch.int32)
    angles = torch.rand(rows, head_dim // 2, device=device) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    x = torch.randn(rows, dim, device=device, dtype=dtype)
    return x, cu_seqlens, (emb.cos().to(dtype), emb.sin().to(dtype))


def patch_vision_attention(model: nn.Module, device, dtype) -> int:
    """Give every windowed vision attention the batched-window forward (checked on a probe)."""
    if os.environ.get("UNSLOTH_VISION_ATTENTION", "1") == "0":
        return 0
    patched, adopted = 0, {}
    for module in model.modules():
        if hasattr(module, "_unsloth_original_forward"):
            continue
        rotate = _rotary_if_windowed(module)
        if rotate is None:
            continue
        module._unsloth_rotate = rotate
        module._unsloth_original_forward = module.forward
        ok = adopted.get(type(module))
        if ok is None:  # one probe per class (a tower repeats one attention class)
            x, cu_seqlens, position_embeddings = _probe(module, device, dtype)
            with torch.no_grad():
                try:
                    expected = module(x, cu_seqlens, position_embeddings=position_embeddings)
                    actual = _windowed_forward(module, x, cu_seqlens, position_embeddings=position_embeddings)
                    ok = same(actual, expected)
                except Exception:  # a signature or shape this forward does not cover: stays stock
                    ok = False
            adopted[type(module)] = ok
        if ok:
            module.forward = types.MethodType(_windowed_forward, module)
            patched += 1
        else:
            del module._unsloth_rotate, module._unsloth_original_forward
    return patched
