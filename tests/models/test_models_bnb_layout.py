"""bitsandbytes' CPU dequantize misreads a 4-bit weight whose last dimension is under the block;
ours reads the same bytes as the flat weight they are."""

from __future__ import annotations

import pytest
import torch

bnb_functional = pytest.importorskip("bitsandbytes.functional")

from unsloth.models.bnb_layout import dequantize_4bit  # noqa: E402


@pytest.mark.parametrize("shape", [(6, 32, 32), (96, 32), (4, 64, 128), (3, 100)], ids=str)
def test_dequantize_reads_every_shape_as_its_flat_bytes(shape):
    dense = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    packed, state = bnb_functional.quantize_4bit(dense, blocksize=64, compress_statistics=True, quant_type="nf4")
    flat_packed, flat_state = bnb_functional.quantize_4bit(dense.reshape(-1), blocksize=64, compress_statistics=True,
                                                           quant_type="nf4")  # fmt: skip
    assert torch.equal(packed.reshape(-1), flat_packed.reshape(-1))  # the same bytes, whatever the shape
    got = dequantize_4bit(packed, state)
    assert got.shape == dense.shape
    torch.testing.assert_close(got, bnb_functional.dequantize_4bit(flat_packed, flat_state).view(shape), rtol=0, atol=0)
    # NF4's codes are at most 0.304 of a block's absmax apart, so a value read right is within 0.152
    # of its block's absmax, plus the absmax's own 8-bit rounding (under 1%); a misread block is far off
    flat = dense.reshape(-1)
    block = torch.arange(flat.numel()) // 64
    absmax = torch.zeros(int(block[-1]) + 1).scatter_reduce(0, block, flat.abs(), "amax")
    assert ((got.reshape(-1) - flat).abs() <= 0.16 * absmax[block] + 1e-6).all()
