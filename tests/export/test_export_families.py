"""Families our converter does not write go through llama.cpp's own converter: a tiny random model of
each -> save_pretrained_gguf (merged 16-bit folder -> convert_hf_to_gguf -> f16) -> llama-cpp-python
reproduces transformers' greedy tokens. Architectures the converter lacks, and configs llama.cpp
would answer differently for, are refused before any work, naming the architecture and the fix.

The slow tests use the converter the export itself finds: UNSLOTH_LLAMA_CPP when set, else the
installed llama-cpp-python's source, fetched once into the user cache."""

from __future__ import annotations

import io
import tarfile
import textwrap

import pytest

from export_models import (LLAMA_CPP_ARCHITECTURES, TINY, fake_tree, family_tokenizer, greedy_agreement, make_model,
                           make_tokenizer)
from test_export_moe import MOE



def test_supported_architectures_read_from_both_layouts(tmp_path):
    from unsloth.export.llama_cpp_converter import supported_architectures

    root = fake_tree(tmp_path / "tree", table=["Qwen3_5ForCausalLM", "GptOssForCausalLM"], registered=["OldForCausalLM"])
    assert supported_architectures(root) == {"Qwen3_5ForCausalLM", "GptOssForCausalLM", "OldForCausalLM"}


def test_unsupported_architecture_refused_before_any_file(tmp_path, monkeypatch):
    from unsloth.export.errors import ExportError
    from unsloth.export.gguf import save_pretrained_gguf

    monkeypatch.setenv("UNSLOTH_LLAMA_CPP", str(fake_tree(tmp_path / "tree", table=["GptOssForCausalLM"])))
    out = tmp_path / "out"
    with pytest.raises(ExportError) as caught:
        save_pretrained_gguf(make_model("olmo2"), out, make_tokenizer(), "f16")
    message = str(caught.value)
    assert "Olmo2ForCausalLM" in message and "'olmo2'" in message and "nothing was written" in message
    assert "pip install -U llama-cpp-python" in caught.value.fix and "UNSLOTH_LLAMA_CPP" in caught.value.fix
    assert not out.exists()


def test_converter_env_must_name_a_llama_cpp_tree(tmp_path, monkeypatch):
    from unsloth.export.errors import ExportError
    from unsloth.export.llama_cpp_converter import find_converter

    monkeypatch.setenv("UNSLOTH_LLAMA_CPP", str(tmp_path))
    with pytest.raises(ExportError, match="is not a llama.cpp tree") as caught:
        find_converter(fetch=False)
    assert "UNSLOTH_LLAMA_CPP" in caught.value.fix


# Configs llama.cpp's converter would write a file for that answers differently (Qwen3-MoE: its graph
# always renormalizes the top-k weights; Llama 4: attention settings it hard-codes), that its loader
# refuses (OLMoE's key norm spans every head) or aborts the process on (a dense Granite 4 asking for
# experts; Llama 4 with no layer of its every-4th-layer attention temperature).
REFUSED_CONFIGS = [
    ("qwen3_moe", "Qwen3MoeForCausalLM", dict(norm_topk_prob=False), "norm_topk_prob=False"),
    ("olmoe", "OlmoeForCausalLM", dict(num_key_value_heads=2), "2 key/value heads for 4 attention heads"),
    ("granitemoehybrid", "GraniteMoeHybridForCausalLM", dict(num_experts_per_tok=2), "num_experts_per_tok=2"),
    ("llama4_text", "Llama4ForCausalLM", dict(attention_chunk_size=64), "'attention_chunk_size': 64"),
    ("llama4_text", "Llama4ForCausalLM", dict(num_hidden_layers=2), "has 2 layers"),
]


@pytest.mark.parametrize("arch, architecture, overrides, problem", REFUSED_CONFIGS)
def test_config_llama_cpp_cannot_represent_is_refused_before_any_file(arch, architecture, overrides, problem,
                                                                      tmp_path, monkeypatch):
    from unsloth.export.errors import ExportError
    from unsloth.export.gguf import save_pretrained_gguf

    monkeypatch.setenv("UNSLOTH_LLAMA_CPP", str(fake_tree(tmp_path / "tree", table=[architecture])))
    with pytest.raises(ExportError, match="nothing was written") as caught:
        save_pretrained_gguf(make_model(arch, **overrides), tmp_path / "out", make_tokenizer(), "f16")
    assert problem in str(caught.value) and caught.value.fix
    assert not (tmp_path / "out").exists()


def test_only_the_converter_is_unpacked_from_the_sdist(tmp_path):
    from unsloth.export.llama_cpp_converter import extract_converter

    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    files = {
        "vendor/llama.cpp/convert_hf_to_gguf.py": "print('converter')\n",
        "vendor/llama.cpp/conversion/__init__.py": "",
        "vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
        "vendor/llama.cpp/ggml/src/ggml.c": "int main;\n",
        "vendor/llama.cpp/models/ggml-vocab-llama.gguf": "big\n",
        "llama_cpp/llama.py": "",
    }
    with tarfile.open(sdist, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    root = extract_converter(sdist, tmp_path / "tree")
    kept = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert kept == ["conversion/__init__.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py"]


def test_a_tokenizer_llama_cpp_cannot_name_is_refused_with_the_fix(tmp_path, monkeypatch):
    """The driver names an unknown pre-tokenizer from tokenizer.json; a split rule llama.cpp does not
    implement comes back from the child process as our refusal, not a traceback."""
    from tokenizers import pre_tokenizers

    from unsloth.export.errors import ExportError
    from unsloth.export.llama_cpp_converter import LlamaCppConverter, convert

    root = fake_tree(tmp_path / "tree")
    (root / "conversion" / "__init__.py").write_text(textwrap.dedent('''
        import json
        from pathlib import Path
        class ModelType:
            TEXT = 0
        class ModelBase:
            @staticmethod
            def load_hparams(model_dir, mistral):
                return json.loads((Path(model_dir) / "config.json").read_text())
            def get_vocab_base_pre(self, tokenizer):
                raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")
        class Model(ModelBase):
            def __init__(self, model_dir, *args, **kwargs):
                from transformers import AutoTokenizer
                self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            def write(self):
                self.get_vocab_base_pre(self.tokenizer)
        def get_model_architecture(hparams, model_type):
            return hparams["architectures"][0]
        def get_model_class(name, mmproj=False):
            return Model
    '''))
    (root / "gguf-py" / "gguf").mkdir()
    (root / "gguf-py" / "gguf" / "__init__.py").write_text(
        "class LlamaFileType:\n    ALL_F32 = MOSTLY_F16 = MOSTLY_BF16 = 0\n")
    model_dir = tmp_path / "model"
    (model_dir).mkdir()
    (model_dir / "config.json").write_text('{"architectures": ["Olmo2ForCausalLM"], "vocab_size": 384}')
    whitespace = make_tokenizer(pre_tokenizer=pre_tokenizers.Whitespace())
    whitespace.save_pretrained(model_dir)
    with pytest.raises(ExportError, match="pre-tokenizer .* is not one llama.cpp implements") as caught:
        convert(LlamaCppConverter(root, "test tree"), model_dir, tmp_path / "out.gguf", "f16")
    assert "byte-level BPE" in caught.value.fix


@pytest.fixture(scope="module")
def converter():
    from unsloth.export.llama_cpp_converter import find_converter

    return find_converter()


@pytest.mark.slow
# gpt-oss and Qwen3-MoE also export in test_export_moe, with LoRA merged into their experts: that run
# covers this one, so CI's time is not spent on both.
@pytest.mark.parametrize("arch", [arch for arch in LLAMA_CPP_ARCHITECTURES if arch not in MOE])
def test_family_exports_through_llama_cpp_and_matches_transformers(arch, converter, tmp_path):
    from unsloth.export import runtime
    from unsloth.export.gguf import save_pretrained_gguf
    from unsloth.export.llama_cpp_converter import hf_architecture

    model = make_model(arch)
    assert hf_architecture(model) in converter.architectures, f"{converter.origin} lacks {arch}"
    tokenizer = family_tokenizer(arch)
    result = save_pretrained_gguf(model, tmp_path, tokenizer, "f16")
    report = result.validations["f16"]
    assert report.passed and report.tokenizer_mismatches == [], report.summary()
    assert [p.name for p in tmp_path.iterdir()] == ["model.F16.gguf"]  # the merged folder is gone

    llm = runtime.load(result.files["f16"], n_ctx=128, gpu=False)
    try:
        agree, total, seen, _ = greedy_agreement(model, llm, tokenizer)
        seen |= {t for p in report.prompts for t in p.reference}  # and the validation's five prompts
    finally:
        llm.close()
    # Free-running greedy from the first divergence on is a different text; the validation above
    # already allowed only near ties, so most steps must agree before any divergence.
    assert agree >= 0.75 * total, (arch, agree, total)
    assert len(seen) > 4, "the model is degenerate; the comparison would prove nothing"


@pytest.mark.slow
def test_architecture_the_installed_converter_lacks_is_refused_before_any_file(converter, tmp_path):
    """transformers' Ministral (its own model_type; the released Ministral-8B says MistralForCausalLM) has
    no class in llama.cpp's converter: refused by name, with the fix, before the merged save."""
    from unsloth.export.errors import ExportError
    from unsloth.export.gguf import save_pretrained_gguf

    assert "MinistralForCausalLM" not in converter.architectures
    model = make_model("ministral", **TINY, head_dim=16, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ExportError, match="does not support MinistralForCausalLM .'ministral'.") as caught:
        save_pretrained_gguf(model, tmp_path / "out", make_tokenizer(), "f16")
    assert "save_pretrained_merged" in caught.value.fix
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_special_token_the_converter_needs_is_named(converter, tmp_path):
    """llama.cpp's GLM converter looks GLM's <|endoftext|> up by name; without it the export names the token
    and the fix (it was a bare KeyError inside "converter failed"), and keeps nothing."""
    from unsloth.export.errors import ExportError
    from unsloth.export.gguf import save_pretrained_gguf

    with pytest.raises(ExportError, match="tokenizer's '<\\|endoftext\\|>' token") as caught:
        save_pretrained_gguf(make_model("glm"), tmp_path, make_tokenizer(), "f16", validate_export=False)
    assert "GlmForCausalLM" in str(caught.value) and "nothing was written" in str(caught.value)
    assert "add_special_tokens" in caught.value.fix
    assert list(tmp_path.iterdir()) == []


# Registry families with no GGUF export test, each with the reason (docs/export.md lists them too)
NOT_EXPORT_TESTED = {
    "ministral": "llama.cpp's converter has no MinistralForCausalLM (refused, tested above)",
    "mllama": "llama.cpp's converter has no Llama 3.2 Vision",
    "csm": "llama.cpp's converter has no Sesame CSM",
    "gemma3n_text": "llama.cpp's converter takes only 4 AltUp inputs, the tiny model has 2 (it fails cleanly, keeping nothing)",
    "gemma3n": "the whole Gemma 3n needs timm, not installed here",
    "mistral3": "vision-language: its projector file is not tested yet",
    "qwen3_5": "vision-language: its projector file is not tested yet (qwen3_5_text is)",
    "llama4": "vision-language: its projector file is not tested yet (llama4_text is)",
}


def test_every_registry_family_is_export_tested_or_says_why():
    """A family added to the registry gets a GGUF export test, or an entry above saying why not."""
    from test_export_vision import FAMILIES as VISION

    from export_models import ARCHITECTURES
    from unsloth.models.patches import FAMILIES, MOE_FAMILIES

    registry = set(FAMILIES) | set(MOE_FAMILIES)
    tested = set(ARCHITECTURES) | set(LLAMA_CPP_ARCHITECTURES) | set(MOE) | set(VISION)
    assert registry - tested - set(NOT_EXPORT_TESTED) == set(), "no export test and no reason"
    assert set(NOT_EXPORT_TESTED) - registry == set() and not tested & set(NOT_EXPORT_TESTED)
