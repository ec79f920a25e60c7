"""nf4_matmul: a few rows of x times a bitsandbytes NF4 weight, against a float64 reference.

The reference is bitsandbytes' own dense weight in x's dtype (what its matmul_4bit multiplies by)
times x in float64, so the only differences left are fp32 accumulation and the output's rounding.
"""

from __future__ import annotations

import pytest
import torch

from reference import DEVICE, needs_kernels
from unsloth_kernels.nf4 import prepare_bnb_4bit
from unsloth_kernels.nf4_matmul import MAX_ROWS, nf4_matmul

bnb_functional = pytest.importorskip("bitsandbytes.functional")
pytestmark = needs_kernels

# K not a multiple of BLOCK_K (576 = 4.5 steps, 320 = 2.5), N not a multiple of BLOCK_N. The
# interpreter counts 4 SMs, so up to N = 256 K is split (the two-pass sum); N = 520 runs in one pass.
CASES = [(1, 72, 320), (3, 200, 576), (8, 520, 320), (16, 200, 320)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-22}


def quantize(n, k, nested, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn((n, k), generator=generator).to(DEVICE)
    return bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4")


def check(y, x, packed, state, bias):
    state.dtype = x.dtype
    weight = bnb_functional.dequantize_4bit(packed, state).double()
    ref = x.double().reshape(-1, weight.shape[1]) @ weight.T
    if bias is not None:
        ref = ref + bias.double()
    ref = ref.reshape(*x.shape[:-1], weight.shape[0])
    assert y.dtype == x.dtype and y.shape == ref.shape
    # one rounding of the output (half an ulp, relative), plus fp32 sums over K terms of size |x||w|
    scale = x.double().abs().reshape(-1, weight.shape[1]) @ weight.abs().T
    tol = EPS[x.dtype] * ref.abs() + 1e-6 * scale.reshape(ref.shape) + 1e-6
    assert ((y.double() - ref).abs() <= tol).all(), (y.double() - ref).abs().max()


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", CASES, ids=str)
def test_matches_float64_reference(m, n, k, dtype, nested):
    packed, state = quantize(n, k, nested)
    x = torch.randn((m, k), device=DEVICE).to(dtype)
    use_bias = (m + n) % 2 == 0  # with and without bias across the cases, not doubling them
    bias = torch.randn(n, device=DEVICE).to(dtype) if use_bias else None
    check(nf4_matmul(x, prepare_bnb_4bit(packed, state), bias), x, packed, state, bias)


def test_leading_dims_bias_and_deterministic():
    packed, state = quantize(200, 576, nested=True)
    prepared = prepare_bnb_4bit(packed, state)
    x = torch.randn((2, 4, 576), device=DEVICE).to(torch.bfloat16)  # 8 rows as [batch, seq, K]
    bias = torch.randn(200, device=DEVICE).to(torch.bfloat16)
    y = nf4_matmul(x, prepared, bias)
    check(y, x, packed, state, bias)
    assert torch.equal(y, nf4_matmul(x, prepared, bias))


def test_rejects_what_it_cannot_do():
    packed, state = quantize(72, 320, nested=False)
    prepared = prepare_bnb_4bit(packed, state)
    with pytest.raises(ValueError, match="rows"):
        nf4_matmul(torch.randn((MAX_ROWS + 1, 320), device=DEVICE), prepared)
    with pytest.raises(ValueError, match="features"):
        nf4_matmul(torch.randn((2, 321), device=DEVICE), prepared)


def test_under_torch_compile():
    """One graph (fullgraph): the op traces, so a compiled decode step keeps it inside its graph."""
    packed, state = quantize(72, 320, nested=True)
    prepared = prepare_bnb_4bit(packed, state)
    bias = torch.randn(72, device=DEVICE)

    @torch.compile(fullgraph=True, dynamic=False)
    def step(x):
        return torch.nn.functional.silu(nf4_matmul(x, prepared, bias))

    x = torch.randn((3, 320), device=DEVICE)
    torch.testing.assert_close(step(x), torch.nn.functional.silu(nf4_matmul(x, prepared, bias)))
