"""NF4 dequantization: bit-exact against bitsandbytes' own quantize/dequantize (runs on the CPU here).

Exact equality is the right bar: the kernel does the same fp32 products (and sum, for the nested
absmax) as bitsandbytes and rounds once to the output dtype, to nearest-even like torch does.
"""

from __future__ import annotations

import pytest
import torch

from reference import DEVICE, gpu_compile_facts, needs_kernels, real_shapes, without_gpu
import unsloth_kernels.nf4 as nf4
from unsloth_kernels.nf4 import NF4_CODE, dequantize_bnb_4bit, dequantize_nf4

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


def random_state(shape, blocksize, *, nested=True, dtype=torch.bfloat16, device=DEVICE, seed=0):
    """Random packed bytes and a duck-typed QuantState (as bitsandbytes lays it out) on `device`.

    Random bytes exercise every code index; bitsandbytes is not needed, so any blocksize works.
    """
    from types import SimpleNamespace

    n = shape[0] * shape[1]
    n_blocks = -(-n // blocksize)
    g = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, device=device, generator=g)
    state = SimpleNamespace(
        shape=torch.Size(shape), dtype=dtype, blocksize=blocksize, quant_type="nf4",
        code=torch.tensor(NF4_CODE, device=device), nested=nested, state2=None, offset=None,
    )  # fmt: skip
    if nested:
        state.absmax = torch.randint(0, 256, (n_blocks,), dtype=torch.uint8, device=device, generator=g)
        state.state2 = SimpleNamespace(absmax=torch.rand(-(-n_blocks // 256), device=device, generator=g) + 0.5,
                                       code=torch.linspace(-1, 1, 256, device=device), blocksize=256)
        state.offset = torch.tensor(0.25, device=device)
    else:
        state.absmax = torch.rand(n_blocks, device=device, generator=g) * 4
    return packed, state


# Programs of one block up to the largest the tuning sweep tries; shapes that fill whole programs
# (the unmasked path) and shapes that end mid-program, mid-block and mid-byte.
@pytest.mark.parametrize("bytes_per_program", [32, 256, 2048, 8192])
@pytest.mark.parametrize("shape", [(16, 1024), (3, 4096), (5, 100), (1, 1), (1, 63)], ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_program_sizes_and_tails(monkeypatch, bytes_per_program, shape, nested):
    monkeypatch.setattr(nf4, "_BYTES_PER_PROGRAM", bytes_per_program)
    packed, state = random_state(shape, 64, nested=nested)
    assert torch.equal(dequantize_bnb_4bit(packed, state), flat_reference(packed, state))


# Blocks of 2 and 4 elements (fewer bytes than a 4-byte run), bitsandbytes' 32 to 4096, and a
# block larger than a program (8192 elements = 4096 bytes > 2048 per program).
@pytest.mark.parametrize("blocksize", [2, 4, 32, 4096, 8192])
@pytest.mark.parametrize("shape", [(4, 4096), (3, 1000)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_power_of_two_blocksizes(blocksize, shape, dtype):
    packed, state = random_state(shape, blocksize, dtype=dtype)
    assert torch.equal(dequantize_bnb_4bit(packed, state), flat_reference(packed, state))


def test_non_power_of_two_blocksize_is_refused():
    packed, state = random_state((2, 96), 96)
    with pytest.raises(ValueError, match="power of two"):
        dequantize_bnb_4bit(packed, state)


def test_short_nested_absmax_is_refused():
    # 7 x 4096 in blocks of 64 is 448 absmax values: two second-level scales, not one.
    packed, state = random_state((7, 4096), 64)
    state.state2.absmax = state.state2.absmax[:1]
    with pytest.raises(ValueError, match="nested absmax has 1 scales"):
        dequantize_bnb_4bit(packed, state)


@without_gpu
def test_kernel_compiles_for_cuda_and_rocm_with_wide_stores_and_no_shuffle():
    # What the interpreter cannot show: on sm_90 and gfx942 a whole-program launch (EVEN, the real
    # weight shapes) writes 16-byte vectors straight from the registers that computed them, with no
    # layout change through shared memory; the masked tail variant must compile too.
    types = {"packed_ptr": "*u8", "absmax_ptr": "*u8", "code_ptr": "*fp32", "out_ptr": "*bf16",
             "absmax2_ptr": "*fp32", "code2_ptr": "*fp32", "offset_ptr": "*fp32"}
    cases = [
        ("unsloth_kernels.nf4", "_dequantize_4bit_kernel",
         dict(BLOCKSIZE=64, BLOCKSIZE2=256, NESTED=nested, OFFSET_IN_MEMORY=nested, ROUND_BF16=False,
              BLOCKS=nf4._BYTES_PER_PROGRAM // 32, VEC=4, EVEN=even), nf4._WARPS, types)
        for nested, even in ((True, True), (False, True), (True, False))
    ]  # fmt: skip
    for target, facts in gpu_compile_facts(cases).items():
        for (*_, constexprs, _, _), fact in zip(cases, facts):
            if constexprs["EVEN"]:
                assert fact["vector_stores"] and fact["shared"] == 0, (target, constexprs, fact)


@real_shapes
def test_real_shape_on_gpu():
    # Llama-3.1-8B's MLP weight (14336 x 4096), nested absmax; a GPU-side reference of the format
    # (bitsandbytes need not be installed on the GPU machine).
    packed, state = random_state((14336, 4096), 64, device="cuda")
    assert torch.equal(dequantize_bnb_4bit(packed, state), flat_reference(packed, state))
