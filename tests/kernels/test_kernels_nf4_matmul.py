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
# (73, 200, 520), one row and several (with and without bias), each in every form of the kernel. The
# interpreter counts 4 SMs, so up to N = 256 K is split across programs (the two-pass sum); N = 520
# runs in one pass.
CASES = [(1, 72, 320), (1, 73, 200), (3, 200, 576), (2, 72, 200), (8, 520, 320), (16, 200, 320)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-22}


def quantize(n, k, nested, seed=0, blocksize=64):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn((n, k), generator=generator).to(DEVICE)
    return bnb_functional.quantize_4bit(weight, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")


def check(y, x, packed, state, bias, levels_rounded=False, lora=None):
    """`levels_rounded`: the tl.dot form rounds each level to x's dtype before its block's scale, where
    bitsandbytes rounds level * scale: each weight may differ by half an ulp of either. `lora`: the
    (xa, B, scale) nf4_matmul was given, whose update the reference adds in float64."""
    state.dtype = x.dtype
    weight = bnb_functional.dequantize_4bit(packed, state).double()
    ref = x.double().reshape(-1, weight.shape[1]) @ weight.T
    if bias is not None:
        ref = ref + bias.double()
    if lora is not None:
        xa, lora_b, lora_scale = lora
        ref = ref + lora_scale * xa.double().reshape(ref.shape[0], -1) @ lora_b.double().T
    ref = ref.reshape(*x.shape[:-1], weight.shape[0])
    assert y.dtype == x.dtype and y.shape == ref.shape
    # one rounding of the output (half an ulp, relative), plus fp32 sums over K terms of size |x||w|
    scale = x.double().abs().reshape(-1, weight.shape[1]) @ weight.abs().T
    per_weight = 2 * EPS[x.dtype] if levels_rounded and x.dtype != torch.float32 else 1e-6
    tol = EPS[x.dtype] * ref.abs() + per_weight * scale.reshape(ref.shape) + 1e-6
    assert ((y.double() - ref).abs() <= tol).all(), (y.double() - ref).abs().max()


@pytest.fixture(params=nf4_matmul_module.FORMS)
def form(request, monkeypatch):
    """Each form of the kernel (nf4_matmul.FORMS), for one row and for several."""
    for kind in ("one", "few"):
        block_n, block_k, warps, programs_per_sm, _, *stages = nf4_matmul_module.NF4_MATMUL_TUNING[kind]
        monkeypatch.setitem(nf4_matmul_module.NF4_MATMUL_TUNING, kind,
                            (block_n, block_k, warps, programs_per_sm, request.param, *stages))  # fmt: skip
    return request.param


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", CASES, ids=str)
def test_matches_float64_reference(m, n, k, dtype, nested, form):
    if form != "reduce" and not nested and dtype != torch.bfloat16:
        pytest.skip("the dtypes' rounding is covered with nested scales")
    packed, state = quantize(n, k, nested)
    x = torch.randn((m, k), device=DEVICE).to(dtype)
    use_bias = (m + n) % 2 == 0  # with and without bias across the cases, not doubling them
    bias = torch.randn(n, device=DEVICE).to(dtype) if use_bias else None
    y = nf4_matmul(x, prepare_bnb_4bit(packed, state), bias)
    check(y, x, packed, state, bias, levels_rounded=form != "reduce" and nf4_matmul_module._dot_applies(k, 64))


@pytest.mark.parametrize("m,n,k", [(1, 72, 320), (3, 200, 576), (8, 520, 320), (5, 73, 200)], ids=str)
def test_a_lora_update_in_the_epilogue(m, n, k, form):
    """nf4_matmul(lora=(x A^T, B, scale)) adds the LoRA update in whichever pass writes the output: the
    kernel's own (one K split, N = 520) or the sum of the splits; fp32 B with bf16 x as peft may hold it."""
    packed, state = quantize(n, k, nested=True)
    x = torch.randn((m, k), device=DEVICE).to(torch.bfloat16)
    rank = 4 if n % 2 else 8
    xa = (x.float() @ torch.randn((rank, k), device=DEVICE).T / k**0.5).to(torch.bfloat16)
    lora = (xa, torch.randn((n, rank), device=DEVICE), 0.75)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16) if m % 2 else None
    y = nf4_matmul(x, prepare_bnb_4bit(packed, state), bias, lora=lora)
    check(y, x, packed, state, bias, levels_rounded=form != "reduce" and nf4_matmul_module._dot_applies(k, 64),
          lora=lora)  # fmt: skip
    with pytest.raises(ValueError, match="LoRA B weight"):
        nf4_matmul(x, prepare_bnb_4bit(packed, state), bias, lora=(xa, lora[1].T.contiguous(), 0.75))


@pytest.mark.parametrize("m", [1, 4])
def test_a_block_longer_than_the_step(m, form):
    """blocksize 128 over 64-column steps: each step reads half a block's scale group."""
    packed, state = quantize(40, 384, nested=True, blocksize=128)
    x = torch.randn((m, 384), device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(40, device=DEVICE).to(torch.bfloat16)
    y = nf4_matmul(x, prepare_bnb_4bit(packed, state), bias)
    check(y, x, packed, state, bias, levels_rounded=form != "reduce")


@pytest.mark.parametrize("x_halves", [True, False], ids=["x halves", "x strided"])
@pytest.mark.parametrize("stages", [(), (3,)], ids=["unpipelined", "3 stages"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_dot_steps_of_several_blocks(monkeypatch, nested, stages, x_halves):
    """Two absmax blocks a step over K = 9 blocks split across programs: a split's last step is half
    past its end (that block is read again and scaled by zero). Pipelined too (on a GPU the weight's
    loads then run steps ahead of their use; the interpreter runs the loop as written). x read as each
    block's halves (the default) and with its even and odd columns strided."""
    monkeypatch.setitem(nf4_matmul_module.NF4_MATMUL_TUNING, "few", (32, 128, 4, 2, "dot_w_a", *stages))
    monkeypatch.setattr(nf4_matmul_module, "X_HALVES", x_halves)
    packed, state = quantize(72, 576, nested)
    x = torch.randn((3, 576), device=DEVICE).to(torch.bfloat16)
    check(nf4_matmul(x, prepare_bnb_4bit(packed, state)), x, packed, state, None, levels_rounded=True)


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


@pytest.mark.parametrize("m,n,k", [(1, 72, 320), (3, 200, 576), (8, 520, 320)], ids=str)
def test_the_second_pass_left_to_a_compiled_graph(monkeypatch, m, n, k):
    """SUM_IN_GRAPH: in a compiled graph the op gives each K split's fp32 sums (several splits for N of 72
    and 200 on the interpreter's 4 SMs, one for 520) and the graph adds them, the bias and the LoRA term."""
    monkeypatch.setattr(nf4_matmul_module, "SUM_IN_GRAPH", True)
    packed, state = quantize(n, k, nested=True)
    prepared = prepare_bnb_4bit(packed, state)
    x = torch.randn((m, k), device=DEVICE).to(torch.bfloat16)
    xa = (x.float() @ torch.randn((4, k), device=DEVICE).T / k**0.5).to(torch.bfloat16)
    lora = (xa, torch.randn((n, 4), device=DEVICE), 0.75)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(lambda x: nf4_matmul(x, prepared, bias, lora=lora), backend=backend, fullgraph=True)
    y = step(x)
    ops = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert any("nf4_matmul_partials" in op for op in ops) and not any(op.endswith("nf4_matmul") for op in ops)
    check(y, x, packed, state, bias, lora=lora)
    torch.testing.assert_close(y, nf4_matmul(x, prepared, bias, lora=lora), rtol=2**-8, atol=1e-3)  # eager: 2 passes
    offset = nf4_matmul_module.offset_tensor(prepared)
    weight = (prepared.data, prepared.scales, prepared.code, prepared.absmax2, prepared.code2, offset)
    torch.library.opcheck(nf4_matmul_module._nf4_partials_op, (x, *weight, n, prepared.blocksize, prepared.blocksize2,
                                                               prepared.nested, prepared.nf4))  # fmt: skip


def test_above_the_unrolled_ranks_the_graphs_size_does_not_grow_with_the_lora_rank(monkeypatch):
    """With the second pass in the graph, the LoRA term is added rank by rank up to UNROLL_RANK (elementwise:
    a few nodes a rank) and is one reduction over the rank above it: r=64 makes the same graph as r=32."""
    monkeypatch.setattr(nf4_matmul_module, "SUM_IN_GRAPH", True)
    monkeypatch.setattr(nf4_matmul_module, "UNROLL_RANK", 8)
    packed, state = quantize(200, 576, nested=True)
    prepared = prepare_bnb_4bit(packed, state)
    x = torch.randn((3, 576), device=DEVICE).to(torch.bfloat16)

    def nodes(rank):
        lora = (torch.randn((3, rank), device=DEVICE).to(torch.bfloat16), torch.randn((200, rank), device=DEVICE), 0.5)
        graphs = []
        step = torch.compile(lambda x: nf4_matmul(x, prepared, lora=lora), fullgraph=True, dynamic=False,
                             backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)  # fmt: skip
        check(step(x), x, packed, state, None, lora=lora)
        return len(graphs[0].graph.nodes)

    assert nodes(64) == nodes(32) < nodes(4) < nodes(8)


def _run_ptx(asm: str, word: int) -> dict:
    """The integer PTX of `levels_asm` run in Python, `prmt` as the PTX ISA defines it (its default mode:
    a selector's bit 3 replicates the picked byte's sign)."""
    import re

    def prmt(a, b, c):
        pool, out = (b << 32) | a, 0
        for i in range(4):
            sel = (c >> 4 * i) & 0xF
            byte = (pool >> 8 * (sel & 7)) & 0xFF
            out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << 8 * i
        return out

    regs = {"$4": word}
    ops = {"mov": lambda a: a, "and": lambda a, b: a & b, "shr": lambda a, b: a >> b, "or": lambda a, b: a | b,
           "prmt": prmt}  # fmt: skip
    for op, operands in re.findall(r"\b(mov|and|shr|or|prmt)\.\w+ ([^;]+);", asm):
        dest, *sources = (part.strip() for part in operands.split(","))
        regs[dest] = ops[op](*(regs[s] if s in regs else int(s, 0) for s in sources)) & 0xFFFFFFFF
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_register_lookup_of_the_levels_gives_each_nibble_its_level(dtype):
    """levels_asm (the GPU's lookup, which the interpreter cannot run) on random packed bytes: $0/$1 hold
    the high nibbles' levels of bytes 0-1/2-3, $2/$3 the low nibbles', low half first, in x's dtype."""
    from unsloth_kernels.nf4 import NF4_CODE

    asm = nf4_matmul_module.levels_asm(NF4_CODE, dtype)
    bits = [b & 0xFFFF for b in torch.tensor(NF4_CODE).to(dtype).view(torch.int16).tolist()]
    words = torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64).tolist()
    for word in words + [0, 0xFFFFFFFF, 0x01234567, 0x89ABCDEF]:
        regs = _run_ptx(asm, word)
        packed = [(word >> 8 * j) & 0xFF for j in range(4)]
        high, low = [bits[b >> 4] for b in packed], [bits[b & 0xF] for b in packed]
        assert [regs[r] for r in ("$0", "$1", "$2", "$3")] == [
            high[0] | high[1] << 16, high[2] | high[3] << 16, low[0] | low[1] << 16, low[2] | low[3] << 16]


def test_the_levels_asm_survives_inductor_s_generated_source():
    """Inductor writes a user kernel's constexpr values (repr) into a source it keeps inside a ''' string
    and loads later; a newline in the PTX then ended its string literal and the compiled decode step
    fell back to eager. The value must come back whole through both quotings."""
    from unsloth_kernels.nf4 import NF4_CODE

    asm = nf4_matmul_module.levels_asm(NF4_CODE, torch.bfloat16)
    source = eval("'''" + f"constants = {{'LEVELS_ASM': {asm!r}}}" + "'''")  # the generated file's text
    scope: dict = {}
    exec(source, scope)  # the generated file, loaded
    assert scope["constants"]["LEVELS_ASM"] == asm


def test_the_levels_asm_is_built_where_the_compiled_step_traces_the_launch():
    """torch.compile runs the op's launch under fake tensors, whose values cannot be read: building the
    PTX there from a tensor's values broke the decode step's graph at every projection."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from unsloth_kernels.nf4 import NF4_CODE

    expected = {dtype: nf4_matmul_module.levels_asm(NF4_CODE, dtype) for dtype in (torch.bfloat16, torch.float16)}
    nf4_matmul_module.levels_asm.cache_clear()
    with FakeTensorMode():
        assert {dtype: nf4_matmul_module.levels_asm(NF4_CODE, dtype) for dtype in expected} == expected
