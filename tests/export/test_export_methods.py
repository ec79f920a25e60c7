from __future__ import annotations

import gguf
import pytest

from unsloth.export import ExportError
from unsloth.export.methods import ALIASES, METHODS, estimated_bytes, resolve, resolve_all


@pytest.mark.parametrize("name", list(METHODS))
def test_file_type_ids_are_llama_cpp_s(name):
    expected = gguf.LlamaFileType["ALL_F32" if name == "f32" else f"MOSTLY_{name.upper()}"]
    assert METHODS[name].ftype == int(expected)


def test_required_methods_are_offered():
    assert {"f16", "bf16", "q8_0", "q4_k_m", "q5_k_m", "q6_k"} <= set(METHODS)
    assert {m.name for m in METHODS.values() if m.converted} == {"f32", "f16", "bf16"}


def test_aliases_and_case():
    assert resolve("Q4_K_M") is METHODS["q4_k_m"]
    assert [resolve(a).name for a in ALIASES] == ["f16", "q8_0", "q4_k_m"]
    assert [m.name for m in resolve_all(["q8_0", "fast_quantized", "f16"])] == ["q8_0", "f16"]


def test_unknown_method_lists_the_choices():
    with pytest.raises(ExportError, match="unknown GGUF method 'q9'") as info:
        resolve("q9")
    assert "q4_k_m" in info.value.fix


def test_size_estimate():
    assert estimated_bytes(1_000_000_000, METHODS["f16"]) == 2_000_000_000
    assert estimated_bytes(1_000_000_000, METHODS["q8_0"]) == 1_062_500_000
