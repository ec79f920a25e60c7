"""f16 GGUF -> a quantized GGUF through llama.cpp's own quantizer (llama-cpp-python's binding)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from unsloth.export.errors import ExportError
from unsloth.export.files import atomic_output
from unsloth.export.methods import Method
from unsloth.export.runtime import require_llama_cpp


def quantize(source: Path, destination: Path, method: Method, threads: int | None = None) -> None:
    """Quantize ``source`` into ``destination``; the final name appears only on success.

    Tensors whose rows do not divide into a k-quant block (256 values) are quantized by llama.cpp
    with a compatible fallback type, as llama-quantize does.
    """
    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = method.ftype
    params.nthread = threads or os.cpu_count() or 1
    with atomic_output(destination) as partial:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
        if status != 0 or not partial.is_file():
            raise ExportError(
                f"llama.cpp failed to quantize {source.name} to {method.name} (status {status}); nothing was written "
                f"under {destination.name}",
                fix="llama.cpp's reason is printed above; the f16 export is unaffected",
            )
