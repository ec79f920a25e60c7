"""The out-of-memory advice names the fixes that apply to the run."""

from __future__ import annotations

from unsloth.training.memory import out_of_memory_advice


def test_out_of_memory_advice_names_the_fixes():
    advice = out_of_memory_advice(batch_size=8, max_seq_length=4096, load_in_4bit=False)
    assert "per_device_train_batch_size=4" in advice
    assert "load_in_4bit=true" in advice
    assert "max_seq_length=2048" in advice
    assert "offload" in advice
    minimal = out_of_memory_advice(batch_size=1, max_seq_length=256, load_in_4bit=True)
    assert "smaller batch" not in minimal and "4-bit" not in minimal and "offload" in minimal
