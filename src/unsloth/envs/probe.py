"""Run inside a managed environment (``python -m unsloth.envs.probe``): what it really holds.

Prints one JSON object: the torch build, whether it sees a GPU, which modules import, and every
installed distribution's version. Standard library only until torch is imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys

MODULES = ("unsloth", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "gguf", "llama_cpp")


def probe(modules: tuple[str, ...] = MODULES) -> dict:
    out: dict = {"python": sys.version.split()[0], "executable": sys.executable, "imports": {}}
    try:
        import torch

        cuda, hip = getattr(torch.version, "cuda", None), getattr(torch.version, "hip", None)
        gpu = bool(torch.cuda.is_available())
        xpu = bool(getattr(torch, "xpu", None) and torch.xpu.is_available())
        mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
        out["torch"] = {
            "version": torch.__version__,
            "cuda": cuda,
            "hip": hip,
            "gpu_seen": gpu or xpu or mps,
            "device_name": torch.cuda.get_device_name(0) if gpu else None,
        }
    except Exception as exc:  # report, never crash: the caller decides what is fatal
        out["torch"] = {"error": f"{type(exc).__name__}: {exc}"}
    for name in modules:
        try:
            importlib.import_module(name)
            out["imports"][name] = "ok"
        except Exception as exc:
            out["imports"][name] = f"{type(exc).__name__}: {exc}"
    out["packages"] = {
        dist.metadata["Name"].lower(): dist.version for dist in importlib.metadata.distributions() if dist.metadata["Name"]
    }
    return out


if __name__ == "__main__":
    modules = tuple(sys.argv[1:]) or MODULES
    print(json.dumps(probe(modules)))
