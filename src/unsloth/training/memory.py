"""What a training run does when it does not fit: the out-of-memory advice."""

from __future__ import annotations


def out_of_memory_advice(batch_size: int | None = None, max_seq_length: int | None = None,
                         load_in_4bit: bool | None = None) -> str:
    """What to change after a CUDA out-of-memory error, most effective first."""
    tips = []
    if batch_size and batch_size > 1:
        tips.append(f"a smaller batch: --set training.per_device_train_batch_size={max(1, batch_size // 2)} "
                    "(raise training.gradient_accumulation_steps to keep the effective batch)")
    if load_in_4bit is False:
        tips.append("4-bit base weights: --set model.load_in_4bit=true")
    if max_seq_length and max_seq_length > 512:
        tips.append(f"shorter sequences: --set model.max_seq_length={max_seq_length // 2}")
    tips.append('activation offloading: --set gradient_checkpointing="unsloth" (the default)')
    return "Out of GPU memory. Try, in this order:\n" + "\n".join(f"  - {t}" for t in tips)
