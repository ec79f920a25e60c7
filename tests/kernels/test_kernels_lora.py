"""LoRA linear / QKV / gated MLP against a float64 composition (peft's semantics) and peft itself.

Tolerances: each projection rounds its matmul outputs to the dtype (x A^T, then y after the LoRA
term is folded in), and the MLP adds e, g, h, dh, d(gate), d(up) and (dY B). The longest chain, the
gate's dA/dB, goes through about 10 roundings to `dtype` where `assert_close_dtype` budgets 4,
hence `CHAIN_FACTOR` = 4 (rounded up from 10/4) for results that go through the whole MLP; single
projections are held to the plain bound.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from reference import DEVICE, assert_close_dtype, f64, needs_kernels, real_shapes, without_gpu

from unsloth_kernels.activations import ACT_CODES
from unsloth_kernels.lora import LoraWeights, lora_linear, lora_mlp, lora_o, lora_o_forward, lora_qkv

pytestmark = needs_kernels
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CHAIN_FACTOR = 4
ACTIVATION_REF = {
    "swiglu": F.silu,
    "geglu": F.gelu,
    "geglu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # inputs drawn in the tests are the same whatever runs first


def make_lora(out_features, in_features, dtype, *, rank=4, alpha=8, bias=False, seed=0, device=DEVICE):
    """A LoRA linear with B != 0 (peft starts B at zero, which would hide half the math)."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(device, dtype)
    A = (torch.randn(rank, in_features, generator=g) / in_features**0.5).to(device, dtype).requires_grad_()
    B = (torch.randn(out_features, rank, generator=g) / rank**0.5).to(device, dtype).requires_grad_()
    b = (torch.randn(out_features, generator=g) * 0.1).to(device, dtype).requires_grad_() if bias else None
    return LoraWeights(weight, A, B, alpha / rank, bias=b)


def as_f64(p: LoraWeights, weight=None) -> LoraWeights:
    """The same projection in float64, with fresh leaves to collect reference gradients."""
    dense = p.weight if weight is None else weight
    return LoraWeights(dense.double(), f64(p.A), f64(p.B), p.scaling, bias=None if p.bias is None else f64(p.bias))


def linear_ref(x, p: LoraWeights):
    return F.linear(x, p.weight, p.bias) + p.scaling * (x @ p.A.t()) @ p.B.t()


def check_grads(p: LoraWeights, ref: LoraWeights, dtype, n_reduce, name, factor=1.0):
    assert p.A.grad.dtype == p.A.dtype and p.B.grad.dtype == p.B.dtype
    assert_close_dtype(p.A.grad, ref.A.grad, dtype, n_reduce=n_reduce, name=f"{name}.dA", factor=factor)
    assert_close_dtype(p.B.grad, ref.B.grad, dtype, n_reduce=n_reduce, name=f"{name}.dB", factor=factor)
    if p.bias is not None:
        assert_close_dtype(p.bias.grad, ref.bias.grad, dtype, n_reduce=n_reduce, name=f"{name}.dbias", factor=factor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7])
def test_lora_linear(rows, dtype):
    x = torch.randn(rows, 24, dtype=dtype, device=DEVICE).requires_grad_()  # hidden 24: not a power of two
    p = make_lora(40, 24, dtype, bias=True)
    y = lora_linear(x, p.weight, p.A, p.B, p.scaling, bias=p.bias)
    dy = torch.randn_like(y)
    y.backward(dy)

    ref, x_ref = as_f64(p), f64(x)
    expected = linear_ref(x_ref, ref)
    expected.backward(dy.double())
    assert_close_dtype(y, expected, dtype, n_reduce=24, name="y")
    assert_close_dtype(x.grad, x_ref.grad, dtype, n_reduce=40, name="dX")
    check_grads(p, ref, dtype, n_reduce=rows, name="linear")


def test_lora_linear_with_nf4_base_and_fp32_adapters():
    # QLoRA as peft sets it up: 4-bit base, bf16 activations, fp32 A/B (their grads come back fp32).
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    dense = make_lora(64, 128, torch.float32)
    packed, state = bnb_functional.quantize_4bit(dense.weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    state.dtype = torch.bfloat16
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16, device=DEVICE).requires_grad_()
    y = lora_linear(x, packed, dense.A, dense.B, dense.scaling, base_quant_state=state)
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    y.backward(dy)

    weight = bnb_functional.dequantize_4bit(packed, state)  # what the kernel must be multiplying by
    # The adapters are used in bf16, as autocast would: round them first for the reference.
    rounded = LoraWeights(weight, dense.A.detach().bfloat16(), dense.B.detach().bfloat16(), dense.scaling)
    ref, x_ref = as_f64(rounded), f64(x)
    linear_ref(x_ref, ref).backward(dy.double())
    assert_close_dtype(y, linear_ref(x_ref, ref), torch.bfloat16, n_reduce=128, name="y")
    assert_close_dtype(x.grad, x_ref.grad, torch.bfloat16, n_reduce=64, name="dX")
    assert dense.A.grad.dtype == torch.float32
    assert_close_dtype(dense.A.grad, ref.A.grad, torch.bfloat16, n_reduce=6, name="dA")
    assert_close_dtype(dense.B.grad, ref.B.grad, torch.bfloat16, n_reduce=6, name="dB")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lora_qkv_accumulates_dx_from_all_three(dtype):
    # GQA widths: Q 48, K/V 16 from hidden 24; different ranks (so scalings) exercise the stacked A.
    x = torch.randn(2, 5, 24, dtype=dtype, device=DEVICE).requires_grad_()
    shapes = ((48, 4), (16, 8), (16, 2))  # (out, rank)
    q, k, v = (make_lora(n, 24, dtype, rank=r, seed=s, bias=s == 1) for s, (n, r) in enumerate(shapes))
    outputs = lora_qkv(x, q, k, v)
    grads = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(outputs, grads)

    refs, x_ref = [as_f64(p) for p in (q, k, v)], f64(x)
    expected = [linear_ref(x_ref, r) for r in refs]
    torch.autograd.backward(expected, [g.double() for g in grads])
    for name, out, exp in zip("QKV", outputs, expected):
        assert out.shape == exp.shape
        assert_close_dtype(out, exp, dtype, n_reduce=24, name=name)
    assert_close_dtype(x.grad, x_ref.grad, dtype, n_reduce=80, name="dX")
    for name, p, r in zip("qkv", (q, k, v), refs):
        check_grads(p, r, dtype, n_reduce=10, name=name)


def mlp_ref(x, gate, up, down, activation):
    return linear_ref(ACTIVATION_REF[activation](linear_ref(x, gate)) * linear_ref(x, up), down)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(ACTIVATION_REF))
@pytest.mark.parametrize("rank", [4, 40, 80], ids=lambda r: f"r{r}")  # folded into the kernels up to 64, then not
def test_lora_mlp(activation, dtype, rank):
    hidden, inter = 24, 40
    x = torch.randn(3, hidden, dtype=dtype, device=DEVICE).requires_grad_()
    gate, up = (make_lora(inter, hidden, dtype, seed=1, rank=rank),
                make_lora(inter, hidden, dtype, seed=2, bias=True, rank=rank))
    down = make_lora(hidden, inter, dtype, seed=3, rank=rank)
    out = lora_mlp(x, gate, up, down, activation)
    dout = torch.randn_like(out)
    out.backward(dout)

    refs, x_ref = [as_f64(p) for p in (gate, up, down)], f64(x)
    expected = mlp_ref(x_ref, *refs, activation)
    expected.backward(dout.double())
    assert_close_dtype(out, expected, dtype, n_reduce=inter, name="out", factor=CHAIN_FACTOR)
    assert_close_dtype(x.grad, x_ref.grad, dtype, n_reduce=inter, name="dX", factor=CHAIN_FACTOR)
    for name, p, r in zip(("gate", "up", "down"), (gate, up, down), refs):
        check_grads(p, r, dtype, n_reduce=3, name=name, factor=CHAIN_FACTOR)


def test_lora_mlp_with_nf4_bases():
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    dtype, hidden, inter = torch.bfloat16, 64, 128
    projections, dense_weights = [], []
    for seed, (o, i) in enumerate(((inter, hidden), (inter, hidden), (hidden, inter))):
        p = make_lora(o, i, dtype, seed=seed)
        packed, state = bnb_functional.quantize_4bit(p.weight.float(), blocksize=64, compress_statistics=True)
        state.dtype = dtype
        projections.append(LoraWeights(packed, p.A, p.B, p.scaling, quant_state=state))
        dense_weights.append(bnb_functional.dequantize_4bit(packed, state))
    x = torch.randn(4, hidden, dtype=dtype, device=DEVICE).requires_grad_()
    out = lora_mlp(x, *projections)
    dout = torch.randn_like(out)
    out.backward(dout)

    refs = [as_f64(p, weight=w) for p, w in zip(projections, dense_weights)]
    x_ref = f64(x)
    expected = mlp_ref(x_ref, *refs, "swiglu")
    expected.backward(dout.double())
    assert_close_dtype(out, expected, dtype, n_reduce=inter, name="out", factor=CHAIN_FACTOR)
    assert_close_dtype(x.grad, x_ref.grad, dtype, n_reduce=inter, name="dX", factor=CHAIN_FACTOR)
    for name, p, r in zip(("gate", "up", "down"), projections, refs):
        check_grads(p, r, dtype, n_reduce=4, name=name, factor=CHAIN_FACTOR)


def test_matches_peft_modules():
    # peft's own LoRA layers (r=4, alpha=8 -> scaling 2, dropout 0) as the semantic reference.
    peft = pytest.importorskip("peft")

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False)
            self.down_proj = torch.nn.Linear(24, 16, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(MLP().to(DEVICE), config).base_model.model
    layers = (model.gate_proj, model.up_proj, model.down_proj)
    for layer in layers:
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.3)  # peft starts B at 0
    x = torch.randn(5, 16, device=DEVICE)
    dout = torch.randn(5, 16, device=DEVICE)

    model(x).backward(dout)
    expected = [(layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad) for layer in layers]
    model.zero_grad()
    weights = [
        LoraWeights(layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                    layer.scaling["default"])  # fmt: skip
        for layer in layers
    ]
    out = lora_mlp(x, *weights)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    out.backward(dout)
    for layer, (dA, dB) in zip(layers, expected):
        torch.testing.assert_close(layer.lora_A["default"].weight.grad, dA, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.lora_B["default"].weight.grad, dB, rtol=1e-5, atol=1e-6)


def test_matches_peft_on_a_bitsandbytes_4bit_layer():
    # QLoRA as users build it: bnb's Linear4bit (NF4, double quant) wrapped by peft; our path reads
    # the Params4bit and its QuantState directly.
    bnb = pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")

    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4")
            self.proj.weight = bnb.nn.Params4bit(torch.randn(32, 64) * 0.1, requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)  # fmt: skip

        def forward(self, x):
            return self.proj(x)

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["proj"])
    layer = peft.get_peft_model(Proj().to(DEVICE), config).base_model.model.proj
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.nn.init.normal_(B, std=0.3)
    x, dout = torch.randn(5, 64, device=DEVICE), torch.randn(5, 32, device=DEVICE)
    layer(x).backward(dout)
    expected = (layer(x).detach(), A.grad.clone(), B.grad.clone())
    A.grad = B.grad = None

    weight = layer.base_layer.weight
    out = lora_o(x, LoraWeights(weight, A, B, layer.scaling["default"], quant_state=weight.quant_state))
    out.backward(dout)
    for actual, wanted in zip((out, A.grad, B.grad), expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-6)


def test_autocast_runs_in_the_autocast_dtype():
    # fp32 model and adapters under bf16 autocast: computes as nn.Linear would, in bf16;
    # gradients come back in the parameters' (fp32) dtype.
    x = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    gate, up = make_lora(24, 16, torch.float32), make_lora(24, 16, torch.float32, seed=1)
    down = make_lora(16, 24, torch.float32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = lora_mlp(x, gate, up, down)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert out.dtype == torch.bfloat16 and x.grad.dtype == gate.A.grad.dtype == torch.float32

    rounded = [LoraWeights(p.weight.bfloat16(), p.A.detach().bfloat16(), p.B.detach().bfloat16(), p.scaling)
               for p in (gate, up, down)]  # fmt: skip
    refs, x_ref = [as_f64(p) for p in rounded], f64(x.detach().bfloat16())
    expected = mlp_ref(x_ref, *refs, "swiglu")
    expected.backward(dout.double())
    assert_close_dtype(out, expected, torch.bfloat16, n_reduce=24, name="out", factor=CHAIN_FACTOR)
    assert_close_dtype(x.grad, x_ref.grad, torch.bfloat16, n_reduce=24, name="dX", factor=CHAIN_FACTOR)
    check_grads(down, refs[2], torch.bfloat16, n_reduce=3, name="down", factor=CHAIN_FACTOR)


def test_lora_o_is_the_single_projection():
    x = torch.randn(3, 24, device=DEVICE)
    p = make_lora(24, 24, torch.float32)
    torch.testing.assert_close(lora_o(x, p), linear_ref(x, p))


def test_lora_o_replays_a_kept_forward_with_the_same_gradients():
    # A checkpoint's first pass keeps (y, x A^T); the recompute hands them back instead of the matmuls.
    p = make_lora(24, 16, torch.float32)
    x = torch.randn(2, 3, 16, device=DEVICE)
    kept = lora_o_forward(x, p)
    grads = []
    for replay in (None, kept):
        xg = x.clone().requires_grad_()
        p.A.grad = p.B.grad = None
        y = lora_o(xg, p, replay=replay)
        (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
        grads.append((y.detach(), xg.grad, p.A.grad.clone(), p.B.grad.clone()))
    assert torch.equal(grads[1][0], kept[0])  # returned as it was kept
    for plain, replayed in zip(grads[0], grads[1]):
        torch.testing.assert_close(replayed, plain)
    y, xa = kept
    with pytest.raises(ValueError, match="do not fit"):
        lora_o(x, p, replay=(y, xa[:-1]))  # one row short
    with pytest.raises(ValueError, match="do not fit"):
        lora_o(x[:1], p, replay=kept)  # kept for another x


def test_mlp_backward_twice_is_refused():
    # The backward overwrites its saved buffers; a second call must fail, not return garbage.
    gate, up, down = make_lora(8, 4, torch.float32), make_lora(8, 4, torch.float32), make_lora(4, 8, torch.float32)
    out = lora_mlp(torch.randn(2, 4, device=DEVICE, requires_grad=True), gate, up, down).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        out.backward()


def test_bad_inputs_are_named():
    p = make_lora(8, 4, torch.float32)
    trainable_base = LoraWeights(p.weight.clone().requires_grad_(), p.A, p.B, p.scaling)
    with pytest.raises(ValueError, match="frozen"):
        lora_o(torch.randn(2, 4, device=DEVICE), trainable_base)
    with pytest.raises(ValueError, match="does not match"):
        lora_o(torch.randn(2, 4, device=DEVICE), LoraWeights(p.weight.t(), p.A, p.B, p.scaling))
    with pytest.raises(ValueError, match="activation"):
        lora_mlp(torch.randn(2, 4, device=DEVICE), p, p, make_lora(4, 8, torch.float32), activation="relu")
    with pytest.raises(ValueError, match="same width"):
        wide = make_lora(6, 4, torch.float32)
        lora_mlp(torch.randn(2, 4, device=DEVICE), p, wide, make_lora(4, 8, torch.float32))


@real_shapes
def test_real_shape_mlp_on_gpu():
    # Llama-3.1-8B MLP (4096 -> 14336 -> 4096), r=16, 2048 tokens, bf16; fp32 reference.
    dtype, hidden, inter, rows = torch.bfloat16, 4096, 14336, 2048
    gate, up = (make_lora(inter, hidden, dtype, rank=16, alpha=32, seed=s, device="cuda") for s in (1, 2))
    down = make_lora(hidden, inter, dtype, rank=16, alpha=32, seed=3, device="cuda")
    x = torch.randn(rows, hidden, dtype=dtype, device="cuda").requires_grad_()
    out = lora_mlp(x, gate, up, down)
    dout = torch.randn_like(out)
    out.backward(dout)

    refs = [LoraWeights(p.weight.float(), p.A.detach().float().requires_grad_(), p.B.detach().float().requires_grad_(),
                        p.scaling) for p in (gate, up, down)]  # fmt: skip
    x_ref = x.detach().float().requires_grad_()
    expected = mlp_ref(x_ref, *refs, "swiglu")
    expected.backward(dout.float())

    def close(actual, ref, name):  # bf16 storage of a long fp32 chain: ~1% of the tensor's scale
        err = (actual.float() - ref).norm() / ref.norm()
        assert err < 2e-2, f"{name}: relative error {err:.3g}"

    close(out, expected, "out")
    close(x.grad, x_ref.grad, "dX")
    for p, r in zip((gate, up, down), refs):
        close(p.A.grad, r.A.grad, "dA")
        close(p.B.grad, r.B.grad, "dB")


# --- compiling for real GPUs without one ---------------------------------------------------------
# The interpreter cannot catch what only the GPU compiler rejects. Triton's wheel carries the CUDA
# and ROCm backends, so CI compiles the kernels of lora, nf4 and cross_entropy (this file covers
# all three: LoRA uses the other two) for sm_90 and gfx942, in a fresh process without
# TRITON_INTERPRET, and checks the bulk loads/stores are vectors on CUDA (what bandwidth needs).

_COMPILE_SCRIPT = """
import json, re, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
from unsloth_kernels import cross_entropy, lora, nf4
modules = {"cross_entropy": cross_entropy, "lora": lora, "nf4": nf4}
out = []
for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
    for module, name, signature, constexprs, options in json.loads(sys.argv[1]):
        kernel = getattr(modules[module], name)
        signature = {**signature, **{k: "constexpr" for k in constexprs}}
        # Aligned pointers and sizes divisible by 16, as real launches at model shapes specialise.
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names)
                 if signature[arg][0] == "*" or signature[arg] == "i32"}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        ptx = triton_compile(source, target=target, options=options).asm.get("ptx", "")
        out.append(sorted(set(re.findall(r"(?:ld|st)\\.global\\.v[24]", ptx))))
print(json.dumps(out))
"""


def _kernel_cases():
    import unsloth_kernels.lora as lora_module
    import unsloth_kernels.nf4 as nf4_module

    ce_sig = {"logits_ptr": "*bf16", "logits_stride": "i32", "labels_ptr": "*i64", "loss_ptr": "*fp32", "V": "i32",
              "ignore_index": "i32", "softcap": "fp32", "logit_scale": "fp32"}  # fmt: skip
    nf4_sig = {"packed_ptr": "*u8", "absmax_ptr": "*u8", "code_ptr": "*fp32", "out_ptr": "*bf16",
               "absmax2_ptr": "*fp32", "code2_ptr": "*fp32", "offset_ptr": "*fp32", "offset": "fp32", "n_elements": "i32",
               "n_bytes": "i32"}  # fmt: skip
    cases = [
        ("cross_entropy", "_cross_entropy_rows_kernel", ce_sig,
         {"HAS_SCALE": True, "HAS_SOFTCAP": True, "COMPUTE_GRAD": True, "BLOCK_V": 16384}, {"num_warps": 32}),
        ("nf4", "_dequantize_4bit_kernel", nf4_sig,
         {"BLOCKSIZE": 64, "BLOCKSIZE2": 256, "NESTED": True, "OFFSET_IN_MEMORY": True, "OUT_BF16": True,
          "BYTES": nf4_module._BYTES_PER_PROGRAM, "ROW": nf4_module._row_bytes(64)},
         {"num_warps": nf4_module._WARPS, "enable_fp_fusion": False}),
    ]  # fmt: skip
    gated_sig = {name: "*bf16" for name in ("E", "G", "DH", "XA", "DYB")}
    gated_sig.update({name: "*fp32" for name in ("BG", "BU", "AD")})  # LoRA parameters stay fp32
    gated_sig.update({name: "i32" for name in ("n_rows", "n_cols", "stride", "stride_xa", "sbg_r", "sbg_col",
                                               "sbu_r", "sbu_col", "stride_dyb", "sad_r", "sad_col")})
    gated_sig.update(scale_g="fp32", scale_u="fp32")
    block_m, block_n, warps = lora_module.GATED_TILE
    for rank in (16, lora_module._MAX_FOLDED_RANK):
        for activation in ("swiglu", "geglu", "geglu_tanh"):
            for backward in (False, True):  # with every LoRA term folded in: the heaviest variant
                constexprs = {"ACT": ACT_CODES[activation], "BACKWARD": backward, "LORA": True, "LORA_DH": backward,
                              "RANK_G": rank, "RANK_U": rank, "RANK_D": rank, "BLOCK_R": rank, "DOT_FP32": False,
                              "BLOCK_M": block_m, "BLOCK_N": block_n}
                cases.append(("lora", "_gated_kernel", gated_sig, constexprs, {"num_warps": warps}))
    return cases


@without_gpu
def test_kernels_compile_for_cuda_and_rocm_gpus():
    import json
    import subprocess
    import sys

    cases = _kernel_cases()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default, stated so Triton does not warn
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    vectors = json.loads(done.stdout.strip().splitlines()[-1])[: len(cases)]  # the CUDA half has PTX
    for case, found in zip(cases, vectors):
        # NF4 reads half a byte per weight: 16 packed bytes per thread are one 16-byte load.
        wanted = ["ld.global.v4", "st.global.v4"]
        assert set(wanted) <= set(found), f"{case[1]} {case[3]}: wanted {wanted} in PTX, found {found}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_rows", [None, 4], ids=["one chunk", "chunks of 4 rows"])
def test_lora_mlp_without_output_gives_the_gradients(chunk_rows, dtype, monkeypatch):
    """The recompute pass of a checkpointed layer: no output, and every gradient as float64 gives it
    (in token chunks too: 11 rows in chunks of 4, 4, 3)."""
    import unsloth_kernels.lora as lora_module

    hidden, inter, rows = 24, 40, 11
    if chunk_rows:
        monkeypatch.setattr(lora_module, "MLP_CHUNK_BYTES", inter * torch.finfo(dtype).bits // 8 * chunk_rows)
    gate, up = make_lora(inter, hidden, dtype, seed=1), make_lora(inter, hidden, dtype, seed=2, bias=True)
    down = make_lora(hidden, inter, dtype, seed=3, bias=True)
    x = torch.randn(rows, hidden, dtype=dtype, device=DEVICE).requires_grad_()
    out = lora_mlp(x, gate, up, down, output_needed=False)
    assert out.shape == (rows, hidden)
    assert out.count_nonzero() == 0 and out.untyped_storage().nbytes() <= 4  # a stand-in, no buffer
    dout = torch.randn(rows, hidden, dtype=dtype, device=DEVICE)
    (out * 0 + out).backward(dout)  # the output only feeds a sum, as in a residual stream

    refs, x_ref = [as_f64(p) for p in (gate, up, down)], f64(x)
    mlp_ref(x_ref, *refs, "swiglu").backward(dout.double())
    assert_close_dtype(x.grad, x_ref.grad, dtype, n_reduce=inter, name="dX", factor=CHAIN_FACTOR)
    for name, p, r in zip(("gate", "up", "down"), (gate, up, down), refs):
        check_grads(p, r, dtype, n_reduce=rows, name=name, factor=CHAIN_FACTOR)


@pytest.mark.parametrize("rank", [8, 72], ids=["rank 8 (folded, padded to 16)", "rank 72 (separate addmm_)"])
def test_lora_mlp_ranks_on_both_sides_of_the_folding_limit(rank):
    import unsloth_kernels.lora as lora_module

    assert (rank <= lora_module._MAX_FOLDED_RANK) == (rank == 8)
    dtype, hidden, inter = torch.float32, 24, 40
    gate = make_lora(inter, hidden, dtype, rank=rank, seed=1)
    up = make_lora(inter, hidden, dtype, rank=rank, seed=2)
    down = make_lora(hidden, inter, dtype, rank=rank, seed=3)
    x = torch.randn(5, hidden, dtype=dtype, device=DEVICE).requires_grad_()
    out = lora_mlp(x, gate, up, down)
    dout = torch.randn_like(out)
    out.backward(dout)
    refs, x_ref = [as_f64(p) for p in (gate, up, down)], f64(x)
    expected = mlp_ref(x_ref, *refs, "swiglu")
    expected.backward(dout.double())
    assert_close_dtype(out, expected, dtype, n_reduce=inter + rank, name="out", factor=CHAIN_FACTOR)
    assert_close_dtype(x.grad, x_ref.grad, dtype, n_reduce=inter + rank, name="dX", factor=CHAIN_FACTOR)
    for name, p, r in zip(("gate", "up", "down"), (gate, up, down), refs):
        check_grads(p, r, dtype, n_reduce=5, name=name, factor=CHAIN_FACTOR)


def test_lora_mlp_without_autograd_runs_in_chunks_with_the_output(monkeypatch):
    import unsloth_kernels.lora as lora_module

    dtype, hidden, inter = torch.float32, 24, 40
    gate, up = make_lora(inter, hidden, dtype, seed=1), make_lora(inter, hidden, dtype, seed=2, bias=True)
    down = make_lora(hidden, inter, dtype, seed=3, bias=True)
    x = torch.randn(2, 11, hidden, dtype=dtype, device=DEVICE)
    expected = mlp_ref(f64(x), *[as_f64(p) for p in (gate, up, down)], "swiglu").detach()
    with torch.no_grad():
        whole = lora_mlp(x, gate, up, down)
        monkeypatch.setattr(lora_module, "MLP_CHUNK_BYTES", 40 * 4 * 5)  # the 22 tokens in chunks of at most 5
        chunked = lora_mlp(x, gate, up, down)
    for out, name in ((whole, "one chunk"), (chunked, "chunks")):
        assert out.shape == (2, 11, hidden)
        assert_close_dtype(out, expected, dtype, n_reduce=inter, name=name, factor=CHAIN_FACTOR)


def test_fp32_parameters_are_cast_once_while_unchanged():
    """fp32 LoRA parameters of a bf16 layer: the cast each use needs is kept until the parameter
    changes (an in-place write, or an optimizer step through `new_weights`), and results follow
    every change."""
    import unsloth_kernels.lora as lora_module

    dtype = torch.bfloat16
    p = make_lora(48, 32, dtype)
    A, B = (t.detach().float().requires_grad_() for t in (p.A, p.B))
    p32 = LoraWeights(p.weight, A, B, p.scaling)
    x = torch.randn(5, 32, dtype=dtype, device=DEVICE)

    def run():
        return lora_o(x, p32)

    first = run()
    kept = lora_module._in(B, dtype)
    assert kept is lora_module._in(B, dtype) and kept.dtype == dtype  # one cast, reused
    torch.testing.assert_close(run(), first, rtol=0, atol=0)
    with torch.no_grad():
        B.add_(1.0)  # an in-place write bumps the version: a new cast
    assert lora_module._in(B, dtype) is not kept
    changed = run()
    assert not torch.equal(changed, first)
    torch.testing.assert_close(changed, lora_o(x, LoraWeights(p.weight, A.to(dtype), B.to(dtype), p.scaling)),
                               rtol=0, atol=0)
    kept = lora_module._in(B, dtype)
    B.data.add_(1.0)  # a write the version counter does not see (an optimizer's own kernel)...
    assert lora_module._in(B, dtype) is kept
    lora_module.new_weights()  # ...is covered by the optimizer-step hook's call
    assert lora_module._in(B, dtype) is not kept
    torch.testing.assert_close(run(), lora_o(x, LoraWeights(p.weight, A.to(dtype), B.to(dtype), p.scaling)),
                               rtol=0, atol=0)
