"""llama.cpp's AMX weight buffers are switched off while a model loads, and only then."""

from __future__ import annotations

import types

import pytest

from unsloth.export import runtime


class _Params:
    _fields_ = [("n_gpu_layers", int), ("use_extra_bufts", bool)]

    def __init__(self):
        self.use_extra_bufts = True


def _fake_llama_cpp(system_info: bytes):
    module = types.SimpleNamespace(llama_model_default_params=_Params)
    return types.SimpleNamespace(llama_cpp=module, llama_print_system_info=lambda: system_info)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_extra_buffers_are_off_only_on_amx_cpus_and_only_while_loading(amx):
    fake = _fake_llama_cpp(b"CPU : AVX2 = 1 | AMX_INT8 = %d | REPACK = 1 |" % amx)
    with pytest.raises(RuntimeError, match="load failed"), runtime._without_amx_buffers(fake):
        assert fake.llama_cpp.llama_model_default_params().use_extra_bufts is not amx
        raise RuntimeError("load failed")
    assert fake.llama_cpp.llama_model_default_params is _Params  # restored, even after an error


def test_a_llama_cpp_python_without_the_switch_loads_unchanged():
    fake = _fake_llama_cpp(b"AMX_INT8 = 1")
    fake.llama_cpp.llama_model_default_params = type("Old", (), {"_fields_": [("n_gpu_layers", int)]})
    default = fake.llama_cpp.llama_model_default_params
    with runtime._without_amx_buffers(fake):
        assert fake.llama_cpp.llama_model_default_params is default
