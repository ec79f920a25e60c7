"""Loss: with labels, the causal LM's forward runs the backbone and our fused linear cross-entropy.

The fused loss never builds the (tokens x vocab) logits, so a training forward returns the loss
and no logits. Without labels, or without gradients (evaluation, generation), the model's own
forward runs unchanged. Adopted only if it gives the model's own loss on a probe batch.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from unsloth.models.patches.probe import same

IGNORE_INDEX = -100


def logit_transform(config) -> tuple[float | None, float]:
    """(softcap, scale) applied to the logits before the softmax, read the way the configs spell them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)  # Cohere multiplies
    if scale is None and getattr(text, "logits_scaling", None):  # Granite divides
        scale = 1.0 / text.logits_scaling
    return softcap, 1.0 if scale is None else float(scale)


def fused_causal_lm_loss(model, hidden: torch.Tensor, labels=None, shift_labels=None, num_items_in_batch=None):
    """Next-token cross-entropy of `hidden` through the model's LM head, like transformers' ForCausalLMLoss."""
    from unsloth_kernels.cross_entropy import fused_linear_cross_entropy

    if shift_labels is None:
        hidden, shift_labels = hidden[:, :-1], labels[:, 1:]
    head = model.get_output_embeddings()
    softcap, scale = logit_transform(model.config)
    hidden = hidden.to(head.weight.device).reshape(-1, hidden.shape[-1])
    return fused_linear_cross_entropy(
        hidden,
        head.weight,
        shift_labels.to(head.weight.device).reshape(-1),
        bias=getattr(head, "bias", None),
        ignore_index=IGNORE_INDEX,
        softcap=softcap,
        logit_scale=scale,
        total_tokens=num_items_in_batch,  # gradient accumulation: divide by the tokens of all micro-batches
    )


def _fused_forward(original, signature_of):
    """`original` is the bound forward to fall back to; `signature_of` keeps the signature `generate` checks."""

    @functools.wraps(signature_of)
    def forward(self, *args, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if (labels is None and shift_labels is None) or not torch.is_grad_enabled():
            for name, value in (("labels", labels), ("shift_labels", shift_labels),
                                ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return original(*args, **kwargs)
        kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False
        outputs = self.base_model(*args, **kwargs)
        loss = fused_causal_lm_loss(self, outputs.last_hidden_state, labels, shift_labels, num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    return forward


def _probe_loss(model, device) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 9), generator=generator).to(device)
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX  # prompt tokens, as SFT masks them
    was_training = model.training
    model.eval()  # no dropout in either pass
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, labels=labels).loss
        with torch.enable_grad():
            actual = model(input_ids=ids, labels=labels).loss.detach()
    finally:
        model.train(was_training)
    return actual, expected


def patch_loss(model: nn.Module, device) -> bool:
    """Give the causal LM the fused loss if its own loss is reproduced on a probe batch."""
    if getattr(model, "_unsloth_fused_loss", False):
        return True
    if model.get_output_embeddings() is None or not hasattr(model, "base_model"):
        return False
    previous = model.__dict__.get("forward")  # e.g. an accelerate hook's wrapper
    model.forward = types.MethodType(_fused_forward(model.forward, type(model).forward), model)
    try:
        actual, expected = _probe_loss(model, device)
        ok = same(actual.float(), expected.float())
    except Exception:
        ok = False
    if not ok:
        if previous is None:
            del model.forward  # back to the class's own forward
        else:
            model.forward = previous
        return False
    model._unsloth_fused_loss = True
    return True
