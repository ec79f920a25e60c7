"""`unsloth export CHECKPOINT --gguf METHOD [--out DIR]`: a trained checkpoint -> validated GGUF files."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from unsloth.commands.results import Exported


def register(subparsers) -> None:
    from unsloth.export.methods import ALIASES, METHODS

    p = subparsers.add_parser(
        "export",
        help="export a checkpoint to GGUF for llama.cpp, Ollama, LM Studio",
        description="Merge LoRA adapters into 16-bit weights, write GGUF, quantize with llama.cpp and "
        "check the result against transformers (greedy tokens on a few prompts). CHECKPOINT is a "
        "merged model directory or a LoRA adapter directory whose base model is on disk.",
        epilog="methods: " + ", ".join(f"{m.name} ({m.description})" for m in METHODS.values())
        + "; aliases: " + ", ".join(f"{a}={t}" for a, t in ALIASES.items()),
    )
    p.add_argument("checkpoint", help="model or LoRA adapter directory, or an `unsloth train` output directory")
    p.add_argument("--gguf", action="append", metavar="METHOD", required=True,
                   help="output type, e.g. q4_k_m; repeat or comma-separate for several (q8_0,q4_k_m)")
    p.add_argument("--out", help="output directory (default: CHECKPOINT-gguf beside the checkpoint)")
    p.add_argument("--name", help="file name stem (default: the checkpoint's, or the training run's, directory name)")
    p.add_argument("--modelfile", action="store_true", help="also write an Ollama Modelfile")
    p.add_argument("--no-validate", dest="validate", action="store_false",
                   help="skip the llama.cpp vs transformers comparison")
    p.add_argument("--json", action="store_true", help="print the files and validation report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> Exported:
    from unsloth.export.checkpoint import check_checkpoint, checkpoint_parameters, resolve_checkpoint
    from unsloth.export.files import ensure_free_space
    from unsloth.export.methods import export_bytes, resolve_all
    from unsloth.logs import log_handler

    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, handlers=[log_handler()])
    methods = [m for value in args.gguf for m in value.split(",") if m.strip()]
    # Everything that needs no model is checked first: a typo'd method, a damaged checkpoint, an output
    # folder that cannot be written or has no room. The CLI reports the ExportError.
    resolved = resolve_all(methods)
    checkpoint = resolve_checkpoint(Path(args.checkpoint).resolve())
    check_checkpoint(checkpoint)
    # unsloth-demo/merged -> files named after the run, beside it: unsloth-demo-gguf/unsloth-demo.Q8_0.gguf
    run_dir = checkpoint.parent if checkpoint.name in ("merged", "lora") else checkpoint
    out = Path(args.out) if args.out else run_dir.with_name(run_dir.name + "-gguf")
    ensure_free_space(out, export_bytes(checkpoint_parameters(checkpoint), resolved))
    result = _export(checkpoint, out, methods, args, default_name=run_dir.name)
    return Exported(result, {method: path.stat().st_size for method, path in result.files.items()})


def _export(checkpoint: Path, out: Path, methods: list[str], args: argparse.Namespace, default_name: str):
    from unsloth.export.gguf import save_pretrained_gguf
    from unsloth.export.checkpoint import load_checkpoint

    model, tokenizer = load_checkpoint(checkpoint, dtype=_load_dtype(checkpoint))
    return save_pretrained_gguf(
        model, out, tokenizer, methods, name=args.name or default_name,
        validate_export=args.validate, modelfile=args.modelfile,
    )


def _load_dtype(checkpoint: Path):
    """float32 when it fits comfortably in RAM (an exact reference for validation), else as saved."""
    import psutil
    import torch

    weights = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    adapter = checkpoint / "adapter_config.json"
    if adapter.is_file():
        base = Path(json.loads(adapter.read_text()).get("base_model_name_or_path") or checkpoint)
        weights += sum(f.stat().st_size for f in base.glob("*.safetensors"))
    float32_bytes = weights * 2  # 16-bit weights double in float32 (a float32 checkpoint loads as saved anyway)
    return torch.float32 if float32_bytes < psutil.virtual_memory().available * 0.4 else None
