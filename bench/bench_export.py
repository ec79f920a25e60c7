"""Benchmark (not a test): GGUF export time and peak RAM for a 1B-shaped model, against the size
of its weights.

    python bench/bench_export.py                      # Llama-3.2-1B shape, f16 + q8_0 + q4_k_m
    python bench/bench_export.py --validate --json    # also time the llama.cpp vs transformers check

Random weights (no download); the shape is what costs time and memory. Peak RAM is the process's
resident set sampled every 20 ms, reported above the level before each stage, so the figures read
as "extra memory the stage needs" next to the size of the weights it handles.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

GIB = 1024**3
SHAPE_1B = dict(  # Llama 3.2 1B
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
)


class PeakRss:
    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self.process = psutil.Process()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    @contextmanager
    def stage(self, results: dict, name: str):
        base = self.process.memory_info().rss
        self.peak, self._stop = base, threading.Event()
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self._stop.set()
        thread.join()
        results[name] = {"seconds": round(seconds, 2), "peak_extra_gib": round((self.peak - base) / GIB, 3)}


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. 0123456789"] * 100, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="q8_0,q4_k_m", help="quantized methods after f16")
    parser.add_argument("--validate", action="store_true", help="also time the validation")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from unsloth.export.converter import write_gguf
    from unsloth.models.merge import merged_tensors
    from unsloth.export.methods import resolve
    from unsloth.export.quantize import quantize
    from unsloth.export.validate import reference_run, validate

    rss = PeakRss()
    results: dict = {}
    config = AutoConfig.for_model("llama", **SHAPE_1B)
    with rss.stage(results, "build_model"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tok = tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        f16 = Path(tmp) / "model.F16.gguf"
        with rss.stage(results, "convert_f16"):
            write_gguf(model, tok, merged_tensors(model), f16, resolve("f16"))
        files = {"f16": f16.stat().st_size}
        for name in [m for m in args.methods.split(",") if m]:
            path = Path(tmp) / f"model.{name.upper()}.gguf"
            with rss.stage(results, f"quantize_{name}"):
                quantize(f16, path, resolve(name))
            files[name] = path.stat().st_size
        if args.validate:
            with rss.stage(results, "validate_f16"):
                report = validate(reference_run(model, tok), tok, f16, "f16")
            results["validate_f16"]["summary"] = report.summary()
    summary = {
        "shape": "Llama-3.2-1B", "parameters": n_params, "weights_gib": round(weights / GIB, 3),
        "cpu_threads": psutil.cpu_count(), "files_gib": {k: round(v / GIB, 3) for k, v in files.items()},
        "stages": results,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{summary['shape']}: {n_params / 1e9:.2f}B parameters, weights {summary['weights_gib']} GiB (bf16), "
          f"{summary['cpu_threads']} CPU threads")
    for stage, r in results.items():
        extra = f"  {r['summary']}" if "summary" in r else ""
        print(f"  {stage:<16} {r['seconds']:>8.1f} s   peak +{r['peak_extra_gib']:.2f} GiB "
              f"({r['peak_extra_gib'] / summary['weights_gib']:.2f} x weights){extra}")
    for name, size in summary["files_gib"].items():
        print(f"  {name:<16} {size:.2f} GiB")


if __name__ == "__main__":
    main()
