"""UnslothTrainer / UnslothTrainingArguments: SFT with its own learning rate for embeddings (continued
pretraining notebooks train embed_tokens and lm_head through `modules_to_save`), `unsloth_train`, and
the `PatchDPOTrainer()` / `PatchKTOTrainer()` calls of the preference notebooks."""

from __future__ import annotations

from unsloth.training import trl_compat
from unsloth.training.vision import UnslothVisionDataCollator  # noqa: F401  (from unsloth.trainer import ...)

_compat = trl_compat.install()
_SFTConfig, _SFTTrainer = _compat["SFTConfig"], _compat["SFTTrainer"]


class UnslothTrainingArguments(_SFTConfig):
    """SFTConfig plus `embedding_learning_rate`."""

    def __init__(self, *args, embedding_learning_rate: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.embedding_learning_rate = embedding_learning_rate


class UnslothTrainer(_SFTTrainer):
    """SFTTrainer whose optimizer gives embedding weights `args.embedding_learning_rate`."""

    def create_optimizer(self, *args, **kwargs):
        rate = getattr(self.args, "embedding_learning_rate", None)
        if rate is None or self.optimizer is not None:
            return super().create_optimizer(*args, **kwargs)
        from transformers import Trainer

        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
        embedding, other = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (embedding if ("embed_tokens" in name or "lm_head" in name) else other).append(p)
        groups = [{"params": other, "weight_decay": self.args.weight_decay}]
        if embedding:
            groups.append({"params": embedding, "weight_decay": 0.0, "lr": rate})
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer


def unsloth_train(trainer, *args, **kwargs):
    """`trainer.train()`: gradient accumulation is already exact in current transformers."""
    return trainer.train(*args, **kwargs)


def PatchDPOTrainer() -> None:  # noqa: N802 - the name notebooks call
    """Nothing left to do: TRL's DPO, ORPO, KTO and CPO trainers already run on our fused log-probabilities
    (``unsloth.training.preference``) once the notebook facade is imported. Kept so notebooks run unchanged."""
    trl_compat.install()


PatchKTOTrainer = PatchDPOTrainer
