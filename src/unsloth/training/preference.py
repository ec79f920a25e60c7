"""Preference training on our models: TRL's DPO, KTO, ORPO and CPO (SimPO) trainers, with the
per-token log-probabilities from our chunked fused LM head (`unsloth_kernels.log_probs`).

What TRL 1.16 does and what we change:
- DPOTrainer and KTOTrainer call ``model(..., labels=..., fused_lm_head=True)`` and read per-token
  ``log_probs`` (plus entropy, mean logit, top-1 for their metrics) from a head TRL patches in.
  We answer that call with our kernel instead (`patch_log_probs`), once it has given the model's
  own full-logit log-probabilities on a probe batch; otherwise TRL's head stays.
- ORPOTrainer and CPOTrainer take the full (batch, length, vocab) logits from the model and
  gather them. Their ``concatenated_forward`` is answered from the same fused head: the same
  log-probabilities, NLL and sums, never the logits. (Their ``logits/chosen`` metric becomes the
  mean logit over the completion tokens rather than over every padded position.)
- The reference model is the policy with its adapters disabled (TRL's ``ref_model=None`` with a
  PEFT model): no second copy of the weights. Our LoRA fast path steps aside under
  ``disable_adapter()`` (patches/lora.py), so the reference is exactly the frozen base.

The trainers stay TRL's: `trainer_methods` gives the methods the compatible subclasses in
`trl_compat` add.
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from unsloth.models.kernels import unavailable_reason
from unsloth.models.patches.loss import IGNORE_INDEX, logit_transform
from unsloth.models.patches.probe import same

log = logging.getLogger("unsloth")

# `unsloth train` method -> (TRL trainer, its config, the dataset columns it needs).
METHODS = {
    "dpo": ("DPOTrainer", "DPOConfig", ("prompt", "chosen", "rejected")),
    "orpo": ("ORPOTrainer", "ORPOConfig", ("prompt", "chosen", "rejected")),
    "kto": ("KTOTrainer", "KTOConfig", ("prompt", "completion", "label")),
    "simpo": ("CPOTrainer", "CPOConfig", ("prompt", "chosen", "rejected")),
}
TRAINERS = frozenset(trainer for trainer, _, _ in METHODS.values())
# Our defaults per method, under the config's [training] (the notebooks' values: DPO's learning rate
# is far below SFT's, as the reference keeps the policy close).
DEFAULTS = {
    "dpo": {"learning_rate": 5e-6, "beta": 0.1},
    "orpo": {"learning_rate": 8e-6, "beta": 0.1},
    "kto": {"learning_rate": 5e-6, "beta": 0.1},
    "simpo": {"learning_rate": 1e-6, "loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0},
}


def _trl(name: str):
    from unsloth.training import trl_compat  # it imports this module: imported when first needed

    return trl_compat.install()[name]


def trainer_class(method: str):
    """TRL's trainer for `unsloth train` method `method` (the compatible subclass)."""
    return _trl(METHODS[method][0])


def config_class(method: str):
    return _trl(METHODS[method][1])


@dataclass
class TokenLogProbs(ModelOutput):
    """What ``model(..., labels=..., fused_lm_head=True)`` returns: TRL's field names, each (batch, length - 1)
    and zero where the label is ignored. Only `log_probs` (and `loss`) carry a gradient."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None  # not computed: trainers that need it keep TRL's head
    aux_loss: torch.Tensor | None = None


def token_log_probs(model, hidden: torch.Tensor, shift_labels: torch.Tensor, num_items_in_batch=None) -> TokenLogProbs:
    """log p(label) per position of `hidden` (batch, length, H) through the model's LM head, in chunks.

    Only the positions with a label are scored (prompts and padding are skipped, not computed and dropped).
    """
    from unsloth_kernels.log_probs import fused_linear_log_probs

    head = model.get_output_embeddings()
    softcap, scale = logit_transform(model.config)
    device = head.weight.device
    hidden, shift_labels = hidden.to(device), shift_labels.to(device)
    mask = shift_labels != IGNORE_INDEX
    values = fused_linear_log_probs(
        hidden[mask], head.weight, shift_labels[mask], bias=getattr(head, "bias", None), softcap=softcap,
        logit_scale=None if scale == 1.0 else scale, use_triton=unavailable_reason(device) is None,
    )
    # masked_scatter keeps a batch without any label connected to the graph (a zero, not a failed backward).
    logp, entropy, mean, top1 = (v.new_zeros(mask.shape).masked_scatter(mask, v) for v in values)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return TokenLogProbs(loss=-logp.sum() / count, log_probs=logp, entropy=entropy, mean_logits=mean,
                         is_top1=top1, label_mask=mask)


def _fused_head_forward(previous, signature_of):
    """A forward that answers ``fused_lm_head=True`` with `token_log_probs` and passes everything else on."""

    @functools.wraps(signature_of)  # the signature `generate` checks its keywords against
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            for name, value in (("labels", labels), ("shift_labels", shift_labels),
                                ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return previous(*args, **kwargs)
        kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, shift_labels = hidden[:, :-1], labels[:, 1:]
        return token_log_probs(self, hidden, shift_labels, num_items_in_batch)

    return forward


def _probe(model, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, the model's own full-logit log-probabilities) on a small batch with masked prompt tokens."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].float()
            shifted = labels[:, 1:]
            expected = logits.log_softmax(-1).gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            expected = expected * (shifted != IGNORE_INDEX)
        with torch.enable_grad():  # the training path (the gradient prepared in forward)
            actual = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs.detach()
    finally:
        model.train(was_training)
    return actual, expected


def patch_log_probs(model: nn.Module) -> bool:
    """Answer ``fused_lm_head=True`` calls of causal LM `model` with our kernel, if it reproduces the
    model's own log-probabilities on a probe batch. Put on after TRL's own head (it passes calls on)."""
    if getattr(model, "_unsloth_fused_log_probs", False):
        return True
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear or not hasattr(model, "base_model"):
        return False  # a tuned or wrapped head (modules_to_save, LoRA on lm_head): TRL's own path
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text, "output_router_logits", False):
        return False  # MoE load-balancing loss: TRL's head adds it
    previous = model.__dict__.get("forward")
    model.forward = types.MethodType(_fused_head_forward(model.forward, type(model).forward), model)
    try:
        actual, expected = _probe(model, head.weight.device)
        ok = same(actual, expected)
    except Exception as exc:  # noqa: BLE001 - any failure keeps TRL's path
        log.debug("unsloth: fused log-probs probe failed: %s", exc)
        ok = False
    if not ok:
        if previous is None:
            del model.forward
        else:
            model.forward = previous
        return False
    model._unsloth_fused_log_probs = True
    return True


def _causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def adopt(trainer) -> bool:
    """Give a preference trainer's policy (and a separate reference model) our fused log-probabilities."""
    if getattr(trainer, "is_encoder_decoder", False) or getattr(trainer, "aux_loss_enabled", False):
        return False
    if getattr(trainer, "use_weighting", False):
        return False  # WPO weights need log(sum p^2): TRL's head computes it
    ok = patch_log_probs(_causal_lm(trainer.model))
    if ok and getattr(trainer, "ref_model", None) is not None:
        patch_log_probs(_causal_lm(trainer.ref_model))
    trainer._unsloth_fused_log_probs = ok
    if ok:
        log.info("unsloth: %s: per-token log-probabilities through the fused LM head (no full logits)",
                 type(trainer).__name__)
    return ok


def _concatenated_forward(base_method, nll_over_prompt: bool):
    """ORPO's / CPO's concatenated_forward from the fused head: the same five results, no logits."""

    def concatenated_forward(self, model, batch):
        if not getattr(self, "_unsloth_fused_log_probs", False):
            return base_method(self, model, batch)
        padding = getattr(self, "padding_value", None)
        concatenated = self.concatenated_inputs(batch, is_encoder_decoder=False,
                                                padding_value=self.pad_token_id if padding is None else padding,
                                                device=self.accelerator.device)
        chosen = batch["chosen_labels"].shape[0]
        ids = concatenated["concatenated_input_ids"]
        attention = concatenated["concatenated_attention_mask"]
        labels = concatenated["concatenated_labels"]
        # ORPO's NLL covers prompt and completion; CPO's, like both log-probabilities, the completion only.
        scored = torch.where(attention == 1, ids, IGNORE_INDEX) if nll_over_prompt else labels
        out = model(ids, attention_mask=attention, use_cache=False, labels=scored, fused_lm_head=True)
        completion = (labels[:, 1:] != IGNORE_INDEX).to(out.log_probs.dtype)
        sums = (out.log_probs * completion).sum(-1)
        average = nll_over_prompt or getattr(self, "loss_type", None) in ("ipo", "simpo")
        logps = sums / completion.sum(-1) if average else sums
        if nll_over_prompt or getattr(self, "cpo_alpha", 1.0) != 0:
            chosen_mask = out.label_mask[:chosen]
            nll = -out.log_probs[:chosen].sum() / chosen_mask.sum().clamp(min=1)
        else:
            nll = torch.zeros((), device=self.accelerator.device)
        # Only their means are logged: the per-token mean logits stand in for the logits.
        mean_logits = out.mean_logits.detach()
        return (logps[:chosen], logps[chosen:], mean_logits[:chosen][out.label_mask[:chosen]],
                mean_logits[chosen:][out.label_mask[chosen:]], nll)

    return concatenated_forward


def trainer_methods(name: str, base) -> dict:
    """Methods the compatible subclass of TRL trainer `base` (called `name`) adds for preference training."""
    if name not in TRAINERS:
        return {}
    methods = {}
    if hasattr(base, "concatenated_forward"):  # ORPO, CPO: they read the full logits
        methods["concatenated_forward"] = _concatenated_forward(base.concatenated_forward,
                                                                nll_over_prompt=name == "ORPOTrainer")
    return methods
