"""HF model (config + merged tensors) + tokenizer -> one GGUF file in f32, f16 or bf16.

Our own converter on the ``gguf`` package, so the export never depends on a llama.cpp checkout
being in step with the model. Tensors are converted and written one at a time (the header is
written first from their shapes), so memory stays near the size of the model being exported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from unsloth.export.architectures import (
    Architecture,
    architecture_for,
    llama3_rope_factors,
    permute_for_ggml,
    write_hparams,
)
from unsloth.export.errors import ExportError
from unsloth.models.merge import TensorSource
from unsloth.export.methods import Method
from unsloth.export.vocab import write_vocab

logging.getLogger("gguf").setLevel(logging.WARNING)  # its INFO lines describe internals, not progress

_TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16}
_F16_MAX = float(np.finfo(np.float16).max)


@dataclass
class _Tensor:
    name: str  # GGUF name
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    produce: Callable[[], torch.Tensor]  # HF data fixed up for llama.cpp, in its own dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * (4 if self.ggml_type == gguf.GGMLQuantizationType.F32 else 2)

    def encoded(self) -> np.ndarray:
        # Cast straight from the source dtype: one output-sized copy per tensor, no float32 detour.
        data = self.produce().detach().cpu()
        if self.ggml_type == gguf.GGMLQuantizationType.F32:
            return data.to(torch.float32).numpy()
        if self.ggml_type == gguf.GGMLQuantizationType.BF16:  # round-to-nearest-even; bits travel as uint16
            return data.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        low, high = torch.aminmax(data) if data.numel() else (torch.tensor(0.0), torch.tensor(0.0))
        peak = max(abs(float(low)), abs(float(high)))
        if not np.isfinite(peak) or peak > _F16_MAX:
            raise ExportError(
                f"{self.name} holds values beyond float16's range (|w| up to {peak:.3g}); "
                "an f16 export would turn them into inf",
                fix="export bf16 instead (quantization_method='bf16' / --gguf bf16)",
            )
        return data.to(torch.float16).numpy()


def _tensor_plan(config: Any, arch: Architecture, sources: dict[str, TensorSource], dtype: gguf.GGMLQuantizationType) -> Iterator[_Tensor]:
    n_head = config.num_attention_heads
    n_kv_head = getattr(config, "num_key_value_heads", None) or n_head
    names = gguf.get_tensor_name_map(arch.gguf_arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))

    factors = llama3_rope_factors(config)
    if factors is not None:
        rope_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        yield _Tensor(rope_name, factors.shape, gguf.GGMLQuantizationType.F32, lambda: torch.from_numpy(factors))

    for hf_name, source in sources.items():
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp reuses token_embd when output.weight is absent
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ExportError(
                f"the model has a tensor {hf_name!r} that the {arch.name} GGUF layout has no place for; nothing was written",
                fix="export the plain causal-LM model (no extra heads or modules)",
            )
        heads = n_head if ".q_proj." in hf_name else n_kv_head if ".k_proj." in hf_name else None
        norm = arch.norm_offset if hf_name.endswith("norm.weight") else 0.0

        def produce(source=source, heads=heads, norm=norm) -> torch.Tensor:
            data = source.load()
            if arch.permute_qk and heads:
                data = permute_for_ggml(data, heads)
            return data.to(torch.float32) + norm if norm else data

        shape = source.shape
        # 1-D tensors (norms, biases) stay f32, as llama.cpp expects and as its converter writes them.
        yield _Tensor(gguf_name, shape, dtype if len(shape) > 1 else gguf.GGMLQuantizationType.F32, produce)


def write_gguf(model: Any, tokenizer: Any, sources: dict[str, TensorSource], path: Path, method: Method, name: str = "model") -> None:
    """Write ``model``'s ``sources`` (see merge.merged_tensors) as ``method`` (f32/f16/bf16) to ``path``."""
    if method.name not in _TYPES:
        raise ExportError(f"{method.name} is made by quantizing an f16 export, not written directly")
    config = model.config
    arch = architecture_for(config)
    plan = list(_tensor_plan(config, arch, sources, _TYPES[method.name]))

    writer = gguf.GGUFWriter(path, arch.name)
    writer.add_name(name)
    write_hparams(config, arch, writer)
    writer.add_file_type(method.ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_vocab(tokenizer, int(config.vocab_size), writer)
    for tensor in plan:
        dtype = np.float32 if tensor.ggml_type == gguf.GGMLQuantizationType.F32 else np.float16
        writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(dtype), tensor.nbytes, raw_dtype=tensor.ggml_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in plan:
            writer.write_tensor_data(tensor.encoded())
    finally:
        writer.close()
