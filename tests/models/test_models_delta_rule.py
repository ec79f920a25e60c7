"""Gated DeltaNet layers: what runs the gated delta rule is said at load. Where transformers would run
its torch path (flash-linear-attention absent, or refusing its gated backward on this GPU: Hopper,
Triton >= 3.4, < 3.7.1) our torch rule goes in instead, so training runs instead of stopping at the
first backward. Its numbers against transformers': test_models_delta_rule_torch.py.

fla is not installed here: a stand-in `fla` package (its flags and a kernel that raises as fla's does)
goes through transformers' own fallback decorator, so the wrapper we look into is the real one."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from tiny_families import VOCAB, tiny_model
from unsloth.models.patches import patch_model
from unsloth.models.patches.delta_rule import FLA, OURS, hub_callee, route_delta_rule

modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
from transformers.integrations import hub_kernels  # noqa: E402
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback  # noqa: E402

REFUSED = "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results"


@pytest.fixture(autouse=True)
def _restore_the_rule(monkeypatch):
    """Each test starts from, and gives back, the module global as it was (a route replaces it)."""
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", modeling.torch_chunk_gated_delta_rule)


def _fake_fla(monkeypatch, hopper_with_bad_triton: bool):
    """An `fla` whose chunk_gated_delta_rule raises as fla's backward does on a bad Triton."""
    fla = types.ModuleType("fla")
    flags = types.ModuleType("fla.utils")
    flags.IS_NVIDIA_HOPPER = hopper_with_bad_triton
    flags.TRITON_ABOVE_3_4_0 = True
    flags.TRITON_ABOVE_3_7_1 = not hopper_with_bad_triton

    def chunk_gated_delta_rule(*args, **kwargs):
        raise RuntimeError(REFUSED)

    fla.chunk_gated_delta_rule = chunk_gated_delta_rule
    fla.utils = flags
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.utils", flags)
    return chunk_gated_delta_rule


def _wrap_with_fla(monkeypatch, hopper_with_bad_triton: bool):
    """transformers' Qwen3.5 module as it is when fla was importable at its import: the same
    decorator over the same torch reference, now resolving to the stand-in fla."""
    _fake_fla(monkeypatch, hopper_with_bad_triton)
    if hasattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES"):  # transformers >= 5.25 runs fla on GPU inputs only
        monkeypatch.setitem(hub_kernels._PACKAGE_SUPPORTED_DEVICES, "fla", ("cpu",))
    # the torch reference, under our rule too if it is in, and under the `kernels` package's wrapper
    reference = inspect.unwrap(hub_callee(modeling.torch_chunk_gated_delta_rule))
    wrapped = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(reference)
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", wrapped)
    return reference


def _loss_backward(model, seed=3):
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), model.model.layers[0].linear_attn.in_proj_qkv.weight.grad.clone()


def test_without_fla_our_torch_rule_runs_and_the_load_message_says_so():
    report = patch_model(tiny_model("qwen3_5_text"))
    assert report.delta_rule == (f"{OURS} ({FLA} not installed)", False)
    assert "not accelerated: " in report.summary()
    assert f"Gated DeltaNet through {OURS} ({FLA} not installed)" in report.summary()
    assert modeling.torch_chunk_gated_delta_rule.unsloth_route == report.delta_rule


def test_a_model_without_gated_deltanet_says_nothing_about_it():
    report = patch_model(tiny_model("llama"))
    assert report.delta_rule is None and "DeltaNet" not in report.summary()


def test_fla_that_works_here_is_kept_and_said_fast(monkeypatch):
    _wrap_with_fla(monkeypatch, hopper_with_bad_triton=False)
    wrapper = modeling.torch_chunk_gated_delta_rule
    assert route_delta_rule(tiny_model("qwen3_5_text")) == (FLA, True)
    assert modeling.torch_chunk_gated_delta_rule is wrapper  # untouched
    assert f"Gated DeltaNet through {FLA}" in patch_model(tiny_model("qwen3_5_text")).summary().split("; not")[0]


def test_fla_refusing_its_backward_here_sends_training_to_our_torch_rule(monkeypatch):
    model = tiny_model("qwen3_5_text")
    expected = _loss_backward(model)  # transformers' torch path (fla absent at its import)

    _wrap_with_fla(monkeypatch, hopper_with_bad_triton=True)
    with pytest.raises(RuntimeError, match="Hopper"):  # what a user got: training stops
        _loss_backward(model)

    what, fast = patch_model(model).delta_rule
    assert not fast and what.startswith(OURS) and "Hopper with Triton" in what and "3.7.1" in what
    loss, grad = _loss_backward(model)  # now runs, with transformers' torch path's numbers
    torch.testing.assert_close(loss, expected[0])
    torch.testing.assert_close(grad, expected[1])


@pytest.mark.parametrize("hopper_with_bad_triton, why", [(True, "Hopper"), (None, f"{FLA} not installed")])
def test_packed_sequences_on_the_rerouted_rule_are_refused_clearly(monkeypatch, hopper_with_bad_triton, why):
    if hopper_with_bad_triton:
        _wrap_with_fla(monkeypatch, hopper_with_bad_triton)
    route_delta_rule(tiny_model("qwen3_5_text"))
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match=f"packed sequences .* {why}"):
        modeling.torch_chunk_gated_delta_rule(q, q, q, g=torch.zeros(1, 4, 2), beta=torch.zeros(1, 4, 2),
                                              cu_seqlens=torch.tensor([0, 2, 4]))


@pytest.mark.parametrize("hopper_with_bad_triton", [None, True])
def test_a_second_load_in_the_process_says_the_same_route(monkeypatch, hopper_with_bad_triton):
    if hopper_with_bad_triton:
        _wrap_with_fla(monkeypatch, hopper_with_bad_triton)
    first = route_delta_rule(tiny_model("qwen3_5_text"))
    ours = modeling.torch_chunk_gated_delta_rule
    assert first[0].startswith(OURS)
    assert route_delta_rule(tiny_model("qwen3_5_text")) == first  # the global is ours now, and recognised
    assert modeling.torch_chunk_gated_delta_rule is ours  # not wrapped twice
