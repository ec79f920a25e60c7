"""A notebook's LoRA SFT as a script, on 2 processes:

    accelerate launch --multi_gpu --num_processes 2 notebook_sft.py ddp|fsdp MODEL DATA OUT
    torchrun --nproc-per-node 2 notebook_sft.py ddp|fsdp MODEL DATA OUT

ddp: the notebook unchanged (TRL's SFTTrainer; the Trainer wraps the model in DDP, with its own
find_unused_parameters choice for a PEFT model). fsdp: the one change FSDP2 takes, the trainer class.
Rank 0 writes OUT/losses.json; the trainer saves the adapters to OUT/lora.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from unsloth import FastLanguageModel  # noqa: I001 - first, as in the notebooks

import torch
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer


def main(strategy: str, model_dir: str, data: str, out: str) -> None:
    model, tokenizer = FastLanguageModel.from_pretrained(model_dir, max_seq_length=32, dtype=torch.float32)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=16, use_gradient_checkpointing="unsloth",
                                             random_state=3407)
    trainer_class = SFTTrainer
    if strategy == "fsdp":
        from unsloth.training.sharded import sharded_trainer_class

        trainer_class = sharded_trainer_class(SFTTrainer)
    trainer = trainer_class(
        model=model, processing_class=tokenizer, train_dataset=load_dataset("json", data_files=data, split="train"),
        args=SFTConfig(output_dir=out, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                       learning_rate=1e-2, logging_steps=1, max_length=32, report_to="none", save_strategy="no",
                       seed=3407),
    )
    trainer.train()
    trainer.save_model(str(Path(out) / "lora"))
    if trainer.args.process_index == 0:
        losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
        (Path(out) / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main(*sys.argv[1:])
