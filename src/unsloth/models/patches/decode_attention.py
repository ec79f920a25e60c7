"""Decoding attention without `repeat_kv`: one query token attends on the key/value heads themselves.

With grouped-query attention (Llama-3.1-8B: 32 query heads on 8 key/value heads) and a mask (a static
cache always has one: its unfilled slots), transformers' SDPA path copies every key and value head once
per query head it serves (`repeat_kv`) before calling SDPA, in every layer of every decode step: at
batch 8 that copy was as long as the attention itself in an H100's 4-bit decode step (1.4 ms of 14).
Newer transformers avoid it for one query token, but not while torch.compile traces, which is how our
decode step runs. For one query token the G query heads of a group are G query rows against the same
key/value head: q [batch, heads, 1, dim] is viewed as [batch, kv heads, G, dim], the mask (one row,
the same for every head) broadcasts over them, and SDPA reads each key/value head once.

`patch_decode_attention` wraps transformers' registered "sdpa" function with this for exactly that
case (one query token, groups, a mask shared by the heads, nothing else asked) and hands every other
call to it unchanged; it installs only if the wrapper gives transformers' own output on a probe.
UNSLOTH_DECODE_ATTENTION=0 leaves transformers' function alone (to compare).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger("unsloth")

_EXTRAS = ("position_bias", "softcap", "output_attentions", "s_aux")  # anything here goes to transformers


def grouped_decode_attention(query, key, value, attention_mask, dropout: float = 0.0, scaling=None):
    """SDPA of one query token per row, [batch, heads, 1, dim], on [batch, kv heads, length, dim] keys
    and values without repeating them; returns [batch, 1, heads, dim] as transformers' attention does."""
    batch, heads, _, dim = query.shape
    groups = heads // key.shape[1]
    packed = query.reshape(batch, key.shape[1], groups, dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling)  # fmt: skip
    return out.reshape(out.shape[0], heads, 1, value.shape[-1]).transpose(1, 2).contiguous()


def _takes(module, query, key, attention_mask, kwargs) -> bool:
    groups = getattr(module, "num_key_value_groups", 1)
    return (query.shape[2] == 1 and isinstance(groups, int) and groups > 1
            and query.shape[1] == key.shape[1] * groups
            and attention_mask is not None and attention_mask.dim() == 4
            and attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1
            and all(kwargs.get(name) is None or kwargs.get(name) is False for name in _EXTRAS))  # fmt: skip


def _wrap(original):
    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                               **kwargs):  # fmt: skip
        if not _takes(module, query, key, attention_mask, kwargs):
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)  # fmt: skip
        return grouped_decode_attention(query, key, value, attention_mask, dropout, scaling), None

    sdpa_attention_forward._unsloth_original = original
    return sdpa_attention_forward


def _agrees(original, wrapped) -> bool:
    """Both on a probe: batch 2, 2 key/value heads of 2 query heads each, 5 slots of which some masked."""
    generator = torch.Generator().manual_seed(0)
    shapes = ((2, 4, 1, 8), (2, 2, 5, 8), (2, 2, 5, 8))
    query, key, value = (torch.randn(shape, generator=generator) for shape in shapes)
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, True, False]]).view(2, 1, 1, 5)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    try:
        expected, _ = original(module, query, key, value, mask, dropout=0.0, scaling=0.5)
        got, _ = wrapped(module, query, key, value, mask, dropout=0.0, scaling=0.5)
    except Exception as error:  # a changed signature: transformers' function stays
        log.debug("unsloth: decode attention probe failed (%s: %s)", type(error).__name__, error)
        return False
    return got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def patch_decode_attention() -> bool:
    """Install the grouped decode attention under transformers' "sdpa" name (idempotent). Returns
    whether it is installed."""
    if os.environ.get("UNSLOTH_DECODE_ATTENTION", "1") == "0":
        return False
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return False
    original = AttentionInterface._global_mapping.get("sdpa")
    if original is None:
        return False
    if getattr(original, "_unsloth_original", None) is not None:
        return True
    wrapped = _wrap(original)
    if not _agrees(original, wrapped):
        log.debug("unsloth: transformers' sdpa attention changed; decoding keeps its own")
        return False
    AttentionInterface.register("sdpa", wrapped)
    return True
