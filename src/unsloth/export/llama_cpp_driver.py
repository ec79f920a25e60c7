"""Run llama.cpp's own HF -> GGUF converter on a saved model folder (a child process of the export).

    python -m unsloth.export.llama_cpp_driver CONVERTER_DIR MODEL_DIR OUTFILE OUTTYPE [mmproj]

With `mmproj`, the vision-language model's projector file (its vision tower and projector, what
llama.cpp's --mmproj writes) instead of the language model.

CONVERTER_DIR is a llama.cpp tree (convert_hf_to_gguf.py, conversion/ or the classes inline, and
gguf-py/). Its own gguf-py goes first on sys.path, so the converter runs with the gguf it was written
for, not the one installed here; that is why this runs in a process of its own.

One change to llama.cpp's behaviour: it names a byte-level BPE pre-tokenizer by hashing how the
tokenizer splits a fixed text, so a tokenizer it has never seen (a new release, or a test's tiny
one) is refused. Then the name comes from tokenizer.json's split rule (our vocab module), which
refuses too when the rule is not one llama.cpp implements; llama.cpp still writes the vocab. The export's validation compares the
GGUF's tokenization with transformers' either way.
"""

from __future__ import annotations

import json
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

EXIT_UNSUPPORTED = 3  # the converter has no class for this architecture
EXIT_REFUSED = 4  # one of our checks refused; the last stderr line is ERROR_PREFIX + {"problem", "fix"}
ERROR_PREFIX = "unsloth-export-error: "


def _name_unknown_pre_tokenizers(model_class: type) -> None:
    """Where llama.cpp does not know the tokenizer's hash, name its pre-tokenizer from tokenizer.json."""
    owner = next(k for k in model_class.__mro__ if "get_vocab_base_pre" in k.__dict__)
    by_hash = owner.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return by_hash(self, tokenizer)
        except NotImplementedError:
            from unsloth.export.vocab import pre_tokenizer_name

            return pre_tokenizer_name(json.loads(tokenizer.backend_tokenizer.to_str()))

    owner.get_vocab_base_pre = get_vocab_base_pre


def convert(converter_dir: Path, model_dir: Path, outfile: Path, outtype: str, mmproj: bool = False) -> int:
    sys.path[:0] = [str(converter_dir / "gguf-py"), str(converter_dir)]
    import gguf
    import torch

    try:  # llama.cpp since early 2026: the model classes live in a package beside the script
        from conversion import ModelBase, ModelType, get_model_architecture, get_model_class
    except ImportError:  # before: all in the script
        from convert_hf_to_gguf import ModelBase, ModelType, get_model_architecture  # type: ignore[no-redef]

        def get_model_class(name: str, mmproj: bool = False) -> type:
            return ModelBase.from_model_architecture(name, model_type=ModelType.MMPROJ if mmproj else ModelType.TEXT)

    hparams = ModelBase.load_hparams(model_dir, False)
    architecture = get_model_architecture(hparams, ModelType.MMPROJ if mmproj else ModelType.TEXT)
    try:
        model_class = get_model_class(architecture, mmproj=mmproj)
    except NotImplementedError:
        print(f"llama.cpp's converter has no class for {architecture}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]
    if not mmproj:
        _name_unknown_pre_tokenizers(model_class)
    if getattr(model_class, "supports_mtp_export", False):
        # transformers drops multi-token-prediction heads on load, so a merged save has none (--no-mtp)
        model_class.no_mtp = True
    with torch.inference_mode(), _named_missing_tokens(architecture):
        converter = model_class(model_dir, file_type, outfile, model_name=model_dir.name)
        converter.write()
    return 0


@contextmanager
def _named_missing_tokens(architecture: str):
    """A converter that looks a special token up by name (GLM's set EOS/BOS/EOT from ``<|endoftext|>``,
    ``<|user|>``, ``[gMASK]``) fails with a bare KeyError on a tokenizer without it: name the token."""
    try:
        yield
    except KeyError as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        token = exc.args[0] if exc.args else None
        if not isinstance(token, str) or not any("vocab" in frame.name for frame in frames):
            raise
        from unsloth.export.errors import ExportError

        raise ExportError(
            f"llama.cpp's converter for {architecture} sets the model's special tokens from the "
            f"tokenizer's {token!r} token, and this tokenizer has no {token!r}; nothing was written",
            fix=f"export with the tokenizer the base model ships (AutoTokenizer.from_pretrained on the base "
            f"checkpoint), which has it; or add it (tokenizer.add_special_tokens({{'additional_special_tokens': "
            f"[{token!r}]}}), then model.resize_token_embeddings(len(tokenizer)) if the vocab grew)",
        ) from None


def main(argv: list[str]) -> int:
    from unsloth.errors import UnslothError

    converter_dir, model_dir, outfile, outtype, *part = argv
    try:
        return convert(Path(converter_dir), Path(model_dir), Path(outfile), outtype, mmproj=part == ["mmproj"])
    except UnslothError as exc:
        print(ERROR_PREFIX + json.dumps({"problem": exc.problem, "fix": exc.fix}), file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
