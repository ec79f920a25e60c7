"""TRL's trainers on an FSDP2-sharded model (`distributed = "fsdp"` in a job of several processes).

The model is sharded by us (models/distributed.py: one group per decoder layer, 4-bit bases
included), after the trainer is built and before it prepares anything. The Trainer is then told the
model owns its sharding (transformers' own switch for models sharded at load time), so accelerate
wraps it in nothing. What that switch leaves out, we add:

    checkpoints  checkpoint-N/sharded: every rank writes its shards of the trained weights and their
                 optimizer states (torch.distributed.checkpoint), next to the Trainer's scheduler,
                 RNG and trainer_state files; resume reads them back into the sharded model
    saves        `save_model` gathers the weights once, into rank 0, which writes them
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from unsloth.models.distributed import full_state_dict, load_sharded, save_sharded, shard_model

SHARDS = "sharded"  # a checkpoint's folder of shards (its .metadata file is written last)
_SCHEDULER = "scheduler.pt"  # the Trainer's name for it


def _optimizer(trainer):
    # accelerate wraps the optimizer; the state-dict helpers want the torch one.
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


class ShardedTraining:
    """Mixed in before a Trainer class (SFTTrainer, ...): trains, checkpoints and saves sharded."""

    def __init__(self, *args, mixed_precision: torch.dtype | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        shard_model(self.model, mixed_precision=mixed_precision)
        self.model_wrapped = self.model
        self.is_distributed_loading_by_transformers = True  # no DDP around it, no second sharding

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """Gradient accumulation: the gradients are reduced over the ranks once, after the last micro-batch."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The whole weights (a PEFT model: its adapters), gathered into rank 0, which writes them as
        the Trainer does; every rank calls it. A checkpoint keeps its weights in its shards instead
        (_save_optimizer_and_scheduler), unless it keeps the model only (`save_only_model`)."""
        if _internal_call and not self.args.save_only_model:
            return
        state = full_state_dict(self.model, trainable_only=hasattr(self.model, "peft_config"))
        if self.args.should_save:
            self._save(output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_sharded(self.model, _optimizer(self), Path(output_dir) / SHARDS)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Nothing before the optimizer exists: the shards load with its states (_load_optimizer_and_scheduler)."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_sharded(self.model, _optimizer(self), Path(checkpoint) / SHARDS)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True))


def sharded_trainer_class(trainer_class: type) -> type:
    """`trainer_class` training an FSDP2-sharded model (its own name kept for messages and logs)."""
    return type(trainer_class.__name__, (ShardedTraining, trainer_class), {})
