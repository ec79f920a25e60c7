"""Inside a compiled decode step a QLoRA model's 4-bit base projections dequantize with our kernel and
multiply (a prompt) or run our nf4_matmul (2-16 rows, one too with UNSLOTH_NF4_DECODE=1) instead of
bitsandbytes' dequantize-then-matmul, with the same greedy tokens; UNSLOTH_NF4_DECODE=0 keeps bitsandbytes'."""

from __future__ import annotations

import pytest
import torch

from tiny_families import save_tiny
from unsloth.models import generation

pytest.importorskip("bitsandbytes")
from unsloth_kernels._utils import INTERPRET  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="nf4_matmul runs on a GPU or under TRITON_INTERPRET=1")


def _qlora_llama(tmp_path):
    from unsloth.models.loader import add_lora, load_pretrained

    model, _ = load_pretrained(str(save_tiny("llama", tmp_path / "llama")), max_seq_length=64, dtype="float32",
                               load_in_4bit=True)  # fmt: skip
    model = add_lora(model, r=4, lora_alpha=8, random_state=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)  # large enough that the adapters change the tokens
    return model.eval()


def _count_calls(monkeypatch, module_name="unsloth_kernels.nf4_matmul", name="nf4_matmul"):
    import importlib

    module = importlib.import_module(module_name)
    calls, original = [], getattr(module, name)  # each call: whether it was given a LoRA update to add
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(k.get("lora") is not None) or original(*a, **k))
    return calls


def test_greedy_tokens_are_the_same_with_each_4bit_decode_path(tmp_path, monkeypatch):
    """On the CPU transformers does not compile the decode step, so the compiled step's branch is taken by
    saying we are compiling: the patched forwards then run as they do in the graph (peft's, on our base)."""
    import unsloth.models.kernels as kernels

    model = _qlora_llama(tmp_path)
    generation.enable(model)
    monkeypatch.setattr(kernels, "compiling", lambda: True)
    fused = _count_calls(monkeypatch)
    dequantized = _count_calls(monkeypatch, "unsloth_kernels.nf4", "dequantize_traceable")
    ids = torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    tokens = {}
    for flag in ("0", "1", ""):
        fused.clear(), dequantized.clear()
        monkeypatch.setenv("UNSLOTH_NF4_DECODE", flag)
        tokens[flag] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                      pad_token_id=0, eos_token_id=None)  # fmt: skip
        # the prompt (14 rows) and each decode step (2 rows) take nf4_matmul unless =0: 7 projections a layer,
        # each adding its adapter's update in the same pass
        assert len(fused) % 7 == 0 and (bool(fused), bool(dequantized)) == (flag != "0", False) and all(fused)
    assert torch.equal(tokens["0"], tokens["1"])
    assert torch.equal(tokens["0"], tokens[""])


def _peft_over_4bit(out_features=72):
    """A peft LoRA layer (random, non-zero adapters) over one bitsandbytes NF4 Linear4bit, 64 in."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = torch.nn.Sequential(bnb.nn.Linear4bit(64, out_features, bias=True, compute_dtype=torch.float32,
                                                quant_type="nf4", compress_statistics=True))  # fmt: skip
    net[0].weight = bnb.nn.Params4bit(torch.randn(out_features, 64), requires_grad=False, quant_type="nf4",
                                      compress_statistics=True)._quantize("cpu")  # fmt: skip
    return get_peft_model(net, LoraConfig(r=4, target_modules=["0"], init_lora_weights=False)).eval()


def test_a_weight_bitsandbytes_repacked_for_its_cpu_kernel_keeps_peft_s_path(monkeypatch):
    """bitsandbytes repacks a 4-bit weight for its AVX512-BF16 CPU kernel on the first eval forward
    without gradients. Patched after that, the layer keeps peft's (correct) forward instead of our
    kernels, which read the canonical layout; nf4_matmul's preparation refuses that layout outright."""
    from unsloth.models.patches.lora import lora_weights, patch_lora
    from unsloth_kernels.nf4 import prepare_bnb_4bit

    peft = _peft_over_4bit(128)  # bitsandbytes' CPU layout takes whole 32-row blocks
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = peft(x)  # repacks, where this CPU has AVX512-BF16
    base = peft.base_model.model[0].base_layer
    if not getattr(base.weight.quant_state, "packing_format_for_cpu", False):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes does not repack here")
    patch_lora(peft)
    assert lora_weights(peft.base_model.model[0]) is None
    monkeypatch.setenv("UNSLOTH_NF4_DECODE", "1")
    with torch.no_grad():
        torch.testing.assert_close(peft(x), expected)
    with pytest.raises(ValueError, match="CPU inference layout"):
        prepare_bnb_4bit(base.weight, base.weight.quant_state)


@pytest.mark.parametrize("flag,rows", [("", 1), ("1", 1), ("", 3), ("", 20), ("0", 3)])
def test_a_4bit_lora_layer_compiles_into_one_graph_on_each_decode_path(flag, rows, monkeypatch):
    """The real compiled branch: a peft LoRA layer over a 4-bit base, fullgraph, gives peft's output.
    2-16 rows take the fused kernel, one row bitsandbytes' GEMV unless =1 asks for ours, more rows our
    dequantization; =0 keeps bitsandbytes' throughout."""
    from unsloth.models.patches.lora import patch_lora

    peft = _peft_over_4bit()
    x = torch.randn(rows, 64)
    with torch.no_grad():
        patch_lora(peft)  # first: it keeps bitsandbytes from repacking the weight for its CPU kernel
        expected = peft(x)  # peft over bitsandbytes' matmul_4bit (not compiling: our decode path is off)
        monkeypatch.setenv("UNSLOTH_NF4_DECODE", flag)
        fused = _count_calls(monkeypatch)
        dequantized = _count_calls(monkeypatch, "unsloth_kernels.nf4", "dequantize_traceable")
        torch._dynamo.reset()
        got = torch.compile(peft, fullgraph=True, dynamic=False)(x)
    kernel = flag != "0" and (rows > 1 or flag == "1")
    assert (bool(fused), bool(dequantized)) == (kernel and rows <= 16, kernel and rows > 16)
    assert all(fused)  # the LoRA update added in nf4_matmul's pass, not by peft after it
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the decode benches compile the real step")
@pytest.mark.parametrize("sum_in_graph", [False, True], ids=["two passes", "sums in the graph"])
def test_the_decode_step_is_one_graph_with_the_op_in_its_gpu_form(tmp_path, sum_in_graph):
    """The tests above run nf4_matmul as the interpreter's opaque custom op; on a GPU it is a triton_op whose
    launch torch.compile runs under fake tensors, and a launch that read a tensor's values there broke the
    decode step's graph at every projection. decode_graph.py traces a tiny QLoRA decode step with the op in
    that form, in a process without the interpreter (nothing is launched): one graph, every projection;
    with nf4_matmul.SUM_IN_GRAPH (the default), every projection as the first pass alone."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "UNSLOTH_NF4_DECODE")}
    env["UNSLOTH_NF4_SUM_IN_GRAPH"] = "1" if sum_in_graph else "0"
    script = pathlib.Path(__file__).with_name("decode_graph.py")
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["triton_op"], report
    assert (len(report["graphs"]), report["breaks"], report["nf4_matmul"]) == (1, 0, 14), report  # 2 layers x 7
    assert report["partials"] == (14 if sum_in_graph else 0), report
    # the lm_head only: x A^T is a product and a sum (one fused reduction), B is applied in nf4_matmul's pass
    assert report["linear"] == 1, report
