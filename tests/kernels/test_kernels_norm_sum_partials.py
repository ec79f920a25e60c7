"""The norms' last backward step: fp32 partial rows summed and cast in one launch (_utils.sum_partials)."""

from __future__ import annotations

import pytest
import torch
from reference import DEVICE, assert_compile_for_gpus, needs_kernels, without_gpu

import unsloth_kernels._utils as kernel_utils
from unsloth_kernels._utils import sum_partials

pytestmark = needs_kernels


def integer_partials(groups, n_partials, n_cols, seed=0):
    # Integers below 2^12 summed over < 2^9 rows stay exact in fp32 whatever the order, so the
    # only rounding left is the final cast, which must be torch's (to nearest, ties to even).
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4096, 4096, (groups, n_partials, n_cols), generator=g).float().to(DEVICE)


# More partial rows than one step of the loop takes (SUM_BLOCK_P), and not a multiple of it; a
# single row; widths below, at, and not a multiple of a program's columns (SUM_BLOCK_N).
@pytest.mark.parametrize("n_partials", [1, kernel_utils.SUM_BLOCK_P, 2 * kernel_utils.SUM_BLOCK_P + 22])
@pytest.mark.parametrize("n_cols", [1, 32, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_sums_are_exact_then_rounded_like_torch(n_partials, n_cols, dtype):
    partials = integer_partials(1, n_partials, n_cols)
    out = torch.empty(n_cols, dtype=dtype, device=DEVICE)
    sum_partials(partials, out)
    assert torch.equal(out, partials.double().sum(1)[0].to(dtype))


def test_two_groups_in_one_launch_each_in_its_own_dtype():
    # LayerNorm: dW (group 0) and dB (group 1), and their parameters may differ in dtype.
    partials = integer_partials(2, kernel_utils.SUM_BLOCK_P + 22, 1000, seed=1)
    dw = torch.empty(1000, dtype=torch.bfloat16, device=DEVICE)
    db = torch.empty(1000, dtype=torch.float32, device=DEVICE)
    sum_partials(partials, dw, db)
    exact = partials.double().sum(1)
    assert torch.equal(dw, exact[0].to(torch.bfloat16)) and torch.equal(db, exact[1].to(torch.float32))


def test_the_rounding_is_to_nearest_even_not_truncation():
    # 257 is halfway between bf16's 256 and 258: ties go to the even 256; 259 rounds up to 260,
    # where truncation (the interpreter's own cast) would give 258.
    partials = torch.tensor([[[256.0, 258.0], [1.0, 1.0]]], device=DEVICE)
    out = torch.empty(2, dtype=torch.bfloat16, device=DEVICE)
    sum_partials(partials, out)
    assert out.tolist() == [256.0, 260.0]


def test_no_partials_give_zeros():
    # An empty batch leaves no programs, hence no partial rows: the gradient is zero.
    out = torch.full((64,), 7.0, dtype=torch.bfloat16, device=DEVICE)
    sum_partials(torch.empty(1, 0, 64, device=DEVICE), out)
    assert torch.equal(out, torch.zeros_like(out))


@without_gpu
def test_kernel_compiles_for_cuda_and_rocm_gpus():
    assert_compile_for_gpus([("unsloth_kernels._utils", "_sum_partials",
                              dict(ROUND_BF16=False, BLOCK_P=kernel_utils.SUM_BLOCK_P,
                                   BLOCK_N=kernel_utils.SUM_BLOCK_N), 4)])
