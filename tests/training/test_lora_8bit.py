"""8-bit LoRA (load_in_8bit=True, bitsandbytes LLM.int8): loads, trains through peft on the 8-bit
layers and our kernels everywhere else, and says clearly where bitsandbytes cannot run it."""

from __future__ import annotations

import pytest
import torch

from tiny_setup import write_dataset, write_tiny_model
from unsloth.errors import UnslothError
from unsloth.models import loader
from unsloth.training.config import from_dict
from unsloth.training.sft import train

bnb = pytest.importorskip("bitsandbytes")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INT8_PROBLEM = loader.int8_problem(DEVICE)
needs_int8 = pytest.mark.skipif(INT8_PROBLEM is not None, reason=f"8-bit layers cannot run here: {INT8_PROBLEM}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-8bit")
    return write_tiny_model(root / "model"), write_dataset(root / "data.jsonl")


def _config(tiny, output_dir, dtype="float32"):
    model, data = tiny
    return from_dict({
        "model": {"name": model, "max_seq_length": 32, "dtype": dtype, "load_in_8bit": True},
        "dataset": {"name": data},
        "lora": {"r": 8, "alpha": 16},
        "output_dir": str(output_dir),
        "gradient_checkpointing": "unsloth",
        "training": {"max_steps": 3, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                     "learning_rate": 1e-2, "logging_steps": 1, "save_strategy": "no", "seed": 0},
    })


@pytest.mark.slow
@needs_int8
def test_8bit_lora_trains_with_the_8bit_layers_on_peft(tiny, tmp_path, monkeypatch):
    config = _config(tiny, tmp_path, "bfloat16" if DEVICE == "cuda" else "float32")
    result = train(config, echo=lambda _: None)
    base = result.model.get_base_model()
    gate = base.model.layers[0].mlp.gate_proj
    assert type(gate.base_layer).__name__ == "Linear8bitLt" and gate.base_layer.weight.dtype == torch.int8
    report = base._unsloth_patches
    # the 14 LoRA layers keep peft's forward (peft calls bitsandbytes); norms, RoPE, gate and loss are ours
    assert report.lora_on_peft == 14 and report.lora == {"MLP": 0, "linear": 0}
    assert report.rms_norm and report.rope and report.mlp and report.loss and report.checkpointed == 2
    assert "14 LoRA layers on 8-bit weights through peft + bitsandbytes" in report.summary()
    assert len(result.losses) == 3 and result.losses[-1] < result.losses[0]
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()

    # The first step's loss is transformers + peft's on the same 8-bit model (our kernels off), with
    # the same seeded adapters and batches: our kernels change nothing but the speed.
    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    reference = train(_config(tiny, tmp_path / "reference", config.model.dtype), echo=lambda _: None)
    assert reference.model.get_base_model()._unsloth_patches.skipped
    assert result.losses[0] == pytest.approx(reference.losses[0], abs=2e-3)


def test_8bit_where_bitsandbytes_cannot_run_it_stops_before_loading(tiny, monkeypatch):
    monkeypatch.setattr(loader, "int8_problem", lambda device: f"bitsandbytes 0.0 cannot run 8-bit (LLM.int8) "
                                                                f"layers on {device} (no int8 kernel)")
    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(UnslothError) as caught:
        loader.load_pretrained(tiny[0], load_in_4bit=False, load_in_8bit=True)
    error = caught.value
    assert f"load_in_8bit: bitsandbytes 0.0 cannot run 8-bit (LLM.int8) layers on {DEVICE}" in error.problem
    assert "load_in_4bit=True" in error.fix and "GPU" in error.fix and error.kept == "nothing was loaded"
    assert not loaded


def test_the_int8_probe_names_bitsandbytes_when_it_fails():
    # bitsandbytes >= 0.45 has CPU int8 kernels; without them the probe's answer names the version
    assert INT8_PROBLEM is None or bnb.__version__ in INT8_PROBLEM


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: bitsandbytes' CUDA int8 kernels")
@pytest.mark.slow
def test_8bit_lora_on_the_gpu_matches_peft(tiny, tmp_path, monkeypatch):
    result = train(_config(tiny, tmp_path, "bfloat16"), echo=lambda _: None)
    monkeypatch.setenv("UNSLOTH_KERNELS", "0")
    reference = train(_config(tiny, tmp_path / "reference", "bfloat16"), echo=lambda _: None)
    assert max(abs(a - b) for a, b in zip(result.losses, reference.losses)) < 0.01
