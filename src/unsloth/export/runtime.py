"""llama.cpp through llama-cpp-python: find it, load a GGUF, run greedy steps. The only llama_cpp user."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from unsloth.export import gguf_file
from unsloth.export.errors import ExportError

INSTALL_FIX = (
    "install llama-cpp-python into this environment: `unsloth install` builds it for your GPU "
    "(or `pip install llama-cpp-python` for a CPU build)"
)


def require_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:  # also a build whose shared library will not load
        raise ExportError(f"llama.cpp is not available here ({exc})", fix=INSTALL_FIX) from exc
    # llama-cpp-python prints llama.cpp's whole log (model dumps, per-tensor quantize lines) unless
    # its logger says otherwise; keep errors, and everything when our own logger is at DEBUG.
    verbose = logging.getLogger("unsloth").isEnabledFor(logging.DEBUG)
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
    return llama_cpp


def load(path: str | Path, *, n_ctx: int = 2048, gpu: bool = True, logits_all: bool = False,
         mmproj: str | Path | None = None, verbose: bool = False) -> Any:
    """A ``llama_cpp.Llama`` for ``path``; all layers on the GPU when the build has one. ``mmproj``: a
    vision-language model's projector file, for chats with images (llama.cpp's multimodal library,
    with the chat template stored in the model's GGUF). ``verbose``: llama.cpp's whole log on stderr
    (else it is silenced, and so is the reason of a failed assert)."""
    llama_cpp = require_llama_cpp()
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"no GGUF file at {path}", fix="pass a .gguf file, or a directory written by `unsloth export`")
    gguf_file.read_header(path)  # a truncated or foreign file is named here, not deep inside llama.cpp
    handler = None
    if mmproj is not None:
        require_multimodal()
        gguf_file.read_header(mmproj)
        from llama_cpp.llama_chat_format import MTMDChatHandler

        handler = MTMDChatHandler(clip_model_path=str(mmproj), verbose=verbose, use_gpu=gpu)
    try:
        with _without_amx_buffers(llama_cpp):
            return llama_cpp.Llama(
                str(path),
                n_ctx=n_ctx,
                n_gpu_layers=-1 if gpu else 0,
                logits_all=logits_all,
                n_threads=os.cpu_count(),
                seed=0,
                verbose=verbose,
                chat_handler=handler,
            )
    except (ValueError, RuntimeError) as exc:
        raise ExportError(
            f"llama.cpp could not load {path} ({exc})",
            fix="re-export the model, or update llama-cpp-python if the file comes from a newer llama.cpp",
        ) from exc


@contextmanager
def _without_amx_buffers(llama_cpp: Any) -> Iterator[None]:
    """On a CPU with AMX-INT8 (Xeon Sapphire Rapids and later) llama.cpp repacks quantized weights
    into its AMX buffers, and a small Q8_0 model then crashes it (SIGSEGV on the first eval;
    llama-cpp-python 0.3.36) where its plain CPU path is right. `Llama` takes no switch for those
    buffers, so while it loads, the model parameters it starts from say `use_extra_bufts = False`."""
    module = llama_cpp.llama_cpp
    default = module.llama_model_default_params
    has_switch = any(name == "use_extra_bufts" for name, *_ in getattr(default(), "_fields_", ()))
    if not has_switch or b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
        yield
        return

    def without_extra_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    module.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        module.llama_model_default_params = default


def multimodal_available() -> bool:
    """Whether this llama-cpp-python has llama.cpp's multimodal library (mtmd) to run a projector file."""
    try:
        require_llama_cpp()
        import llama_cpp.mtmd_cpp  # noqa: F401  (loads libmtmd; a build without it fails here)
        from llama_cpp.llama_chat_format import MTMDChatHandler  # noqa: F401
    except (ImportError, OSError, RuntimeError, ExportError):
        return False
    return True


def require_multimodal() -> None:
    if not multimodal_available():
        raise ExportError("this llama-cpp-python has no multimodal library (mtmd), so it cannot run a "
                          "vision model's projector file",
                          fix="update llama-cpp-python (`pip install -U llama-cpp-python`, 0.3.10 or newer), or "
                          "chat with the merged checkpoint folder instead: `unsloth chat DIR --image PATH`")


def image_url(image: Any) -> str:
    """A PIL image or an image file's path as the data: URL llama-cpp-python's chat handlers read."""
    import base64
    import io

    if isinstance(image, (str, Path)):
        from PIL import Image

        try:
            image = Image.open(image)
            image.load()
        except (OSError, ValueError) as exc:
            raise ExportError(f"{image}: not an image file this machine can read ({exc})",
                              fix="pass a PNG, JPEG or WebP file") from None
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def context_length(path: str | Path) -> int | None:
    """The context length the model was trained for, read from the checked GGUF header (no weights loaded)."""
    return gguf_file.context_length(gguf_file.read_header(path))


def resolve_model_path(model: str | Path) -> Path:
    """A .gguf file, or a directory holding exactly one -> the file to run (several: the user picks)."""
    path = Path(model)
    if path.is_dir():
        found = sorted(p for p in path.glob("*.gguf") if not p.name.startswith(MMPROJ_PREFIX))
        if len(found) > 1:
            raise ExportError(
                f"{path} holds several GGUF files: " + ", ".join(p.name for p in found),
                fix="pass the one you want, e.g. " + str(found[0]),
            )
        if not found:
            raise ExportError(f"{path} holds no .gguf file", fix=f"export one first: unsloth export CHECKPOINT --gguf q8_0 --out {path}")
        return found[0]
    if not path.is_file():
        raise ExportError(f"no GGUF file at {path}", fix="pass a .gguf file, or a directory written by `unsloth export`")
    return path


MMPROJ_PREFIX = "mmproj-"  # llama.cpp's name for a projector file, beside the model's GGUF


def projector_for(model_path: str | Path) -> Path | None:
    """The projector file (mmproj-*.gguf) beside a vision-language model's GGUF; None if there is none."""
    model_path = Path(model_path)
    found = sorted(model_path.parent.glob(f"{MMPROJ_PREFIX}*.gguf"))
    if len(found) > 1:  # several exports in one folder: the one named after this model
        found = [p for p in found if p.name.startswith(MMPROJ_PREFIX + model_path.name.split(".")[0] + ".")] or found
    if len(found) > 1:
        raise ExportError(f"{model_path.parent} holds several projector files: " + ", ".join(p.name for p in found),
                          fix="keep one mmproj-*.gguf beside the model, or pass the model's folder with only its own")
    return found[0] if found else None


def next_token_logits(llm: Any, tokens: list[int]) -> np.ndarray:
    """Logits after each position of ``tokens`` (needs ``logits_all=True``), evaluated from scratch."""
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def last_logits(llm: Any) -> np.ndarray:
    """The logits after the last evaluated token (kept by llama.cpp whatever ``logits_all`` says)."""
    llama_cpp = require_llama_cpp()
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy()


def greedy(llm: Any, prompt: list[int], n_tokens: int) -> list[int]:
    """The first ``n_tokens`` greedy tokens after ``prompt``, ignoring end-of-sequence (for comparison)."""
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(n_tokens):
        token = int(np.argmax(last_logits(llm)))
        out.append(token)
        llm.eval([token])
    return out
