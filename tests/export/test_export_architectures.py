"""Every supported architecture: saved model dir -> `unsloth export --gguf f16,q8_0` -> llama.cpp
reproduces transformers' greedy tokens (f16), agrees above the threshold (q8_0), tokenizes the
same, and `unsloth generate` runs on the result."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from export_models import ARCHITECTURES

pytestmark = pytest.mark.slow  # exports and runs models through llama.cpp

N_TOKENS = 16
PROMPTS = ("The capital of France is", "def add(a, b):", "Once upon a time", "Hello world! How")


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    from unsloth.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture(scope="module", params=ARCHITECTURES)
def exported(request, saved_model, tmp_path_factory):
    """(arch, checkpoint dir, JSON report) for one `unsloth export` run per architecture."""
    from unsloth.cli import main

    arch = request.param
    checkpoint = saved_model(arch)
    out = tmp_path_factory.mktemp(f"{arch}-gguf")
    buffer = io.StringIO()  # capsys is function-scoped; this fixture is per module
    with contextlib.redirect_stdout(buffer):
        code = main(["export", str(checkpoint), "--gguf", "f16,q8_0", "--out", str(out), "--json"])
    report = json.loads(buffer.getvalue())
    assert code == 0, report
    return arch, checkpoint, report


def test_export_writes_both_files_and_passes_validation(exported):
    arch, checkpoint, report = exported
    assert report["ok"] is True
    assert set(report["files"]) == {"f16", "q8_0"}
    f16 = report["validation"]["f16"]
    assert f16["identical"] and f16["passed"], f16
    assert f16["tokenizer_mismatches"] == []


def test_f16_greedy_tokens_identical_to_transformers(exported, tokenizer):
    from transformers import AutoModelForCausalLM

    from unsloth.export import runtime
    from unsloth.export.validate import reference_greedy

    arch, checkpoint, report = exported
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32", attn_implementation="eager").eval()
    llm = runtime.load(report["files"]["f16"], n_ctx=128, gpu=False)
    try:
        seen = set()
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            expected, _ = reference_greedy(model, ids, N_TOKENS)
            assert runtime.greedy(llm, ids, N_TOKENS) == expected, prompt
            seen.update(expected)
    finally:
        llm.close()
    assert len(seen) > 4, "the model is degenerate; the comparison would prove nothing"


def test_q8_0_agreement_reported_above_threshold(exported):
    from unsloth.export.validate import QUANT_THRESHOLDS

    q8 = exported[2]["validation"]["q8_0"]
    assert q8["threshold"] == QUANT_THRESHOLDS["q8_0"] == 0.9
    assert q8["agreement"] >= 0.9, q8
    assert q8["passed"]


def test_tokenizer_round_trip_identical(exported, tokenizer):
    from unsloth.export import runtime

    samples = PROMPTS + ("  two  spaces\tand tab\n\nnew lines", "café 🦙 我想 3.14159", "<|im_start|>user\nhi<|im_end|>\n")
    llm = runtime.load(exported[2]["files"]["q8_0"], n_ctx=128, gpu=False)
    try:
        for text in samples:
            ids = tokenizer(text)["input_ids"]
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids, text
            assert llm.detokenize(ids, special=True).decode() == tokenizer.decode(ids), text
    finally:
        llm.close()


def test_gguf_metadata(exported, tokenizer):
    import gguf

    from unsloth.export.architectures import ARCHITECTURES as SPECS

    arch, _, report = exported
    reader = gguf.GGUFReader(report["files"]["f16"])
    fields = {name: field.contents() for name, field in reader.fields.items() if name != "tokenizer.ggml.merges"}
    assert fields["general.architecture"] == SPECS[arch].name
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert fields["tokenizer.ggml.tokens"][:5] == ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def test_generate_on_the_result(exported, capsys):
    code, out = run_cli(capsys, "generate", exported[2]["files"]["q8_0"], "Hello", "--max-tokens", "8", "--json", "--cpu")
    assert code == 0
    result = json.loads(out)
    assert result["ok"] and result["completion_tokens"] == 8 and result["finish_reason"] == "length"
    assert result["prompt_tokens"] > 1  # the chat template was applied around "Hello"
