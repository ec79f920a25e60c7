"""NF4 dequantization: bit-exact against bitsandbytes' own quantize/dequantize (runs on the CPU here).

Exact equality is the right bar: the kernel does the same fp32 products (and sum, for the nested
absmax) as bitsandbytes and rounds once to the output dtype, to nearest-even like torch does.
"""

from __future__ import annotations

import pytest
import torch

from reference import DEVICE, needs_kernels, real_shapes
import unsloth_kernels.nf4 as nf4
from unsloth_kernels.nf4 import NF4_CODE, dequantize_bnb_4bit, dequantize_nf4, dequantize_traceable, prepare_bnb_4bit

try:  # the reference; the GPU bench machine may lack it, and then only the real-shape test runs
    import bitsandbytes.functional as bnb_functional
except ImportError:
    bnb_functional = None
needs_bnb = pytest.mark.skipif(bnb_functional is None, reason="bitsandbytes is not installed")

pytestmark = needs_kernels
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Odd element counts, a single element, rows of whole blocks, and more than 256 absmax blocks (the
# nested level's block) in the last one: 7 * 4096 / 64 = 448.
SHAPES = [(3, 33), (1, 1), (5, 128), (3, 256), (7, 4096)]
# Rows that end mid-block (or are shorter than one), so blocks span rows.
SPANNING_SHAPES = [(7, 130), (5, 4000), (64, 64)]


def quantize(shape, blocksize, nested, dtype, quant_type="nf4", seed=0, storage=torch.uint8):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape, generator=generator) * 3).to(DEVICE)
    packed, state = bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type, quant_storage=storage
    )
    state.dtype = dtype
    return packed, state


def flat_reference(packed, state):
    """The format's definition, element by element over the flattened weight (as bnb's CUDA does)."""
    data = packed.view(torch.uint8).reshape(-1).long()
    idx = torch.stack((data >> 4, data & 0xF), dim=1).reshape(-1)[: state.shape.numel()]
    absmax = state.absmax
    if state.nested:
        absmax = state.state2.code[absmax.long()] * state.state2.absmax.repeat_interleave(state.state2.blocksize)[
            : absmax.numel()
        ]
        absmax = absmax + state.offset
    scale = absmax.float().repeat_interleave(state.blocksize)[: idx.numel()]
    return (state.code.float()[idx] * scale).reshape(state.shape).to(state.dtype)


@needs_bnb
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bit_exact_with_bitsandbytes(shape, blocksize, nested, dtype):
    packed, state = quantize(shape, blocksize, nested, dtype)
    expected = bnb_functional.dequantize_4bit(packed, state)
    actual = dequantize_bnb_4bit(packed, state)
    assert actual.dtype == dtype and actual.shape == torch.Size(shape)
    assert torch.equal(actual, expected)


@needs_bnb
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("shape", [(3, 256), (7, 130)], ids=str)
def test_the_traceable_op_is_bit_exact_eager_and_compiled(shape, nested, dtype):
    """The torch.library op (what a compiled decode step calls) gives bitsandbytes' weight, also traced
    by torch.compile into one graph with the matmul after it."""
    packed, state = quantize(shape, 64, nested, dtype)
    expected = bnb_functional.dequantize_4bit(packed, state)
    prepared = prepare_bnb_4bit(packed, state)
    assert torch.equal(dequantize_traceable(prepared, dtype), expected)
    x = torch.randn(2, shape[1], dtype=dtype, device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x @ dequantize_traceable(prepared, dtype).T, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), x @ expected.T, rtol=0, atol=0)


@needs_bnb
def test_the_traceable_op_takes_2d_weights_only():
    packed, state = quantize((4, 64), 64, False, torch.float32)
    state.shape = torch.Size((2, 2, 64))
    with pytest.raises(ValueError, match="2-D"):
        dequantize_traceable(prepare_bnb_4bit(packed, state), torch.float32)


@needs_bnb
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("shape", SPANNING_SHAPES, ids=str)
def test_blocks_span_rows(shape, blocksize, nested, dtype):
    # Blocks run over the flattened weight, as in bnb's CUDA kernels and its portable torch path.
    # bnb 0.50's native CPU kernel blocks each row separately when a row ends mid-block, so it is
    # not the reference here; the format's definition is.
    packed, state = quantize(shape, blocksize, nested, dtype)
    assert torch.equal(dequantize_bnb_4bit(packed, state), flat_reference(packed, state))


@needs_bnb
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_flat_reference_agrees_with_bitsandbytes(nested):
    # Guards the reference above: it reproduces bnb's public dequantize_4bit on whole-block rows.
    packed, state = quantize((7, 4096), 64, nested, torch.bfloat16)
    assert torch.equal(flat_reference(packed, state), bnb_functional.dequantize_4bit(packed, state))


@needs_bnb
def test_fp4_through_its_code():
    packed, state = quantize((9, 70), 64, True, torch.bfloat16, quant_type="fp4")
    assert torch.equal(dequantize_bnb_4bit(packed, state), bnb_functional.dequantize_4bit(packed, state))


@needs_bnb
def test_non_uint8_storage_is_read_as_bytes():
    # FSDP-style quant_storage=bfloat16 packs the same bytes into 16-bit words.
    packed, state = quantize((6, 128), 64, True, torch.bfloat16, storage=torch.bfloat16)
    assert packed.dtype == torch.bfloat16
    assert torch.equal(dequantize_bnb_4bit(packed, state), bnb_functional.dequantize_4bit(packed, state))


@needs_bnb
def test_low_level_api_and_dtype_override():
    packed, state = quantize((4, 96), 64, False, torch.float16)
    out = torch.empty(4, 96, dtype=torch.float32, device=DEVICE)
    result = dequantize_nf4(packed, state.absmax, (4, 96), torch.float32, blocksize=64, out=out)
    assert result is out
    assert torch.equal(out, dequantize_bnb_4bit(packed, state, dtype=torch.float32))
    assert torch.equal(torch.tensor(NF4_CODE), state.code.float().cpu())  # our default code is bnb's NF4


@pytest.mark.parametrize("blocksize", [2, 6, 48, 4096, 4 * nf4._BYTES_PER_PROGRAM])
@pytest.mark.parametrize("n", [1, 37, 4101, 20001])
def test_any_even_blocksize_against_the_formula(blocksize, n):
    """Block sizes bitsandbytes does not use, where the kernel's rows (bytes sharing one scale) are 1, 2
    or 8 bytes, or whose block spans two programs' bytes: w[i] = code[index[i]] * absmax[i // blocksize]."""
    g = torch.Generator().manual_seed(n + blocksize)
    packed = torch.randint(0, 256, ((n + 1) // 2,), generator=g, dtype=torch.uint8)
    absmax = torch.rand(-(-n // blocksize), generator=g) + 0.5
    index = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
    expected = torch.tensor(NF4_CODE)[index] * absmax.repeat_interleave(blocksize)[:n]
    actual = dequantize_nf4(packed.to(DEVICE), absmax.to(DEVICE), (n,), torch.float32, blocksize=blocksize)
    assert torch.equal(actual.cpu(), expected)


@needs_bnb
def test_bad_inputs_are_named():
    packed, state = quantize((4, 64), 64, False, torch.bfloat16)
    with pytest.raises(ValueError, match="bytes"):
        dequantize_nf4(packed[:-1], state.absmax, (4, 64))
    with pytest.raises(ValueError, match="absmax"):
        dequantize_nf4(packed, state.absmax[:-1], (4, 64))
    with pytest.raises(ValueError, match="blocksize"):
        dequantize_nf4(packed, state.absmax, (4, 64), blocksize=63)
    state.quant_type = "int4"
    with pytest.raises(ValueError, match="quant_type"):
        dequantize_bnb_4bit(packed, state)


@needs_bnb
def test_short_nested_absmax_is_refused():
    # 7 x 4096 in blocks of 64 is 448 absmax values: two second-level scales (of 256), not one.
    packed, state = quantize((7, 4096), 64, True, torch.bfloat16)
    state.state2.absmax = state.state2.absmax[:1]
    with pytest.raises(ValueError, match="nested absmax has 1 scales"):
        dequantize_bnb_4bit(packed, state)


@real_shapes
def test_real_shape_on_gpu():
    # Llama-3.1-8B's MLP weight (14336 x 4096), nested absmax; a GPU-side reference of the format
    # (bitsandbytes need not be installed on the GPU machine).
    from types import SimpleNamespace

    shape, blocksize = (14336, 4096), 64
    n = shape[0] * shape[1]
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (n // 2, 1), dtype=torch.uint8, device="cuda", generator=g)
    n_blocks = n // blocksize
    state2 = SimpleNamespace(
        absmax=torch.rand(-(-n_blocks // 256), device="cuda", generator=g) + 0.5,
        code=torch.linspace(-1, 1, 256, device="cuda"),
        blocksize=256,
    )
    state = SimpleNamespace(
        absmax=torch.randint(0, 256, (n_blocks,), dtype=torch.uint8, device="cuda", generator=g),
        shape=torch.Size(shape), dtype=torch.bfloat16, blocksize=blocksize, quant_type="nf4",
        code=torch.tensor(NF4_CODE, device="cuda"), offset=torch.tensor(0.25, device="cuda"), state2=state2,
        nested=True,
    )  # fmt: skip
    assert torch.equal(dequantize_bnb_4bit(packed, state), flat_reference(packed, state))
    prepared = prepare_bnb_4bit(packed, state)
    compiled = torch.compile(lambda: dequantize_traceable(prepared, torch.bfloat16), fullgraph=True)
    assert torch.equal(compiled(), flat_reference(packed, state))  # fp fusion is on there: still two roundings
