"""SwiGLU / GeGLU kernels: output and both gradients against float64; in-place backward rules."""

from __future__ import annotations

import pytest
import torch
from reference import (
    DEVICE, UNIT_ROUNDOFF, assert_close_dtype, assert_compile_for_gpus, f64, geglu_ref, needs_kernels,
    real_shapes, swiglu_ref, tolerance, without_gpu,
)

from unsloth_kernels import geglu, swiglu

pytestmark = [
    needs_kernels,
    # sigmoid(x) = 1 / (1 + exp(-x)) overflows exp to inf for very negative x and correctly gives 0;
    # the CPU interpreter (numpy) warns about that, the GPU does not.
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# A single element, an odd width spanning several 1024-element blocks, a 3-D batch.
SHAPES = [(1, 1), (3, 2049), (2, 5, 1000)]
ACTIVATIONS = {
    "swiglu": (swiglu, swiglu_ref),
    "geglu": (geglu, geglu_ref),
    "geglu_tanh": (lambda g, u: geglu(g, u, approximate="tanh"), lambda g, u: geglu_ref(g, u, "tanh")),
}


def make_inputs(shape, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    # gate spread over [-9, 9]: both tails of the activation and its derivative are exercised
    gate = (3 * torch.randn(shape, generator=g)).to(dtype).to(device)
    up = torch.randn(shape, generator=g).to(dtype).to(device)
    dy = torch.randn(shape, generator=g).to(dtype).to(device)
    return gate, up, dy


def exp_argument_factor(gate, dtype):
    """Widening of the tolerance for results that went through exp(+-c * gate).

    GPUs compute exp(x) as 2^(x * log2(e)); rounding that product to fp32 shifts the result by a
    relative |x| * u(fp32). sigmoid, erf and their derivatives carry it into the activation and
    both gradients, so a result may be off by up to max|gate| * u(fp32) more (relative) than the
    usual rule allows: 1 ulp per unit of |gate|, e.g. 18 ulp at |gate| = 18. It matters in fp32
    only; in 16-bit dtypes it is far below one rounding.
    """
    extra = gate.abs().max().item() * UNIT_ROUNDOFF[torch.float32] if gate.numel() else 0.0
    return 1.0 + extra / tolerance(dtype)


def check_against_float64(name, shape, dtype, device=DEVICE):
    fn, ref = ACTIVATIONS[name]
    gate, up, dy = make_inputs(shape, dtype, device)
    factor = exp_argument_factor(gate, dtype)
    gate_leaf, up_leaf = gate.clone().requires_grad_(), up.clone().requires_grad_()
    y = fn(gate_leaf * 1, up_leaf * 1)  # intermediate activations, as in a model: in-place backward
    y.backward(dy)
    gr, ur = f64(gate, up)
    yr = ref(gr, ur)
    yr.backward(dy.double())
    assert y.dtype == dtype
    assert_close_dtype(y, yr, dtype, name="y", factor=factor)
    assert_close_dtype(gate_leaf.grad, gr.grad, dtype, name="d gate", factor=factor)
    assert_close_dtype(up_leaf.grad, ur.grad, dtype, name="d up", factor=factor)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64(dtype, name, shape):
    check_against_float64(name, shape, dtype)


def test_backward_writes_gradients_into_the_activation_buffers():
    gate, up, dy = make_inputs((4, 300), torch.float32)
    gate_leaf, up_leaf = gate.clone().requires_grad_(), up.clone().requires_grad_()
    g, u = gate_leaf * 1, up_leaf * 1
    swiglu(g, u).backward(dy)
    # g and u are dead after backward: their storage now holds d gate and d up.
    assert torch.equal(g.detach(), gate_leaf.grad)
    assert torch.equal(u.detach(), up_leaf.grad)


def test_leaf_inputs_are_never_overwritten():
    gate, up, dy = make_inputs((4, 300), torch.float32)
    gate_leaf, up_leaf = gate.clone().requires_grad_(), up.clone().requires_grad_()
    swiglu(gate_leaf, up_leaf).backward(dy)
    assert torch.equal(gate_leaf.detach(), gate) and torch.equal(up_leaf.detach(), up)
    assert gate_leaf.grad.data_ptr() != gate_leaf.data_ptr()


def test_halves_of_a_fused_gate_up_projection_work_without_copies():
    gate, up, dy = make_inputs((3, 5, 200), torch.float32)
    fused = torch.cat((gate, up), dim=-1).requires_grad_()
    g, u = (fused * 1).chunk(2, dim=-1)  # row stride 400, unit column stride
    swiglu(g, u).backward(dy)
    gr, ur = f64(gate, up)
    swiglu_ref(gr, ur).backward(dy.double())
    assert_close_dtype(fused.grad, torch.cat((gr.grad, ur.grad), dim=-1), torch.float32, name="d fused")


def test_bad_arguments_are_named():
    gate, up, _ = make_inputs((2, 8), torch.float32)
    with pytest.raises(ValueError, match="same shape"):
        swiglu(gate, up[:, :4])
    with pytest.raises(ValueError, match="dtype"):
        swiglu(gate, up.double())
    with pytest.raises(ValueError, match="approximate"):
        geglu(gate, up, approximate="erf")


def test_an_empty_batch_gives_empty_outputs():
    gate = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    y = swiglu(gate, gate.detach().clone())
    y.sum().backward()
    assert y.shape == (0, 8) and gate.grad.shape == (0, 8)


COMPILE_CASES = [
    ("unsloth_kernels.activations", name, dict(ACT=act, BLOCK=1024), 4)
    for name in ("_glu_fwd", "_glu_bwd") for act in (0, 1, 2)
]


@without_gpu
def test_kernels_compile_for_cuda_and_rocm_gpus():
    assert_compile_for_gpus(COMPILE_CASES)


@real_shapes
@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_real_shapes(dtype, name):
    check_against_float64(name, (8, 2048, 14336), dtype, device="cuda")
