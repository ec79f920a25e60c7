"""``save_pretrained_gguf``: merged 16-bit weights -> GGUF -> quantized GGUFs -> validated, in one call.

Order of work, cheapest failure first: method names, architecture and tokenizer support, llama.cpp
presence and free disk space are checked before any file is written. Every file is written under
a temporary name and appears under its final name only when complete (and, for the f16 reference,
only when it matches transformers).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unsloth.export.architectures import ARCHITECTURES
from unsloth.export.converter import write_gguf
from unsloth.export.errors import ExportError
from unsloth.export.files import atomic_output, ensure_free_space, scratch_file
from unsloth.export.llama_cpp_converter import LlamaCppConverter, convert, find_converter, require_support
from unsloth.export.merged import save_pretrained_merged
from unsloth.models.merge import base_model, merged_tensors
from unsloth.export.methods import Method, export_bytes, resolve_all
from unsloth.export.methods import reference_method as reference_method_for
from unsloth.export.modelfile import write_modelfile
from unsloth.export.quantize import quantize
from unsloth.export.runtime import MMPROJ_PREFIX, require_llama_cpp
from unsloth.export.validate import ProjectorCheck, Validation, check_projector, reference_run, validate
from unsloth.export.validate_child import ValidationCrashed, timeout_for as validation_timeout
from unsloth.export.vocab import uses_sentencepiece
from unsloth.models.tokenizer_files import sentencepiece_model

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    files: dict[str, Path] = field(default_factory=dict)  # method -> file ("mmproj": the projector file)
    validations: dict[str, Validation | ProjectorCheck] = field(default_factory=dict)
    modelfile: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "files": {m: str(p) for m, p in self.files.items()},
            "validation": {m: v.to_json() for m, v in self.validations.items()},
            "modelfile": str(self.modelfile) if self.modelfile else None,
        }


def is_vision_language(model: Any) -> bool:
    return getattr(base_model(model).config, "vision_config", None) is not None


def gguf_filename(name: str, method: Method) -> str:
    return f"{name}.{method.name.upper()}.gguf"


def save_pretrained_gguf(
    model: Any,
    save_directory: str | os.PathLike[str],
    tokenizer: Any,
    quantization_method: str | list[str] = "q8_0",
    *,
    name: str = "model",
    validate_export: bool = True,
    modelfile: bool = False,
) -> ExportResult:
    """Export ``model`` (a transformers model, with or without peft LoRA adapters) to GGUF.

    ``quantization_method``: one name or a list (f16, bf16, q8_0, q4_k_m, q5_k_m, q6_k, ...; see
    ``unsloth.export.methods``). The unquantized reference (f16, or bf16/f32 when asked for) is
    always written first and checked against transformers: if it disagrees, nothing is kept and
    ExportError says so. Quantized files are made from it by llama.cpp, and their agreement is
    reported. A vision-language model (through llama.cpp's converter) also gets its projector file,
    ``mmproj-NAME.F16.gguf`` (the vision tower and projector, in the reference's precision, as llama.cpp
    runs it beside any of the language model's files), checked too (validate.check_projector).
    Returns the files written and the validation reports.
    """
    out_dir = Path(save_directory)
    methods = resolve_all(quantization_method)
    converter = _llama_cpp_converter(model, tokenizer)  # unsupported architectures fail before any work
    quantized = [m for m in methods if not m.converted]
    if quantized or validate_export:
        require_llama_cpp()
    if validate_export:
        validation_timeout()  # a bad UNSLOTH_VALIDATE_TIMEOUT is refused before any work

    reference_method = reference_method_for(methods)
    sources = merged_tensors(model)
    n_params = sum(math.prod(s.shape) for s in sources.values())
    keep_reference = reference_method in methods
    ensure_free_space(out_dir, export_bytes(n_params, methods))

    result = ExportResult()
    vision = is_vision_language(model)
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer) if vision else tokenizer  # a processor's own
    expected = reference_run(model, text_tokenizer) if validate_export else None  # transformers, once
    reference_path = out_dir / gguf_filename(name, reference_method)

    def write_reference(target: Path) -> None:
        log.info("writing %s%s", reference_path, "" if keep_reference else " (the reference to quantize from; not kept)")
        write(target, reference_method)
        if expected is not None:
            with _kept_if_the_check_dies(target, reference_path):
                report = validate(expected, text_tokenizer, target, reference_method.name)
            report.file = str(reference_path)
            result.validations[reference_method.name] = report
            if not report.passed:
                raise ExportError(
                    f"the {reference_method.name} GGUF does not reproduce the model: {report.summary()}; "
                    "it was not kept",
                    fix="this is an exporter bug for this model, please report it; --no-validate "
                    "(validate_export=False) writes the file anyway, for inspection",
                )

    with ExitStack() as stack:
        write = _writer(model, tokenizer, sources, name, out_dir, converter, stack)
        if keep_reference:
            with atomic_output(reference_path) as partial:
                write_reference(partial)
            reference = reference_path
            result.files[reference_method.name] = reference_path
        else:  # not asked for: it never takes its final name, so no kill can leave it there
            reference = stack.enter_context(scratch_file(reference_path))
            write_reference(reference)
        for method in methods:
            if method.converted and method is not reference_method:
                path = out_dir / gguf_filename(name, method)
                with atomic_output(path) as partial:
                    write(partial, method)
                result.files[method.name] = path
        for method in quantized:
            path = out_dir / gguf_filename(name, method)
            log.info("quantizing %s", path)
            quantize(reference, path, method)
            result.files[method.name] = path
            if expected is not None:
                with _kept_if_the_check_dies(path, path):
                    result.validations[method.name] = validate(expected, text_tokenizer, path, method.name)
        if vision:
            mmproj = out_dir / f"{MMPROJ_PREFIX}{gguf_filename(name, reference_method)}"
            log.info("writing %s (the vision tower and projector)", mmproj)
            with atomic_output(mmproj) as partial:
                write(partial, reference_method, mmproj=True)
                if validate_export:
                    with _kept_if_the_check_dies(partial, mmproj):
                        check = check_projector(model, reference, partial)
                    check.file = str(mmproj)
                    result.validations["mmproj"] = check
                    if not check.passed:
                        raise ExportError(f"the projector file does not hold the model's vision tower: "
                                          f"{check.summary()}; it was not kept",
                                          fix="this is an exporter bug for this model, please report it")
            result.files["mmproj"] = mmproj

    if modelfile:
        preferred = next(result.files[m.name] for m in methods)
        result.modelfile = write_modelfile(out_dir, preferred, text_tokenizer)
    return result



@contextmanager
def _kept_if_the_check_dies(written: Path, final: Path) -> Iterator[None]:
    """llama.cpp dying in the validation child says nothing about the export: the file it was checking
    takes its final name (even an intermediate reference: it is whole, and what llama.cpp chokes on)
    and the error names it there."""
    try:
        yield
    except ValidationCrashed as exc:
        if written != final:
            os.replace(written, final)
        raise exc.kept_as(final) from None


# llama.cpp's converters that read a SentencePiece-style vocab from tokenizer.json, not tokenizer.model
_VOCAB_FROM_JSON = {"gemma4", "gemma4_text"}


def _llama_cpp_converter(model: Any, tokenizer: Any) -> LlamaCppConverter | None:
    """None where our converter writes the model and its tokenizer; else llama.cpp's, checked to support it.

    Our vocab writer does byte-level BPE only, so a SentencePiece tokenizer (Llama 2, Mistral v0.3,
    Gemma) goes through llama.cpp's converter whatever the architecture; it reads the
    tokenizer.model that the merged save copies beside tokenizer.json."""
    base = base_model(model)
    sentencepiece = uses_sentencepiece(tokenizer)
    if base.config.model_type in ARCHITECTURES and not sentencepiece and not is_vision_language(model):
        return None
    converter = find_converter()
    require_support(converter, base)
    if sentencepiece and sentencepiece_model(tokenizer) is None and base.config.model_type not in _VOCAB_FROM_JSON:
        raise ExportError(
            f"the tokenizer is a SentencePiece tokenizer, and the tokenizer.model it was made from is not "
            "known (transformers 5 saves only tokenizer.json); llama.cpp's converter needs that file; "
            "nothing was written",
            fix="load the tokenizer from a folder that has tokenizer.model (the base model's, e.g. "
            "AutoTokenizer.from_pretrained(base_model_name)) and pass it to save_pretrained_gguf",
        )
    reason = "its SentencePiece tokenizer" if sentencepiece else type(base).__name__
    log.info("%s goes through llama.cpp's converter (%s)", reason, converter.origin)
    return converter


def _writer(model: Any, tokenizer: Any, sources: dict, name: str, out_dir: Path,
            converter: LlamaCppConverter | None, stack: ExitStack) -> Callable[[Path, Method], None]:
    """How to write one unquantized GGUF: our converter from the merged tensors, or llama.cpp's from a
    merged 16-bit folder (saved once, on first use, beside the output and removed after); with
    ``mmproj``, a vision-language model's projector file (llama.cpp's converter only)."""
    if converter is None:
        return lambda target, method, mmproj=False: write_gguf(model, tokenizer, sources, target, method, name=name)
    merged: list[Path] = []

    def write(target: Path, method: Method, mmproj: bool = False) -> None:
        if not merged:
            out_dir.mkdir(parents=True, exist_ok=True)
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=".unsloth-merged-", dir=out_dir)))
            save_pretrained_merged(model, str(folder / name), tokenizer, save_method="merged_16bit")
            merged.append(folder / name)
        convert(converter, merged[0], target, method.name, mmproj=mmproj)

    return write
