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


# --- the estimate before training ----------------------------------------------------------------

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # tiny_families

from tiny_families import VOCAB, tiny_model, with_lora  # noqa: E402
from unsloth.errors import ExitCode  # noqa: E402
from unsloth.training import memory  # noqa: E402


def _unique_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _trained_once(model, optimizer_cls, **options):
    model.train()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_cls(trainable, lr=1e-3, **options)
    optimizer.step()
    return trainable, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_and_adamw_states_are_counted_exactly(dtype):
    model = tiny_model("llama", dtype=dtype).requires_grad_(True)
    trainable, optimizer = _trained_once(model, torch.optim.AdamW)
    counted = memory.trainable_tensors(model)
    assert memory.gradient_bytes(counted) == _unique_bytes(p.grad for p in trainable)
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert memory.optimizer_bytes(counted, "adamw_torch")[0] == _unique_bytes(states)


def test_8bit_adamw_states_are_counted_exactly():
    bnb = pytest.importorskip("bitsandbytes")
    from unsloth.training.optimizers import bitsandbytes_optimizer_problem

    if bitsandbytes_optimizer_problem("cpu"):
        pytest.skip(bitsandbytes_optimizer_problem("cpu"))
    model = tiny_model("llama").requires_grad_(True)
    _, optimizer = _trained_once(model, bnb.optim.AdamW8bit)
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert any(t.dtype == torch.uint8 for t in states) and any(t.dtype == torch.float32 and t.numel() == 64
                                                               for t in states)  # norms keep float32 states
    counted, kind = memory.optimizer_bytes(memory.trainable_tensors(model), "adamw_8bit")
    assert counted == _unique_bytes(states) and "8-bit" in kind


def test_lora_counts_only_the_adapters():
    model = with_lora(tiny_model("llama"))
    trainable, optimizer = _trained_once(model, torch.optim.AdamW)
    counted = memory.trainable_tensors(model)
    assert len(counted) == 2 * 7 * 2  # A and B of seven projections in two layers
    assert memory.gradient_bytes(counted) == _unique_bytes(p.grad for p in trainable)


def test_weights_are_what_the_checkpoint_holds(tmp_path):
    from safetensors import safe_open

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    unsaved = sum(b.numel() * b.element_size() for b in model.buffers())  # RoPE's inv_freq is not persistent
    assert memory.weight_bytes(model) == saved + unsaved
    assert memory.weight_bytes(model, "cuda") == 0  # counted where the model is
    half = memory.weight_bytes(tiny_model("llama", dtype=torch.bfloat16))
    assert half == (saved + unsaved) // 2 or abs(half - (saved + unsaved) / 2) <= unsaved


def _saved_for_backward(model, ids) -> int:
    """Bytes the forward pass keeps for backward (autograd's saved tensors, weights excluded)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # (the recompute's saved tensors are short-lived: not counted as kept)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in weights)


@pytest.mark.parametrize("patched,checkpointing", [
    (False, False), pytest.param(True, False, marks=pytest.mark.slow), pytest.param(True, True, marks=pytest.mark.slow)],
    ids=["transformers", "ours", "ours-checkpointed"])
def test_activation_formula_matches_what_autograd_keeps(patched, checkpointing):
    from unsloth.models.checkpointing import apply_gradient_checkpointing
    from unsloth.models.patches import patch_model

    model = tiny_model("llama").requires_grad_(True)
    if patched:
        assert patch_model(model).loss
    if checkpointing:
        apply_gradient_checkpointing(model, True)
    model.train()
    batch, seq = 2, 64
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    kept, working = memory.activation_parts(memory.model_facts(model),
                                            memory.RunSettings(batch, seq, checkpointing=checkpointing))
    assert kept == pytest.approx(_saved_for_backward(model, ids), rel=0.15)
    assert (working > 0) == (checkpointing or patched)


def _facts(**change):
    """A Llama-3.2-1B-shaped model, in bf16, fully trainable."""
    trainable = ((128256 * 2048, 2),) + ((2048 * 2048, 2),) * 32 + ((2048 * 8192, 2),) * 48 + ((2048, 2),) * 33
    facts = memory.ModelFacts(hidden=2048, intermediate=8192, layers=16, q_width=2048, kv_width=512, vocab=128256,
                              weight_bytes=sum(n * s for n, s in trainable), trainable=trainable,
                              activation_bytes=2, fused_loss=True, head_trainable=True)
    return memory.replace(facts, **change)


def test_an_mlp_that_skips_its_recompute_output_counts_chunks():
    from unsloth.models.patches import patch_model, patch_peft_model

    run = memory.RunSettings(batch=8, seq=2048, checkpointing="unsloth")
    whole, chunked = (memory.activation_parts(_facts(mlp_chunk_bytes=n), run)[1] for n in (0, 64 * 2**20))
    assert whole - chunked == 3 * (8 * 2048 * 8192 * 2 - 64 * 2**20)  # gate, up, h: whole against chunks
    plain = memory.RunSettings(batch=8, seq=2048, checkpointing=False)
    assert memory.activation_parts(_facts(mlp_chunk_bytes=64 * 2**20), plain) == memory.activation_parts(_facts(), plain)
    model = tiny_model("llama")
    assert memory.model_facts(model).mlp_chunk_bytes == 0  # transformers' MLP
    patch_model(model)
    full = memory.model_facts(model.requires_grad_(True)).mlp_chunk_bytes
    lora = with_lora(model)
    patch_peft_model(lora)
    from unsloth_kernels import gated_mlp, lora as lora_kernels

    assert gated_mlp.CHUNK_BYTES != lora_kernels.MLP_CHUNK_BYTES  # so the two cases below are told apart
    assert (full, memory.model_facts(lora).mlp_chunk_bytes) == (gated_mlp.CHUNK_BYTES, lora_kernels.MLP_CHUNK_BYTES)
    gemma = tiny_model("gemma2")  # a norm after the MLP: nothing is skipped
    patch_model(gemma)
    assert memory.model_facts(gemma).mlp_chunk_bytes == 0


def test_checkpointing_and_8bit_states_shrink_the_estimate():
    facts = _facts()
    run = memory.RunSettings(batch=8, seq=2048, optim="adamw_torch", checkpointing=False)
    plain = memory.estimate(facts, run)
    checkpointed = memory.estimate(facts, memory.replace(run, checkpointing=True))
    offloaded = memory.estimate(facts, memory.replace(run, checkpointing="unsloth"))
    eight_bit = memory.estimate(facts, memory.replace(run, checkpointing="unsloth", optim="adamw_8bit"))
    assert plain.activations > 5 * checkpointed.activations > 5 * offloaded.activations
    assert eight_bit.optimizer * 1.9 < offloaded.optimizer  # 1 byte per state (and scales) against bf16's 2
    assert plain.weights == plain.gradients == facts.weight_bytes  # bf16 full fine-tuning
    lora = memory.estimate(_facts(trainable=((2048 * 16, 2),) * 64, head_trainable=False), run)
    assert lora.gradients < plain.gradients / 100 and lora.activations < plain.activations


def test_a_run_that_cannot_fit_is_refused_with_the_numbers_and_the_fixes():
    facts = _facts()
    run = memory.RunSettings(batch=8, seq=2048, optim="adamw_torch", checkpointing=False)
    estimated = memory.estimate(facts, run)
    tips = memory.fixes(facts, run, full_finetuning=True, load_in_4bit=False)
    with pytest.raises(memory.NotEnoughMemory) as caught:
        memory.check_fits(estimated, free=20 * memory.GIB, tips=tips)
    error = caught.value
    assert error.exit_code == ExitCode.OUT_OF_MEMORY and error.kept == "nothing was trained or written"
    needed = memory.gib(estimated.total - estimated.weights)
    assert f"needs about {needed} more GPU memory" in error.problem and "20.00 GiB is free" in error.problem
    assert memory.gib(estimated.optimizer) in error.problem and "adamw_torch" in error.problem
    fix = error.fix
    assert fix.index('gradient_checkpointing = "unsloth"') < fix.index('optim = "adamw_8bit"') \
        < fix.index("per_device_train_batch_size = 4")
    assert "model.full_finetuning = false" in fix and "max_seq_length = 1024" in fix
    smaller = memory.estimate(facts, memory.replace(run, checkpointing="unsloth"))
    assert f'gradient_checkpointing = "unsloth" (then about {memory.gib(smaller.total)} in all)' in fix
    memory.check_fits(estimated, free=estimated.total, tips=tips)  # fits: no error
    lora_tips = memory.fixes(facts, memory.replace(run, checkpointing="unsloth", batch=1, seq=512),
                             full_finetuning=False, load_in_4bit=False)
    assert lora_tips == ["4-bit base weights (QLoRA): model.load_in_4bit = true"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: the check reads the GPU's free memory")
def test_training_is_refused_before_the_first_step_when_it_cannot_fit(tmp_path, monkeypatch):
    from tiny_setup import write_dataset, write_tiny_model
    from unsloth.training.config import from_dict
    from unsloth.training.sft import train

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1024, 2**40))
    config = from_dict({"model": {"name": write_tiny_model(tmp_path / "model"), "max_seq_length": 32,
                                  "full_finetuning": True},
                        "dataset": {"name": write_dataset(tmp_path / "data.jsonl")},
                        "output_dir": str(tmp_path / "out"), "training": {"max_steps": 2}})
    with pytest.raises(memory.NotEnoughMemory, match="1024 B|0.00 GiB is free"):
        train(config, echo=lambda _: None)
    assert not (tmp_path / "out" / "loss_log.jsonl").exists()


def test_a_sharded_run_counts_one_gpus_share_of_the_training_state():
    whole = memory.MemoryEstimate(weights=10 * memory.GIB, gradients=3, optimizer=7, activations=5 * memory.GIB,
                                  optimizer_kind="AdamW")
    share = memory.sharded_estimate(whole, 4)
    assert (share.weights, share.gradients, share.optimizer) == (10 * memory.GIB // 4, 1, 2)  # rounded up
    assert share.activations == whole.activations  # each GPU's own batch
    assert memory.sharded_estimate(whole, 1) == whole
