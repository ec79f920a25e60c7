"""Windowed vision attention (models/patches/vision_attention.py): equal windows batched into one
attention call, the same outputs and gradients as the stock tower."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny_vision import tiny_vision_model
from torch import nn

from unsloth.models.patches import vision_attention
from unsloth.models.patches.vision_attention import patch_vision_attention, window_lengths, windowed_attention

CPU = torch.device("cpu")


@pytest.fixture
def counted_sdpa(monkeypatch):
    """The number of SDPA calls, ours and transformers' both (they share torch's function)."""
    calls = []
    original = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return calls


def test_windows_of_equal_length_are_one_call_with_the_per_window_result(counted_sdpa):
    torch.manual_seed(0)
    lengths = [5, 5, 5, 2, 7, 7]
    q, k, v = (torch.randn(sum(lengths), 3, 8, dtype=torch.float64) for _ in range(3))
    out = windowed_attention(q, k, v, lengths, scale=0.3)
    assert len(counted_sdpa) == 3  # three runs of equal windows
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * 0.3
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[rows])
        torch.testing.assert_close(out[rows], expected)
        start += length


def test_windows_that_do_not_cover_the_rows_are_refused():
    q = torch.randn(10, 2, 4)
    with pytest.raises(ValueError, match="cover 9 rows"):
        windowed_attention(q, q, q, [3, 6], scale=0.5)


def test_window_lengths_are_read_once_per_tensor_and_again_after_a_change(monkeypatch):
    cu_seqlens = torch.tensor([0, 4, 8, 11], dtype=torch.int32)
    assert window_lengths(cu_seqlens) == [4, 4, 3]
    reads = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or [9])
    assert window_lengths(cu_seqlens) == [4, 4, 3] and not reads  # cached
    cu_seqlens[3] = 12  # in place: the version moves, the lengths are read again
    assert window_lengths(cu_seqlens) == [9] and len(reads) == 1
    other = torch.tensor([0, 2], dtype=torch.int32)
    assert window_lengths(other) == [9] and len(reads) == 2  # another tensor: read


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_patched_tower_gives_the_stock_outputs_and_gradients(family, counted_sdpa, one_thread):
    model, _ = tiny_vision_model(family)
    tower = model.model.visual.train()
    stock = copy.deepcopy(tower)
    assert patch_vision_attention(tower, CPU, torch.float32) == len(tower.blocks)
    # two images of uneven window counts: Qwen2.5-VL's 32-pixel windows of a 48 x 80 image are
    # 2x2, 2x1, 1x2 and 1x1 merged patches; Qwen3-VL attends over each whole image
    grid = torch.tensor([[1, 6, 10], [1, 4, 4]])
    torch.manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 8 * 8)

    counted_sdpa.clear()
    ours = tower(pixels, grid_thw=grid).last_hidden_state
    our_calls = len(counted_sdpa)
    counted_sdpa.clear()
    expected = stock(pixels, grid_thw=grid).last_hidden_state
    assert our_calls < len(counted_sdpa) if family == "qwen2_5_vl" else our_calls == len(counted_sdpa)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)

    ours.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(tower.named_parameters(), stock.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


class _CausalWindows(nn.Module):
    """Looks like a windowed vision attention but is causal within each window: not reproduced."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.qkv, self.proj, self.num_heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads

    def forward(self, hidden_states, cu_seqlens, rotary_pos_emb=None, position_embeddings=None, **kwargs):
        rows = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(rows, 3, self.num_heads, -1).permute(1, 2, 0, 3).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(rows, -1))


def test_switched_off_it_patches_nothing(monkeypatch):
    model, _ = tiny_vision_model("qwen2_5_vl")
    monkeypatch.setenv("UNSLOTH_VISION_ATTENTION", "0")
    assert patch_vision_attention(model, CPU, torch.float32) == 0
    assert not any(hasattr(m, "_unsloth_original_forward") for m in model.modules())


def test_an_attention_it_does_not_reproduce_stays_stock(monkeypatch):
    module = _CausalWindows()
    # its "modeling file" offers a rotary function, as the real ones do
    monkeypatch.setattr(vision_attention, "_rotary_if_windowed",
                        lambda m: (lambda q, k, cos, sin: (q, k)) if m is module else None)
    original = module.forward
    assert patch_vision_attention(nn.Sequential(module), CPU, torch.float32) == 0
    assert module.forward == original and not hasattr(module, "_unsloth_original_forward")


def test_calls_it_does_not_cover_go_to_the_original_forward(one_thread):
    model, _ = tiny_vision_model("qwen2_5_vl")
    attention = model.model.visual.blocks[0].attn
    patch_vision_attention(model, CPU, torch.float32)
    seen = []
    original = attention._unsloth_original_forward
    attention._unsloth_original_forward = lambda *a, **k: seen.append(k) or original(*a, **k)
    x = torch.randn(8, attention.qkv.in_features)
    cu_seqlens = torch.tensor([0, 8], dtype=torch.int32)
    angles = torch.randn(8, attention.qkv.out_features // 3 // attention.num_heads // 2).repeat(1, 2)
    attention(x, cu_seqlens, position_embeddings=(angles.cos(), angles.sin()))
    assert not seen  # ours
    attention.attention_dropout = 0.1  # dropout while training: the original's
    attention.train()
    attention(x, cu_seqlens, position_embeddings=(angles.cos(), angles.sin()))
    assert len(seen) == 1 and seen[0]["position_embeddings"][0] is not None
