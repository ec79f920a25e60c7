"""llama.cpp's own HF -> GGUF converter, for the architectures our converter does not write.

Which converter: the llama.cpp tree named by ``UNSLOTH_LLAMA_CPP`` (a checkout or build with
convert_hf_to_gguf.py), else the one from the source distribution of the llama-cpp-python that is
installed here, so conversion and the runtime that loads the result are the same llama.cpp. That
one is fetched once from the package index (PIP_INDEX_URL or PyPI, checked against its sha256) and
only its converter files are kept, in the user cache.

What it supports is read from its files (the architecture names it registers), so an export it
cannot do is refused before any work, naming the architecture and the fix.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import urllib.parse
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from unsloth.export.errors import ExportError
from unsloth.export.llama_cpp_driver import ERROR_PREFIX, EXIT_REFUSED

log = logging.getLogger(__name__)

CONVERTER_ENV = "UNSLOTH_LLAMA_CPP"
SCRIPT = "convert_hf_to_gguf.py"
# What the converter needs from a llama.cpp tree: the script, its model classes, its own gguf-py.
_KEPT = (SCRIPT, "conversion/", "gguf-py/")


@dataclass(frozen=True)
class LlamaCppConverter:
    root: Path  # a llama.cpp tree holding convert_hf_to_gguf.py and gguf-py/
    origin: str  # where it came from, for messages

    @property
    def architectures(self) -> frozenset[str]:
        return supported_architectures(self.root)

    @property
    def mmproj_architectures(self) -> frozenset[str]:
        """The architectures it writes a projector file (--mmproj) for."""
        return _architectures(str(self.root), mmproj=True)


def supported_architectures(root: Path) -> frozenset[str]:
    """The HF architecture names (``config.architectures``) the converter at ``root`` has a class for.

    Read from its source without importing it: the ``TEXT_MODEL_MAP`` table of llama.cpp's
    conversion package, and the ``@ModelBase.register(...)`` names (the older single-file layout)."""
    return _architectures(str(root))


@lru_cache(maxsize=16)
def _architectures(root: str, mmproj: bool = False) -> frozenset[str]:
    """Text classes: the TEXT_MODEL_MAP keys and every registered name (the older single-file layout).
    Projector classes: the MMPROJ_MODEL_MAP keys, or the registered names of MmprojModel subclasses."""
    table = "MMPROJ_MODEL_MAP" if mmproj else "TEXT_MODEL_MAP"
    names: set[str] = set()
    files = [Path(root) / SCRIPT, *sorted((Path(root) / "conversion").glob("*.py"))]
    for path in files:
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (not mmproj or any(getattr(b, "id", None) == "MmprojModel"
                                                                     for b in node.bases)):
                for decorator in node.decorator_list:
                    if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", None) == "register":
                        names.update(a.value for a in decorator.args
                                     if isinstance(a, ast.Constant) and isinstance(a.value, str))
            elif isinstance(node, ast.AnnAssign | ast.Assign):
                targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
                if any(getattr(t, "id", None) == table for t in targets) and isinstance(node.value, ast.Dict):
                    names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return frozenset(names)


def hf_architecture(model: Any) -> str:
    """The architecture name llama.cpp's converter dispatches on (what save_pretrained records)."""
    recorded = getattr(model.config, "architectures", None)
    return recorded[0] if recorded else type(model).__name__


def _is_tree(root: Path) -> bool:
    return (root / SCRIPT).is_file() and (root / "gguf-py").is_dir()


def _cache_root() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("unsloth", appauthor=False)) / "llama.cpp-converter"


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        raise ExportError(
            "llama.cpp's converter is needed for this architecture, and llama-cpp-python is not installed",
            fix=f"install llama-cpp-python (`unsloth install` or `pip install llama-cpp-python`), or set "
            f"{CONVERTER_ENV} to a llama.cpp checkout",
        ) from None


def extract_converter(sdist: Path, dest: Path) -> Path:
    """Unpack only the converter's files from a llama-cpp-python sdist (vendor/llama.cpp/...) into ``dest``."""
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            _, _, inside = member.name.partition("/vendor/llama.cpp/")
            if inside and any(inside == k or (k.endswith("/") and inside.startswith(k)) for k in _KEPT):
                member.name = inside
                members.append(member)
        archive.extractall(dest, members=members, filter="data")
    if not _is_tree(dest):
        raise ExportError(f"{sdist.name} holds no llama.cpp converter (vendor/llama.cpp/{SCRIPT})",
                          fix=f"set {CONVERTER_ENV} to a llama.cpp checkout")
    return dest


def _sdist_url(version: str) -> tuple[str, str]:
    """(URL, sha256) of the llama-cpp-python ``version`` sdist, from the package index's simple API
    (PEP 691 JSON; PIP_INDEX_URL or PyPI). Asking pip to download an sdist would first build its
    metadata, which for llama-cpp-python means a CMake configure."""
    import urllib.request

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(f"{index}/llama-cpp-python/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    wanted = f"llama_cpp_python-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == wanted and "sha256" in entry.get("hashes", {}):
            return urllib.parse.urljoin(response.url, entry["url"]), entry["hashes"]["sha256"]
    raise LookupError(f"{wanted} is not on {index}")


def _fetch(version: str, cache: Path) -> Path:
    import hashlib
    import urllib.request

    target = cache / version
    log.info("fetching llama.cpp's converter (llama-cpp-python %s source, once) into %s", version, target)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=cache) as staging:
        sdist = Path(staging) / f"llama_cpp_python-{version}.tar.gz"
        try:
            url, sha256 = _sdist_url(version)
            digest = hashlib.sha256()
            with urllib.request.urlopen(url, timeout=60) as response, sdist.open("wb") as out:
                while chunk := response.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != sha256:
                raise OSError(f"{sdist.name} does not match the index's sha256")
        except (OSError, LookupError, ValueError, KeyError) as exc:
            raise ExportError(
                f"could not fetch llama.cpp's converter (the llama-cpp-python {version} source): {exc}",
                fix=f"check the network or PIP_INDEX_URL, or set {CONVERTER_ENV} to a llama.cpp checkout "
                "(git clone https://github.com/ggml-org/llama.cpp)",
            ) from exc
        unpacked = extract_converter(sdist, Path(staging) / "tree")
        try:
            unpacked.rename(target)  # whole or not at all: a killed fetch leaves only the staging folder
        except OSError:
            if not _is_tree(target):  # another export fetched it meanwhile otherwise
                raise
    return target


def find_converter(fetch: bool = True) -> LlamaCppConverter:
    """The converter to use (see the module docstring); ``fetch``: allowed to download it."""
    named = os.environ.get(CONVERTER_ENV)
    if named:
        root = Path(named).expanduser()
        if not _is_tree(root):
            raise ExportError(f"{CONVERTER_ENV}={named} is not a llama.cpp tree (no {SCRIPT} with gguf-py/ beside it)",
                              fix=f"point {CONVERTER_ENV} at a llama.cpp checkout, or unset it")
        return LlamaCppConverter(root, f"{CONVERTER_ENV}={named}")
    version = _installed_version()
    root = _cache_root() / version
    if not _is_tree(root):
        if not fetch:
            raise ExportError(f"llama.cpp's converter (llama-cpp-python {version}) is not in {root.parent}",
                              fix=f"export once with network access, or set {CONVERTER_ENV} to a llama.cpp checkout")
        root = _fetch(version, root.parent)
    return LlamaCppConverter(root, f"llama-cpp-python {version}")


def _refuse(problem: str, fix: str) -> None:
    raise ExportError(problem + "; nothing was written", fix=fix)


def _check_qwen3_moe(config: Any) -> None:
    # llama.cpp's qwen3moe graph always renormalizes the top-k expert weights; a config that does
    # not (transformers' default) would convert without error and answer differently.
    if not getattr(config, "norm_topk_prob", True):
        _refuse("this Qwen3-MoE config has norm_topk_prob=False, which llama.cpp's qwen3moe graph cannot "
                "represent (it always renormalizes the chosen experts' weights)",
                fix="export a model trained with norm_topk_prob=True, as the released Qwen3 MoE models are")


def _check_olmoe(config: Any) -> None:
    # llama.cpp's olmoe loader sizes the key norm for every attention head (the released models have
    # no grouped-query attention); a GQA config writes a file it refuses to load.
    if config.num_key_value_heads != config.num_attention_heads:
        _refuse(f"this OLMoE config has {config.num_key_value_heads} key/value heads for "
                f"{config.num_attention_heads} attention heads; llama.cpp's olmoe loader takes only "
                "num_key_value_heads == num_attention_heads (its key norm spans every head)",
                fix="export an OLMoE model without grouped-query attention, as the released OLMoE models "
                "are; save_pretrained_merged still saves the merged model")


def _check_granite_hybrid(config: Any) -> None:
    # llama.cpp aborts the whole process (an assertion, not an error) loading a file whose experts per
    # token exceed its expert count, which a dense Granite 4 config with the default top-k would write.
    if not getattr(config, "num_local_experts", 0) and getattr(config, "num_experts_per_tok", 0):
        _refuse(f"this Granite 4 config has no experts (num_local_experts=0) but num_experts_per_tok="
                f"{config.num_experts_per_tok}; llama.cpp aborts loading such a file",
                fix="set model.config.num_experts_per_tok = 0 (a dense model uses no experts: the released "
                "dense Granite 4 models say 0) and export again")


# What llama.cpp's llama4 graph hard-codes instead of reading it from the file (Llama 4 Scout's and
# Maverick's values): every 4th layer without RoPE, 8192-token attention chunks, attention
# temperature tuning from 8192 tokens with scale 0.1.
_LLAMA4_FIXED = {"attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}


def _check_llama4(config: Any) -> None:
    differs = {k: getattr(config, k, v) for k, v in _LLAMA4_FIXED.items() if getattr(config, k, v) != v}
    layers = config.num_hidden_layers
    no_rope = [int((i + 1) % 4 != 0) for i in range(layers)]
    if list(getattr(config, "no_rope_layers", None) or no_rope) != no_rope:
        differs["no_rope_layers"] = config.no_rope_layers  # 1: RoPE; llama.cpp's: 0 on every 4th layer
    if differs:
        _refuse(f"this Llama 4 config sets {differs}, which llama.cpp's llama4 graph cannot represent (it "
                f"assumes no RoPE on every 4th layer and {_LLAMA4_FIXED}, as the released Llama 4 models have them)",
                fix="export a model with Llama 4's released attention settings; save_pretrained_merged still "
                "saves the merged model")
    if layers < 4:  # no layer without RoPE: llama.cpp aborts the process on its unused temperature input
        _refuse(f"this Llama 4 config has {layers} layers; llama.cpp's llama4 graph needs at least 4 (every "
                "4th layer is its attention-temperature layer, and without one it aborts)",
                fix="export a model of at least 4 layers, as every released Llama 4 is")


# Configs llama.cpp's converter would turn into a file that answers differently or does not load.
_CONFIG_CHECKS = {"qwen3_moe": _check_qwen3_moe, "olmoe": _check_olmoe, "granitemoehybrid": _check_granite_hybrid,
                  "llama4_text": _check_llama4}


def _config_checks(config: Any) -> None:
    check = _CONFIG_CHECKS.get(getattr(config, "model_type", None))
    if check is not None:
        check(config)


def require_support(converter: LlamaCppConverter, model: Any) -> str:
    """The model's architecture name, if ``converter`` can convert it; else a refusal naming it."""
    _config_checks(model.config)
    name = hf_architecture(model)
    if name not in converter.architectures:
        raise ExportError(
            f"GGUF export does not support {name} ({model.config.model_type!r}): neither our converter nor "
            f"llama.cpp's ({converter.origin}) has it; nothing was written",
            fix=f"update llama-cpp-python (`pip install -U llama-cpp-python`), or set {CONVERTER_ENV} to a newer "
            "llama.cpp checkout; save_pretrained_merged still saves the merged model",
        )
    if getattr(model.config, "vision_config", None) is not None and name not in converter.mmproj_architectures:
        raise ExportError(
            f"GGUF export of {name} ({model.config.model_type!r}) needs llama.cpp's projector file (mmproj) for its "
            f"vision tower, which llama.cpp's converter ({converter.origin}) cannot write; nothing was written",
            fix="llama.cpp runs the vision models whose converter has an mmproj class (Qwen2.5-VL, Qwen3-VL, "
            "Gemma 3, Gemma 4, ...); save_pretrained_merged still saves the merged model for transformers",
        )
    return name


def record_added_tokens(model_dir: Path) -> None:
    """Write tokenizer.json's added tokens into tokenizer_config.json as ``added_tokens_decoder``.

    llama.cpp's SentencePiece vocab reads the added tokens (chat markers such as <start_of_turn>,
    [INST]) from there only; transformers 5 no longer writes that key, and without it they would be
    ordinary text to llama.cpp's tokenizer."""
    config_path, tokenizer_path = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_path.is_file()):
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("added_tokens_decoder"):
        return
    added = json.loads(tokenizer_path.read_text(encoding="utf-8")).get("added_tokens") or []
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


# Layer types under the names the published checkpoints use, for the families whose llama.cpp converter
# reads only those: transformers 5 renames Granite 4's "attention" / "mamba" on load and saves the new
# names, which the converter does not know (every layer would become a Mamba layer).
_PUBLISHED_LAYER_TYPES = {"granitemoehybrid": {"full_attention": "attention", "linear_attention": "mamba"}}


def record_published_layer_types(model_dir: Path) -> None:
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    names = _PUBLISHED_LAYER_TYPES.get(config.get("model_type"))
    if names and config.get("layer_types"):
        config["layer_types"] = [names.get(kind, kind) for kind in config["layer_types"]]
        config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")


def convert(converter: LlamaCppConverter, model_dir: Path, outfile: Path, outtype: str, mmproj: bool = False) -> None:
    """Run the converter on a saved (merged) model folder, writing ``outfile`` in f32/f16/bf16: the
    language model, or with ``mmproj`` the vision tower and projector (llama.cpp's --mmproj file)."""
    record_added_tokens(model_dir)
    record_published_layer_types(model_dir)
    command = [sys.executable, "-m", "unsloth.export.llama_cpp_driver", str(converter.root), str(model_dir),
               str(outfile), outtype, *(["mmproj"] if mmproj else [])]
    env = {**os.environ, "NO_LOCAL_GGUF": "1"}  # the driver puts the converter's own gguf-py first itself
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    if done.returncode == EXIT_REFUSED and lines and lines[-1].startswith(ERROR_PREFIX):
        refusal = json.loads(lines[-1].removeprefix(ERROR_PREFIX))
        raise ExportError(refusal["problem"], fix=refusal["fix"])
    if done.returncode != 0 or not outfile.is_file():
        raise ExportError(
            f"llama.cpp's converter ({converter.origin}) failed on {model_dir.name}: " + " / ".join(lines[-2:]),
            fix="run with --verbose to see its whole output; update llama-cpp-python or set "
            f"{CONVERTER_ENV} to a newer llama.cpp checkout",
        )
    log.debug("llama.cpp converter output:\n%s", done.stderr)
