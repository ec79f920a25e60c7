"""nf4_matmul: a few rows of x times a bitsandbytes NF4 weight, against a float64 reference.

The reference is bitsandbytes' own dense weight in x's dtype (what its matmul_4bit multiplies by)
times x in float64, so the only differences left are fp32 accumulation and the output's rounding.
"""

from __future__ import annotations

import pytest
import torch

from reference import DEVICE, needs_kernels
from unsloth_kernels import nf4_matmul as nf4_matmul_module
from unsloth_kernels.nf4 import prepare_bnb_4bit
from unsloth_kernels.nf4_matmul import MAX_ROWS, nf4_matmul

bnb_functional = pytest.importorskip("bitsandbytes.functional")
pytestmark = needs_kernels

# With the interpreter's tiles (NF4_MATMUL_TUNING: 32 rows of W by 64 columns of K a step): K
# ending mid-step (200 = 3 steps and 8 columns; no multiple of the 64-element block either, so a
# scale per byte), K split into unequal parts (576 = 5 + 4 steps), N not a multiple of the tile
# (73, 200, 520), one row (the multiply-add form, with and without bias) and several (tl.dot). The
# interpreter counts 4 SMs, so up to N = 256 K is split across programs (the two-pass sum); N = 520
# runs in one pass.
CASES = [(1, 72, 320), (1, 73, 200), (3, 200, 576), (2, 72, 200), (8, 520, 320), (16, 200, 320)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-22}


def quantize(n, k, nested, seed=0, blocksize=64):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn((n, k), generator=generator).to(DEVICE)
    return bnb_functional.quantize_4bit(weight, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")


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


@pytest.fixture(params=[False, True], ids=["reduce", "dot"])
def few_rows_form(request, monkeypatch):
    """Both forms of the 2..16-row kernel: a reduction per row, and a 16-row tl.dot."""
    block_n, block_k, warps, programs_per_sm, _ = nf4_matmul_module.NF4_MATMUL_TUNING["few"]
    monkeypatch.setitem(nf4_matmul_module.NF4_MATMUL_TUNING, "few",
                        (block_n, block_k, warps, programs_per_sm, request.param))  # fmt: skip
    return request.param


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", CASES, ids=str)
def test_matches_float64_reference(m, n, k, dtype, nested, few_rows_form):
    if few_rows_form and (m == 1 or not nested):
        pytest.skip("one row has one form; the tl.dot form reads scales as the other does (nested covers it)")
    packed, state = quantize(n, k, nested)
    x = torch.randn((m, k), device=DEVICE).to(dtype)
    use_bias = (m + n) % 2 == 0  # with and without bias across the cases, not doubling them
    bias = torch.randn(n, device=DEVICE).to(dtype) if use_bias else None
    check(nf4_matmul(x, prepare_bnb_4bit(packed, state), bias), x, packed, state, bias)


@pytest.mark.parametrize("m", [1, 4])
def test_a_block_longer_than_the_step(m, few_rows_form):
    """blocksize 128 over 64-column steps: each step reads half a block's scale group."""
    packed, state = quantize(40, 384, nested=True, blocksize=128)
    x = torch.randn((m, 384), device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(40, device=DEVICE).to(torch.bfloat16)
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
