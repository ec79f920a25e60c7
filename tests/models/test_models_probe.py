"""The behaviour probe: accepts our kernels at real widths in bf16, rejects a different formula."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unsloth.models.patches.mlp import patch_mlps
from unsloth.models.patches.probe import same


class GatedMLP(nn.Module):
    """Llama's MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden, intermediate, act=F.silu):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class UpGatedMLP(GatedMLP):
    """Same weights and activation, the gate put on the other projection: a different function."""

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


def _init(module, std=0.02):  # transformers' initializer_range: the scale random benchmark models have
    torch.manual_seed(0)
    for p in module.parameters():
        nn.init.normal_(p, std=std)
    return module.to(torch.bfloat16)


def test_fused_mlp_is_accepted_at_llama_8b_width_in_bf16():
    """At 4096 / 14336 the fused activation's single rounding moves outputs by a few ulps of the largest
    ones; an element-wise-only tolerance refused the patch there (it did on the H200's 8B model)."""
    mlp = _init(GatedMLP(4096, 14336))
    assert patch_mlps(mlp, "cpu", torch.bfloat16) == 1
    assert mlp._unsloth_act == "silu"


def test_a_different_formula_is_refused_at_the_same_width():
    mlp = _init(UpGatedMLP(4096, 14336))
    assert patch_mlps(mlp, "cpu", torch.bfloat16) == 0
    assert not hasattr(mlp, "_unsloth_act")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_same_is_norm_wise_and_scale_aware(dtype):
    torch.manual_seed(0)
    expected = (torch.randn(64, 512) * 4).to(dtype)
    ulp_noise = expected * (1 + torch.finfo(dtype).eps * torch.randn_like(expected.float()).to(dtype))
    assert same(ulp_noise, expected)
    assert not same(expected * 1.1, expected)  # 10% off everywhere
    wrong = expected.clone()
    wrong[0] += 1  # one row shifted by a quarter of the output's spread
    assert not same(wrong, expected)
    assert not same(expected[:2], expected)  # shape
    assert same(expected[:0], expected[:0])
