"""GGUF output types ("methods"): names users type, llama.cpp's file type ids, size estimates. Pure data.

The ids are llama.cpp's ``llama_ftype`` values (the same numbers as ``gguf.LlamaFileType``); they are
written out here so that the CLI can list the methods without importing numpy or gguf.
"""

from __future__ import annotations

from dataclasses import dataclass

from unsloth.export.errors import ExportError


@dataclass(frozen=True)
class Method:
    name: str
    ftype: int  # llama_ftype
    bits_per_weight: float  # average over a typical model, for the disk-space check
    converted: bool  # True: our converter writes it directly; False: llama.cpp quantizes it from f16
    description: str


_METHODS = (
    Method("f32", 0, 32.0, True, "full precision; large, for debugging"),
    Method("f16", 1, 16.0, True, "16-bit; exact weights, the reference export"),
    Method("bf16", 32, 16.0, True, "bfloat16; exact for bf16-trained weights, slower on some CPUs"),
    Method("q8_0", 7, 8.5, False, "8-bit; nearly lossless, half of f16"),
    Method("q6_k", 18, 6.6, False, "6-bit k-quant"),
    Method("q5_k_m", 17, 5.7, False, "5-bit k-quant, medium"),
    Method("q5_k_s", 16, 5.5, False, "5-bit k-quant, small"),
    Method("q4_k_m", 15, 4.9, False, "4-bit k-quant, medium; the usual choice for chat"),
    Method("q4_k_s", 14, 4.6, False, "4-bit k-quant, small"),
    Method("q4_0", 2, 4.5, False, "4-bit legacy"),
    Method("q5_0", 8, 5.5, False, "5-bit legacy"),
    Method("q3_k_m", 12, 3.9, False, "3-bit k-quant, medium; quality drops"),
    Method("q2_k", 10, 3.4, False, "2-bit k-quant; large quality loss"),
)

METHODS: dict[str, Method] = {m.name: m for m in _METHODS}

# Unsloth's historical names, kept so existing notebooks work.
ALIASES = {"not_quantized": "f16", "fast_quantized": "q8_0", "quantized": "q4_k_m"}


def resolve(name: str) -> Method:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in METHODS:
        raise ExportError(
            f"unknown GGUF method {name!r}",
            fix="use one of: " + ", ".join(METHODS) + " (aliases: " + ", ".join(ALIASES) + ")",
        )
    return METHODS[key]


def resolve_all(names: str | list[str] | tuple[str, ...]) -> list[Method]:
    """One or many names -> methods, in the order given, without duplicates."""
    if isinstance(names, str):
        names = [names]
    methods: list[Method] = []
    for name in names:
        method = resolve(name)
        if method not in methods:
            methods.append(method)
    if not methods:
        raise ExportError("no GGUF method given", fix="pass e.g. quantization_method='q8_0'")
    return methods


def estimated_bytes(n_params: int, method: Method) -> int:
    return int(n_params * method.bits_per_weight / 8)


def reference_method(methods: list[Method]) -> Method:
    """The unquantized file every export writes first: the first 16/32-bit method asked for, else f16."""
    return next((m for m in methods if m.converted), METHODS["f16"])


def export_bytes(n_params: int, methods: list[Method]) -> int:
    """What an export writes at most: the reference plus every method asked for."""
    return sum(estimated_bytes(n_params, m) for m in {reference_method(methods), *methods})
